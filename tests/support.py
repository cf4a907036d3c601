# Helpers shared by the whole test suite (imported as `support`, a unique
# module name: several folders have their own conftest.py). Rule: a missing
# service FAILS the test with a message saying what to start; nothing skips;
# every process a test starts is killed (whole process group) when it ends.
from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

PG_HOST = os.environ.get("DC_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("DC_TEST_PG_PORT", "5432"))
PG_ADMIN_DB = os.environ.get("DC_TEST_PG_ADMIN_DB", "test")
REDIS_HOST = os.environ.get("DC_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("DC_TEST_REDIS_PORT", "6379"))
REDIS_DB_OFFSET = int(os.environ.get("DC_TEST_REDIS_DB_OFFSET", "0"))
"""Added to every Redis DB number the tests use (each area keeps its own numbers in its
modules), so a second run beside the default one can take other DBs: with 16 DBs,
offset 2 moves the holder's DB 1 to 3 and the gate tests' 4 and 5 to 6 and 7, DBs no
other test or benchmark uses. Folders whose numbers would collide are not meant to
run shifted beside the default run (tests/faults uses private Redis servers)."""
REPO_ROOT = Path(__file__).resolve().parent.parent


def require_service(name: str, check: Callable[[], object], *, hint: str = "") -> None:
    """Run `check`; if it raises, FAIL (never skip) naming the service and how to start it."""
    try:
        check()
    except Exception as exc:
        pytest.fail(
            f"{name} is not reachable ({type(exc).__name__}: {exc}). Tests never skip a "
            f"missing service: start it (`.ci/run` starts every service). {hint}".rstrip(),
            pytrace=False,
        )


def _pg_admin_connect(dbname: str = PG_ADMIN_DB) -> tuple[Any, str]:
    """Autocommit psycopg connection as `postgres`, falling back to `root`."""
    import psycopg

    last: Exception | None = None
    for user in ("postgres", "root"):
        try:
            conn = psycopg.connect(
                host=PG_HOST, port=PG_PORT, user=user, dbname=dbname,
                autocommit=True, connect_timeout=5,
            )
            return conn, user
        except psycopg.OperationalError as exc:
            last = exc
    assert last is not None
    raise last


def _pg_admin() -> tuple[Any, str]:
    holder: list[tuple[Any, str]] = []
    require_service(
        f"PostgreSQL at {PG_HOST}:{PG_PORT} (db {PG_ADMIN_DB!r})",
        lambda: holder.append(_pg_admin_connect()),
    )
    return holder[0]


def create_postgres_database(prefix: str = "dc_test") -> tuple[str, Callable[[], None]]:
    """Create a fresh database; returns (SQLAlchemy URL, drop function)."""
    admin, user = _pg_admin()
    name = f"{prefix}_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        try:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            admin.close()

    return f"postgresql+psycopg://{user}@{PG_HOST}:{PG_PORT}/{name}", drop


def reset_postgres(url: str) -> None:
    """Empty the session database: drop and recreate the public schema (~5 ms).

    Measured: CREATE + DROP DATABASE costs ~160 ms per test, this ~5 ms, and it
    leaves the same state a new database has (no tables). A connection leaked by
    an earlier test could hold a lock; after a short lock timeout those
    connections are terminated and the drop retried.
    """
    import psycopg

    dbname = url.rsplit("/", 1)[1]
    conn, _ = _pg_admin_connect(dbname)
    try:
        conn.execute("SET lock_timeout = '3s'")
        try:
            conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public")
        except psycopg.errors.LockNotAvailable:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public")
    finally:
        conn.close()


def redis_db(db: int) -> int:
    """The Redis DB number a test module's `db` stands for (shifted by REDIS_DB_OFFSET)."""
    return db + REDIS_DB_OFFSET


def redis_db_url(db: int) -> str:
    """The URL of the shared Redis's DB `db` (shifted by REDIS_DB_OFFSET)."""
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{redis_db(db)}"


def _redis_ping_flush(db: int) -> str:
    import redis

    url = redis_db_url(db)
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        require_service(f"Redis at {REDIS_HOST}:{REDIS_PORT}", client.ping)
        client.flushdb()
    finally:
        client.close()
    return url


def filesystem_broker(folder: Path) -> dict[str, Any]:
    """Celery settings for the embedded broker in `folder` (works across processes): kombu's
    filesystem transport with atomic writes (`durability-filesystem://`).

    Producers and consumers must use the same folders: in == out here.
    """
    data = folder / "broker-data"
    control = folder / "broker-control"
    for path in (data, control):
        path.mkdir(parents=True, exist_ok=True)
    return {
        "broker_url": "durability-filesystem://",
        "broker_transport_options": {
            "data_folder_in": str(data),
            "data_folder_out": str(data),
            "control_folder": str(control),
            "polling_interval": 0.1,
        },
    }


class Proc:
    """One child process running in its own process group, logging to a file."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path, name: str) -> None:
        self.popen = popen
        self.log_path = log_path
        self.name = name

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, pattern: str, *, timeout: float = 30.0, start: int = 0) -> re.Match[str]:
        """Wait until `pattern` (a regex) appears in the log after offset `start`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            found = regex.search(text, start)
            if found:
                return found
            if self.popen.poll() is not None:
                pytest.fail(
                    f"{self.name} exited with code {self.popen.returncode} before "
                    f"logging {pattern!r}. Log tail:\n{text[-4000:]}",
                    pytrace=False,
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{self.name} did not log {pattern!r} within {timeout}s. "
                    f"Log tail:\n{text[-4000:]}",
                    pytrace=False,
                )
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, *, timeout: float = 10.0) -> int | None:
        """SIGTERM the whole group, SIGKILL after `timeout`; returns the exit code."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        # Reap the group even if the leader already exited (orphaned pool children).
        self.kill()
        return self.popen.returncode

    def group_alive(self) -> bool:
        try:
            os.killpg(self.popen.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the whole group now (simulates a crash) and wait until it is gone."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        deadline = time.monotonic() + 5
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)


class Processes:
    """Starts child processes for one test and kills every one at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def spawn(
        self,
        cmd: Sequence[str],
        *,
        name: str,
        env: dict[str, str] | None = None,
        cwd: Path | str | None = None,
        pythonpath: Sequence[Path | str] = (),
    ) -> Proc:
        full_env = dict(os.environ)
        full_env.update(env or {})
        paths = [str(p) for p in pythonpath] + [str(REPO_ROOT)]
        if full_env.get("PYTHONPATH"):
            paths.append(full_env["PYTHONPATH"])
        full_env["PYTHONPATH"] = os.pathsep.join(paths)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        log_path = self.log_dir / f"{name}-{len(self.procs)}.log"
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                list(cmd), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                cwd=str(cwd) if cwd else None, start_new_session=True,
            )
        proc = Proc(popen, log_path, name)
        self.procs.append(proc)
        return proc

    def start_worker(
        self,
        app_module: str,
        *args: str,
        env: dict[str, str] | None = None,
        name: str = "worker",
        cwd: Path | str | None = None,
        pythonpath: Sequence[Path | str] = (),
        ready_timeout: float = 30.0,
    ) -> Proc:
        """`celery -A app_module worker <args>`; returns once it logged "ready."."""
        if not any(a.startswith(("-n", "--hostname")) for a in args):
            args = (*args, f"--hostname={name}-{secrets.token_hex(3)}@%h")
        cmd = [sys.executable, "-m", "celery", "-A", app_module, "worker",
               "--loglevel=INFO", "--without-mingle", "--without-gossip", *args]
        proc = self.spawn(cmd, name=name, env=env, cwd=cwd, pythonpath=pythonpath)
        proc.wait_for_log(r"\bready\.", timeout=ready_timeout)
        return proc

    def start_beat(
        self,
        app_module: str,
        *args: str,
        env: dict[str, str] | None = None,
        name: str = "beat",
        cwd: Path | str | None = None,
        pythonpath: Sequence[Path | str] = (),
    ) -> Proc:
        """`celery -A app_module beat` with its schedule file in the log dir."""
        schedule = self.log_dir / f"{name}-{len(self.procs)}-schedule"
        cmd = [sys.executable, "-m", "celery", "-A", app_module, "beat", "--loglevel=INFO",
               f"--schedule={schedule}", *args]
        proc = self.spawn(cmd, name=name, env=env, cwd=cwd, pythonpath=pythonpath)
        proc.wait_for_log(r"beat: Starting", timeout=30)
        return proc

    def stop_all(self) -> None:
        """SIGKILL every group at once, then reap each. Teardown only: the test has
        checked what it needed, and every database, queue and key it used is its own
        or emptied before the next test, so Celery's warm shutdown (seconds per worker,
        more while a long task runs) would buy nothing. A test that needs a graceful
        stop calls `Proc.stop` itself."""
        for proc in self.procs:
            proc.signal(signal.SIGKILL)
        for proc in reversed(self.procs):
            proc.kill()
