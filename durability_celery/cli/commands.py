# The small commands of the CLI (usage, migrate, prune, holder) and how the CLI finds
# its semaphores: the user's Celery module (--app) or worker_config's
# environment variables. Rule: reading configuration never starts anything and
# never creates files; only `migrate` writes.
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CallerError, ConfigurationError, DurabilityError
from ..semaphore import DurabilitySemaphore

if TYPE_CHECKING:
    from worker_config.env import WorkerConfig

    from ..settings import DurabilitySettings


def describe_error(exc: BaseException) -> str | None:
    """One line for an error the user can act on; None for a bug (let it raise)."""
    from sqlalchemy.exc import SQLAlchemyError

    if isinstance(exc, DurabilityError):
        return str(exc)
    if isinstance(exc, SQLAlchemyError):
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return f"database unreachable or failing: {detail[0] if detail else type(exc).__name__}"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    kombu_error = _broker_error(exc)
    if kombu_error:
        return kombu_error
    return None


def _broker_error(exc: BaseException) -> str | None:
    try:
        from kombu.exceptions import OperationalError
    except ImportError:  # pragma: no cover - kombu is a dependency
        return None
    if isinstance(exc, OperationalError):
        return f"broker unreachable: {exc}"
    return None


# --------------------------------------------------------------------------
# where the semaphores come from


