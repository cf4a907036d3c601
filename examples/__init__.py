# Runnable examples: each file is both a Celery module (workers import it) and
# a script that starts an embedded holder and worker and runs a workload.
