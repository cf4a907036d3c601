# Private Redis and PostgreSQL servers that a fault test may crash and restart.
# Rule: never touch the machine's shared servers (6379, 5432); other engineers'
# tests run against them. Each private server lives in the test's temp dir, on a
# free port, and is killed at teardown whatever happened.
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_port(port: int, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class PrivateRedis:
    """A redis-server of our own. `durable`: its data is kept in an fsync-always
    append-only file, so a SIGKILL + restart is a broker crash that loses
    connections but not acknowledged writes (as a production broker with
    persistence would); otherwise nothing is written to disk."""

    def __init__(self, folder: Path, *, durable: bool = False) -> None:
        self.folder = folder
        self.durable = durable
        self.port = free_port()
        self.popen: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> float:
        """Start (or restart on the same port); returns the seconds it took."""
        began = time.monotonic()
        log = open(self.folder / f"redis-{self.port}.log", "ab")  # noqa: SIM115 - owned by the child
        self.popen = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.folder), "--save", "",
             "--appendonly", "yes" if self.durable else "no",
             "--appendfsync", "always", "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        _wait_port(self.port, timeout=10)
        return time.monotonic() - began

    def kill(self) -> None:
        """SIGKILL: every client connection breaks at once."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(5)


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    path = found[-1] if found else shutil.which(name)
    if not path:
        raise RuntimeError(f"PostgreSQL's {name} is not installed")
    return path


class PrivatePostgres:
    """A throwaway PostgreSQL cluster (initdb into a temp dir, run as `postgres`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.data = folder / "pgdata"
        self.port = free_port()
        self.init_seconds = 0.0

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 60) -> None:
        command = list(args)
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=timeout)

    def init(self) -> None:
        began = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:  # the folder is a fresh mkdtemp under /tmp (0700, root)
            shutil.chown(self.folder, "postgres", "postgres")
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres",
                  "--auth=trust", "--no-sync", "-E", "UTF8")
        self.init_seconds = time.monotonic() - began

    def start(self) -> float:
        began = time.monotonic()
        options = (f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c max_connections=100")
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-o", options,
                  "-l", str(self.folder / "pg.log"), "-w", "-t", "30", "start")
        _wait_port(self.port, timeout=10)
        return time.monotonic() - began

    def stop(self, mode: str = "immediate") -> None:
        """`immediate`: like a crash, every backend dies; recovery runs at start."""
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")
