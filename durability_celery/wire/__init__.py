# The wire format between clients and the holder (JSON, version 1), written once:
# one module per message kind, each building and reading its messages (request.py,
# reply.py, error.py), the limits and field readers they share (fields.py), and
# where a message goes (routing.py). Rule: nothing here imports the package but
# `errors`, nor Celery or kombu, so the core, the client and the holder all speak it
# alike.