def _import_app(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or module_name.startswith("."):
        raise ConfigurationError(f"--app {spec!r}: give a module name (module or module:attr)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `celery -A`: your module lives where you are
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import --app {spec!r}: {exc}") from None
    for name in ([attr] if attr else ["app", "celery"]):
        if hasattr(module, name):
            return getattr(module, name)
    raise ConfigurationError(f"--app {spec!r}: the module has no Celery app (app or celery)")


@contextmanager
def semaphores_from(args: argparse.Namespace) -> Iterator[dict[str, DurabilitySemaphore]]:
    """The configured semaphores; those built here are closed afterwards."""
    _one_source(args)
    if getattr(args, "app", None):
        from ..app import durability_for

        yield dict(durability_for(_import_app(args.app)).semaphores)
        return
    from worker_config.env import build_semaphore

    config = _env_config(args)
    built: dict[str, DurabilitySemaphore] = {}
    try:
        for spec in config.semaphores:
            try:
                built[spec.name] = build_semaphore(spec, config.database_url)
            except ConfigurationError as exc:
                raise ConfigurationError(
                    f"DURABILITY_SEMAPHORES: semaphore {spec.name!r}: {exc}") from None
        yield built
    finally:
        for sem in built.values():
            sem.close()


def _one_source(args: argparse.Namespace) -> None:
    """--app brings its own databases: a --database beside it would be ignored, and a
    command such as `migrate --drop` would then act on a database the user did not type."""
    if getattr(args, "app", None) and getattr(args, "database", None):
        raise ConfigurationError("--database and --app: give one (the app names its own "
                                 "databases)")


def database_urls_of(args: argparse.Namespace) -> list[str]:
    """The databases the command acts on: each distinct one of the app's semaphores, or
    the one of --database / DURABILITY_DATABASE_URL."""
    if getattr(args, "app", None):
        with semaphores_from(args) as sems:
            if not sems:
                raise ConfigurationError(f"--app {args.app!r} configures no semaphores")
            return list(dict.fromkeys(
                sem.engine.url.render_as_string(hide_password=False)
                for sem in sems.values()))
    return [_env_config(args).database_url]


def database_source(args: argparse.Namespace) -> str:
    """What errors about the database URL name: the flag when the user typed one there."""
    return "--database" if getattr(args, "database", None) else "DURABILITY_DATABASE_URL"


def _env_config(args: argparse.Namespace) -> WorkerConfig:
    """worker_config's configuration, with --database in place of DURABILITY_DATABASE_URL;
    a bad URL is refused here, naming where the user typed it."""
    from worker_config.env import EnvError, load_config

    from .. import store

    env = dict(os.environ)
    if args.database:
        env["DURABILITY_DATABASE_URL"] = args.database
    source = database_source(args)
    try:
        config = load_config(env)
    except EnvError as exc:
        if exc.variable != "DURABILITY_DATABASE_URL":
            raise
        raise ConfigurationError(f"{source}: {exc.problem}") from None
    # Building an engine only parses the URL and loads its driver: nothing connects.
    store.create_engine(config.database_url, setting=source).dispose()
    return config


# --------------------------------------------------------------------------
# migrate


def migrate_command(args: argparse.Namespace) -> int:
    for url in database_urls_of(args):
        path = _sqlite_path(url)
        if path is not None and not args.drop:
            path.parent.mkdir(parents=True, exist_ok=True)  # the embedded default's folder
        outcome = DurabilitySemaphore.migrate(url, None if args.drop else _latest())
        print(_MIGRATED[outcome].format(url=_hide_password(url), version=_latest()))
    return 0


# What `migrate` says it did: "up to date" only when it changed nothing.
_MIGRATED = {
    "created": "schema version {version} created in {url}",
    "upgraded": "schema upgraded to version {version} in {url}",
    "current": "schema up to date in {url} (version {version}); nothing changed",
    "removed": "schema removed from {url}",
    "absent": "no schema in {url}; nothing removed",
}


def _latest() -> int:
    from ..store import SCHEMA_VERSION

    return SCHEMA_VERSION


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


# --------------------------------------------------------------------------
# usage


def _known(sems: dict[str, DurabilitySemaphore], name: str) -> DurabilitySemaphore:
    if name not in sems:
        known = ", ".join(sorted(sems)) or "none (set DURABILITY_SEMAPHORES or use --app)"
        raise ConfigurationError(f"unknown semaphore {name!r} (configured: {known})")
    return sems[name]


def usage_command(args: argparse.Namespace) -> int:
    with semaphores_from(args) as sems:
        sem = _known(sems, args.semaphore)
        _require_schema(sem)
        found = sem.usage(args.key)
    if args.json:
        print(json.dumps(found.to_dict(), indent=2, sort_keys=True))
    else:
        from rich.console import Console

        from .view import usage_table

        Console().print(usage_table(found))
    return 0


def _sqlite_path(url: str) -> Path | None:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    return None if parsed.database == ":memory:" else Path(parsed.database)


def _require_schema(sem: DurabilitySemaphore) -> None:
    from sqlalchemy import inspect

    from ..store import keys

    path = _sqlite_path(sem.engine.url.render_as_string(hide_password=False))
    if path is not None and not path.exists():
        raise ConfigurationError(
            f"no database at {path}: run `durability-celery migrate` first")
    try:
        with sem.engine.connect() as conn:
            present = inspect(conn).has_table(keys.name)
    except Exception as exc:
        message = describe_error(exc)
        if message is None:
            raise
        raise ConfigurationError(message) from None
    if not present:
        raise ConfigurationError(
            "the database has no durability schema: run `durability-celery migrate` first")


# --------------------------------------------------------------------------
# prune


def prune_command(args: argparse.Namespace) -> int:
    with semaphores_from(args) as sems:
        chosen = [_known(sems, name) for name in args.semaphores or sorted(sems)]
        if not chosen:
            raise ConfigurationError("no semaphore to prune (set DURABILITY_SEMAPHORES or "
                                     "use --app)")
        # Every check before the first delete: a refusal changes nothing.
        for sem in chosen:
            try:
                sem.check_idle_for(args.idle_for)
            except CallerError as exc:
                raise ConfigurationError(f"--idle-for, semaphore {sem.name!r}: {exc}") from None
            _require_schema(sem)
        for sem in chosen:
            count = sem.prune(idle_for=args.idle_for)
            print(f"{sem.name}: {count} idle key row(s) pruned")
    return 0


# --------------------------------------------------------------------------
# holder


def holder_command(args: argparse.Namespace) -> int:
    from ..wire.routing import control_queue

    settings = _settings_of(args.app)
    extra = list(args.celery_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    cmd = [sys.executable, "-m", "celery", "-A", args.app, "worker", "--durability-holder",
           "-Q", control_queue(settings.queue_prefix), "--concurrency", "1"]
    if args.shards:
        _check_shards(args.shards, settings.shards)
        cmd += ["--durability-shards", args.shards]
    cmd += extra
    if args.print_only:
        print(" ".join(cmd[1:]).replace("-m celery", "celery", 1))
        return 0
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)
    return 0  # pragma: no cover - exec does not return


def _check_shards(spec: str, shards: int) -> None:
    """The worker would refuse a bad range at start; refused here, `--print` never shows
    a command that cannot run."""
    from ..holder.service import parse_shards

    try:
        parse_shards(spec, shards)
    except ValueError as exc:
        raise ConfigurationError(f"--shards: {exc}") from None


def _settings_of(app_spec: str) -> DurabilitySettings:
    if app_spec.partition(":")[0] == "worker_config":
        from worker_config.env import load_config

        return load_config(dict(os.environ)).settings
    from ..app import durability_for

    return durability_for(_import_app(app_spec)).settings
