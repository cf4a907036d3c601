# The small CLI commands against real databases: migrate / migrate --drop,
# usage (table and JSON), holder; and their error paths, which must print one
# line on stderr, exit 1 and never show a traceback.
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durability_celery.cli.main import main
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.store.schema import SCHEMA_VERSION

pytestmark = pytest.mark.timeout(120)
SEMAPHORES = json.dumps({"accounts": {"limit": 3, "keys": {"big": 9}, "groups": {"export": 1}}})


def subprocess_cli(*args: str, env: dict[str, str] | None = None,
                   cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m durability_celery ...` in a child process (the real entry point)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("DURABILITY_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "durability_celery", *args], env=full,
                          cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """`main(argv)` in this process (fast); env and cwd restored after the test."""

    def run(*args: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        for name in list(os.environ):
            if name.startswith("DURABILITY_"):
                monkeypatch.delenv(name)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out.out, out.err)

    return run


def one_line_error(done: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("durability-celery: error: ")
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in done.stdout + done.stderr


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migrate_and_drop(cli: Any, database_url: str) -> None:
    done = cli("migrate", "--database", database_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"schema version {SCHEMA_VERSION} created in "), done.stdout
    assert "up to date" not in done.stdout
    assert {"durability_semaphore_grants", "durability_semaphore_leases"} <= tables(database_url)
    done = cli("migrate", "--database", database_url)  # idempotent, and says so
    assert done.returncode == 0, done.stderr
    assert "schema up to date in " in done.stdout and "nothing changed" in done.stdout
    done = cli("migrate", "--drop", "--database", database_url)
    assert done.returncode == 0 and done.stdout.startswith("schema removed from ")
    assert not any(t.startswith("durability_") for t in tables(database_url))
    done = cli("migrate", "--drop", "--database", database_url)
    assert done.returncode == 0 and "nothing removed" in done.stdout


def test_migrate_embedded_default_creates_its_folder(cli: Any, tmp_path: Path) -> None:
    done = cli("migrate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / ".durability" / "durability.db").exists()


def test_usage_json_and_table(cli: Any, database_url: str) -> None:
    sem = DurabilitySemaphore("accounts", database=database_url, limit=9,
                              group_limit=lambda key, group: 1 if group == "export" else None)
    sem.migrate()
    sem.run_round("big", [{
        "type": "request", "v": 1, "semaphore": "accounts", "key": "big", "client_id": "c1",
        "demand": [{"group": "export", "count": 3, "oldest_at": 1.0},
                   {"group": None, "count": 2, "oldest_at": 1.0}],
        "grants": [], "leases": [], "supports_leases": False}])
    sem.close()
    env = {"DURABILITY_SEMAPHORES": SEMAPHORES, "DURABILITY_DATABASE_URL": database_url}
    done = cli("usage", "accounts", "big", "--json", env=env)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert (found["limit"], found["outstanding"], found["grants"]) == (9, 3, 2)
    groups = {g["group"]: g for g in found["groups"]}
    assert groups["export"]["outstanding"] == 1 and groups["export"]["limit"] == 1
    assert found["blocked"] == [{"group": "export", "reason": "group_limit", "queued": 2}]
    table = cli("usage", "accounts", "big", env={**env, "COLUMNS": "120"})
    assert table.returncode == 0, table.stderr
    assert "accounts / big: 3 in use of 9" in table.stdout
    assert "group_limit (2 queued)" in table.stdout


def test_prune_deletes_idle_keys_and_refuses_bad_input(cli: Any, database_url: str) -> None:
    sem = DurabilitySemaphore("accounts", database=database_url, limit=9)
    sem.migrate()

    def ask(key: str, at: float, grants: list[dict[str, Any]], count: int) -> dict[str, Any]:
        (reply,) = sem.run_round(key, [{
            "type": "request", "v": 1, "semaphore": "accounts", "key": key, "client_id": "c1",
            "demand": [{"group": None, "count": count, "oldest_at": at}] if count else [],
            "grants": grants, "leases": [], "supports_leases": False}], now=at)
        return reply

    (grant,) = ask("done", 1.0, [], 1)["grants"]  # a day's work, returned long ago
    ask("done", 4.0, [{"grant_id": grant["grant_id"], "claimed": 1, "released": 1}], 0)
    ask("busy", 1.0, [], 1)  # still holds its grant
    sem.close()
    env = {"DURABILITY_SEMAPHORES": SEMAPHORES, "DURABILITY_DATABASE_URL": database_url}
    one_line_error(cli("prune", "--idle-for", "0.5", env=env), "round_period")
    one_line_error(cli("prune", "nope", "--idle-for", "3600", env=env), "unknown semaphore")
    one_line_error(cli("prune", "--idle-for", "3600",
                       env={"DURABILITY_DATABASE_URL": database_url}), "no semaphore to prune")
    # Refused for one semaphore, pruned in none: every check comes before the first delete
    # ("accounts" sorts first and would accept 10 s).
    slow = json.dumps({"accounts": 9, "zzz": {"limit": 1, "round_period": 60}})
    one_line_error(cli("prune", "--idle-for", "10",
                       env={**env, "DURABILITY_SEMAPHORES": slow}),
                   "--idle-for, semaphore 'zzz': idle_for must be a number of seconds >= "
                   "round_period (60)")
    kept = DurabilitySemaphore("accounts", database=database_url, limit=9)
    assert sorted(kept.keys()) == ["busy", "done"]
    kept.close()
    done = cli("prune", "--idle-for", "3600", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "accounts: 1 idle key row(s) pruned"
    check = DurabilitySemaphore("accounts", database=database_url, limit=9)
    assert check.keys() == ["busy"]
    check.close()


def test_usage_with_app_module(cli: Any, database_url: str, tmp_path: Path) -> None:
    module = f"myapp_{os.urandom(4).hex()}"
    (tmp_path / f"{module}.py").write_text(
        "from celery import Celery\n"
        "from durability_celery.app import Durability\n"
        "from durability_celery.semaphore import DurabilitySemaphore\n"
        "app = Celery('myapp')\n"
        "def limit(key):\n"
        "    return 5 if key != 'bad' else 1 // 0\n"
        f"Durability(app, [DurabilitySemaphore('jobs', database={database_url!r}, "
        "limit=limit)])\n")
    DurabilitySemaphore.migrate(database_url)
    done = cli("usage", "jobs", "k", "--json", "--app", module, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["limit"] == 5
    bad = cli("usage", "jobs", "bad", "--app", module, cwd=tmp_path)
    sys.modules.pop(module, None)
    assert bad.returncode == 0, bad.stderr
    assert "jobs / bad: 0 in use of ?" in bad.stdout
    assert ("limit_resolution_error: limit callback raised ZeroDivisionError: integer "
            "division or modulo by zero; rounds admit nothing new for this key until it "
            "resolves (no limit known)") in " ".join(bad.stdout.split())  # wrapped caption


def test_migrate_with_an_app_creates_every_semaphores_database(cli: Any,
                                                                 tmp_path: Path) -> None:
    module = f"twodb_{os.urandom(4).hex()}"
    first, second = (f"sqlite:///{tmp_path / name}.db" for name in ("a", "b"))
    (tmp_path / f"{module}.py").write_text(
        "from celery import Celery\n"
        "from durability_celery.app import Durability\n"
        "from durability_celery.semaphore import DurabilitySemaphore\n"
        "app = Celery('twodb')\n"
        f"Durability(app, [DurabilitySemaphore('a', database={first!r}, limit=1),\n"
        f"                 DurabilitySemaphore('b', database={second!r}, limit=1)])\n")
    try:
        one_line_error(cli("migrate", "--app", module, "--database", "sqlite:///x.db",
                           cwd=tmp_path), "--database and --app: give one")
        assert not (tmp_path / "a.db").exists() and not (tmp_path / "x.db").exists()
        done = cli("migrate", "--app", module, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.strip().splitlines()) == 2, done.stdout
        for url in (first, second):
            assert "durability_semaphore_grants" in tables(url)
    finally:
        sys.modules.pop(module, None)


def test_unknown_semaphore(cli: Any, sqlite_url: str) -> None:
    env = {"DURABILITY_SEMAPHORES": SEMAPHORES, "DURABILITY_DATABASE_URL": sqlite_url}
    done = cli("usage", "nope", "k", env=env)
    one_line_error(done, "unknown semaphore 'nope'")
    one_line_error(done, "configured: accounts")


def test_database_unreachable(cli: Any) -> None:
    url = "postgresql://postgres@127.0.0.1:1/none"
    one_line_error(cli("migrate", "--database", url), "database unreachable")
    env = {"DURABILITY_SEMAPHORES": SEMAPHORES}
    one_line_error(cli("usage", "accounts", "k", "--database", url, env=env),
                   "database unreachable")


def test_database_without_schema(cli: Any, database_url: str, tmp_path: Path) -> None:
    env = {"DURABILITY_SEMAPHORES": SEMAPHORES, "DURABILITY_DATABASE_URL": database_url}
    if database_url.startswith("sqlite"):
        one_line_error(cli("usage", "accounts", "k", env=env), "run `durability-celery migrate`")
        sa.create_engine(database_url).connect().close()  # an empty file now
    one_line_error(cli("usage", "accounts", "k", env=env), "no durability schema")


def test_bad_configuration_is_one_line(cli: Any) -> None:
    one_line_error(cli("usage", "a", "k", env={"DURABILITY_SEMAPHORES": "a=x"}),
                   "DURABILITY_SEMAPHORES")
    one_line_error(cli("usage", "a", "k", env={"DURABILITY_SEMAPHORES": '{"a": 1, "a": 2}'}),
                   "DURABILITY_SEMAPHORES: 'a' is given twice")
    one_line_error(cli("usage", "a", "k", env={
        "DURABILITY_SEMAPHORES": '{"a": {"limit": 1, "grant_timeout": 0}}'}),
        "DURABILITY_SEMAPHORES: semaphore 'a': grant_timeout must be")
    one_line_error(cli("usage", "a", "k", "--app", "no_such_module_xyz"), "cannot import")
    for spec in (":app", ".relative"):
        one_line_error(cli("usage", "a", "k", "--app", spec), "give a module name")
    one_line_error(cli("usage", "a", "k", "--app", "os:name"), "no Durability configuration")


def test_a_bad_database_url_names_where_it_was_typed(cli: Any) -> None:
    # The flag the user typed, not the environment variable it stands in for.
    for argv in (("migrate",), ("usage", "a", "k"), ("prune", "--idle-for", "9")):
        done = cli(*argv, "--database", "nonsense", env={"DURABILITY_SEMAPHORES": "a=1"})
        one_line_error(done, "--database: not a database URL: 'nonsense'")
        assert "DURABILITY_DATABASE_URL" not in done.stderr
        one_line_error(cli(*argv, "--database", "mysql://u@h/db",
                           env={"DURABILITY_SEMAPHORES": "a=1"}),
                       "--database: 'mysql' is not supported")
    # Typed in the environment: the variable is what it names.
    one_line_error(cli("migrate", env={"DURABILITY_DATABASE_URL": "mysql://u@h/db"}),
                   "DURABILITY_DATABASE_URL: 'mysql' is not supported")
    one_line_error(cli("migrate", env={"DURABILITY_DATABASE_URL": "nonsense"}),
                   "DURABILITY_DATABASE_URL: not a database URL")
    one_line_error(cli("usage", "a", "k", "--app", "no_such_module_xyz"), "cannot import")


def test_demo_with_unreachable_broker(cli: Any, tmp_path: Path) -> None:
    done = subprocess_cli("demo", "--headless", "--broker", "redis://127.0.0.1:1/0",
               "--home", str(tmp_path / "demo"))
    one_line_error(done, "broker unreachable")
    assert not (tmp_path / "demo" / "logs" / "holder.log").exists()  # nothing was started
    assert not (tmp_path / "demo" / "demo.db").exists()  # nor any schema created


@pytest.mark.parametrize(("flag", "value", "problem"), [
    ("--broker", "ftp://x", "--broker: unsupported broker 'ftp'"),
    ("--broker", "nowhere", "--broker: not a broker URL"),
    ("--database", "ftp://x", "--database: 'ftp' is not supported"),
])
def test_demo_names_the_flag_whose_url_is_refused(tmp_path: Path, flag: str, value: str,
                                                   problem: str) -> None:
    # In a child: the demo exports its settings to its own environment.
    one_line_error(subprocess_cli("demo", "--headless", flag, value,
                                  "--home", str(tmp_path / "demo")), problem)
    assert not (tmp_path / "demo" / "demo.db").exists()


def test_holder_prints_the_exact_command(cli: Any) -> None:
    done = cli("holder", "--print", "--shards", "0-3", "--", "--loglevel", "INFO",
               env={"DURABILITY_QUEUE_PREFIX": "acme"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "celery -A worker_config worker --durability-holder -Q acme.holder.control "
        "--concurrency 1 --durability-shards 0-3 --loglevel INFO")
    for shards, problem in (("abc", "'abc' is not N or N-M"), ("0-", "'0-' is not N or N-M"),
                            ("99", "'99' is outside 0-15")):
        one_line_error(cli("holder", "--print", "--shards", shards), f"--shards: {problem}")


@pytest.mark.integration
def test_holder_starts_a_holder_worker(processes: Any, tmp_path: Path) -> None:
    env = {"DURABILITY_HOME": str(tmp_path / "home"), "DURABILITY_SEMAPHORES": "a=1",
           "DURABILITY_QUEUE_PREFIX": "cliholder"}
    proc = processes.spawn([sys.executable, "-m", "durability_celery", "holder", "--",
                            "--loglevel", "INFO", "--pool", "solo"],
                           name="holder", env=env, cwd=tmp_path)
    proc.wait_for_log(r"\bready\.", timeout=60)
    log = proc.log()
    assert "durability holder" in log.lower()
    assert "cliholder.holder.control" in log


def test_help_and_entry_point(cli: Any) -> None:
    done = subprocess_cli("--help")
    assert done.returncode == 0
    for command in ("demo", "usage", "migrate", "holder", "why", "top"):
        assert command in done.stdout
    usage_help = subprocess_cli("usage", "--help").stdout
    assert "a configured semaphore's name" in usage_help
    assert "the key whose usage to show" in usage_help
    version = subprocess_cli("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"durability-celery {metadata.version('durability-celery')}"
    script = Path(sys.executable).parent / "durability-celery"
    assert script.exists(), "pip install -e . installs the durability-celery script"


def test_a_timeout_out_of_range_is_a_usage_error() -> None:
    for argv, problem in ((("demo", "--timeout", "-1"), "between 0 and 86400, got '-1'"),
                          (("top", "--timeout", "99"), "between 0 and 60, got '99'")):
        done = subprocess_cli(*argv)
        assert done.returncode == 2, done
        assert done.stderr.strip().splitlines()[-1].endswith(
            f"error: argument --timeout: must be seconds {problem}"), done.stderr
