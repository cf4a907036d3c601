# The `durability-celery` command: demo, usage, migrate, holder (see main.py).
