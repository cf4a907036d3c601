# The wire format between clients and the holder (JSON, version 1), written once.
# Rule: nothing here imports the package but `errors`, nor Celery or kombu, so the
# core, the client and the holder all speak it alike.
