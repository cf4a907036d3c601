# `python -m durability_celery`: the same as the `durability-celery` command.
import sys

from .cli.main import main

sys.exit(main())
