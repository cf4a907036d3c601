# The `durability-celery` command (also `python -m durability_celery`): demo,
# usage, migrate, prune, why, top, holder. Rule: an error the user can fix (database or broker
# unreachable, unknown semaphore, bad configuration) prints ONE line on stderr
# and exits 1, never a traceback.
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import DurabilityError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_FAILED_VERDICT = 2


def _add_source_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-A", "--app", metavar="MODULE",
        help="your Celery module (module or module:attr) with a Durability configuration; "
        "default: worker_config, configured by DURABILITY_* environment variables",
    )
    parser.add_argument(
        "--database", metavar="URL",
        help="database URL (overrides DURABILITY_DATABASE_URL; not with --app, whose "
        "semaphores name their own)",
    )


def _add_live_options(parser: argparse.ArgumentParser) -> None:
    """Options of the commands that ask running workers (why, top)."""
    parser.add_argument("-A", "--app", metavar="MODULE", default="worker_config",
                        help="your Celery module (module or module:attr; default: "
                        "worker_config)")
    parser.add_argument("--timeout", type=_seconds_up_to(60), default=1.0, metavar="SECONDS",
                        help="how long to wait for the workers' answers (default 1)")


def _seconds_up_to(high: float) -> Callable[[str], float]:
    """An argparse type: seconds above 0, at most `high`."""
    def seconds(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 < value <= high:
            raise argparse.ArgumentTypeError(
                f"must be seconds between 0 and {high:g}, got {raw!r}")
        return value
    return seconds


def _version() -> str:
    """The installed distribution's version (what pip shows), not a copy kept in code."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("durability-celery")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="durability-celery",
        description="One shared concurrency budget per key across every Celery worker.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(commands)
    _add_database_commands(commands)
    _add_live_commands(commands)
    _add_holder(commands)
    return parser


def _add_demo(commands: Any) -> None:
    demo = commands.add_parser("demo", help="run a live demo: holder, two client workers, beat")
    demo.add_argument("--broker", metavar="URL",
                      help="broker URL, e.g. redis://127.0.0.1:6379/0 or "
                      "amqp://guest@127.0.0.1//  (default: embedded filesystem broker)")
    demo.add_argument("--database", metavar="URL",
                      help="database URL, e.g. postgresql://postgres@127.0.0.1/test "
                      "(default: a SQLite file in the demo's folder)")
    demo.add_argument("--headless", action="store_true",
                      help="plain progress lines instead of the live view (for CI and logs)")
    demo.add_argument("--tasks", type=int, default=90, metavar="N",
                      help="tasks to publish (default 90: about a minute)")
    demo.add_argument("--task-seconds", default="1-3", metavar="MIN-MAX",
                      help="how long each task runs, a random range (default 1-3)")
    demo.add_argument("--no-leases", action="store_true",
                      help="grants only: every task start waits for a round trip to the holder")
    demo.add_argument("--home", metavar="DIR",
                      help="folder for the demo's files (default: a new temporary folder)")
    demo.add_argument("--timeout", type=_seconds_up_to(86_400), default=240.0, metavar="SECONDS",
                      help="give up waiting for tasks after this long (default 240)")
    demo.add_argument("--json", action="store_true", help="print the verdict as JSON")
    demo.add_argument("--snapshot-svg", metavar="PATH", help=argparse.SUPPRESS)


def _add_database_commands(commands: Any) -> None:
    usage = commands.add_parser("usage", help="the holder's usage of one key")
    usage.add_argument("semaphore", help="a configured semaphore's name")
    usage.add_argument("key", help="the key whose usage to show, e.g. an account id")
    usage.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_source_options(usage)

    migrate = commands.add_parser("migrate", help="create or upgrade the database schema")
    migrate.add_argument("--drop", action="store_true", help="remove the schema instead")
    _add_source_options(migrate)

    prune = commands.add_parser(
        "prune", help="delete the rows of keys that hold nothing and have been idle")
    prune.add_argument("--idle-for", type=float, required=True, metavar="SECONDS",
                       help="prune keys with no round for this long (at least round_period)")
    prune.add_argument("semaphores", nargs="*", metavar="SEMAPHORE",
                       help="semaphores to prune (default: every configured one)")
    _add_source_options(prune)


def _add_live_commands(commands: Any) -> None:
    why = commands.add_parser(
        "why", help="why a task waits: its worker, key, group, reason and place in line")
    why.add_argument("task_id", metavar="TASK_ID", help="the task's id (what .delay() returned)")
    _add_live_options(why)
    why.add_argument("--json", action="store_true", help="print JSON instead of text")

    top = commands.add_parser(
        "top", help="a live view of a running deployment's busiest keys")
    _add_live_options(top)
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--limit", type=int, default=10, metavar="N",
                     help="show the N busiest keys (default 10)")
    top.add_argument("--json", action="store_true", help="print one frame as JSON and exit")


def _add_holder(commands: Any) -> None:
    holder = commands.add_parser(
        "holder", help="start a holder worker (runs celery ... worker --durability-holder)")
    holder.add_argument("-A", "--app", metavar="MODULE", default="worker_config",
                        help="your Celery module (default: worker_config)")
    holder.add_argument("--shards", "--durability-shards", metavar="SHARDS",
                        help="holder shards to serve, e.g. 0-7 (default: all); the worker's "
                             "--durability-shards")
    holder.add_argument("--print", dest="print_only", action="store_true",
                        help="print the celery command instead of running it")
    holder.add_argument("celery_args", nargs=argparse.REMAINDER,
                        help="more `celery worker` options, after --")


def run(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "usage":
        from .commands import usage_command

        return usage_command(args)
    if args.command == "migrate":
        from .commands import migrate_command

        return migrate_command(args)
    if args.command == "prune":
        from .commands import prune_command

        return prune_command(args)
    if args.command == "why":
        from .why import why_command

        return why_command(args)
    if args.command == "top":
        from .top import top_command

        return top_command(args)
    from .commands import holder_command

    return holder_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run a command; user-fixable errors become one line and exit 1."""
    from .commands import describe_error

    try:
        return run(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("durability-celery: interrupted", file=sys.stderr)
        return 130
    except (DurabilityError, OSError) as exc:
        print(f"durability-celery: error: {describe_error(exc) or exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        message = describe_error(exc)
        if message is None:
            raise
        print(f"durability-celery: error: {message}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
