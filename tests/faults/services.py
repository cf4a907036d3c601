# Private Redis and PostgreSQL servers that a fault test may crash and restart.
# Rule: never touch the machine's shared servers (6379, 5432); other engineers'
# tests run against them. Each private server lives in the test's temp dir, on a
# free port, and is killed at teardown whatever happened.
from __future__ import annotations

import contextlib
import glob
import json
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
        """SIGKILL: every client connection breaks at once. A durable server's
        append-only file is copied as it stood at the kill (`popped_at_kill`)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(5)
            aof = self.folder / "appendonlydir"
            if self.durable and aof.is_dir():
                shutil.rmtree(self.folder / "aof-at-kill", ignore_errors=True)
                shutil.copytree(aof, self.folder / "aof-at-kill")

    def popped_at_kill(self, *, tail: int = 20) -> dict[str, str]:
        """Task ids (and their delivery tags) whose message a pop took off a queue
        among the last `tail` commands before the last kill, with no delivery recorded
        after it.

        kombu's Redis transport pops a message, then records it as delivered in its
        `unacked` hash. A broker killed in between has the pop on disk and the message
        nowhere: if the client read the reply, the gate keeps the message to give back
        (worker.teardown.watch_pops, which logs its delivery tag); if the reply never
        reached it, the message is lost, as under plain Celery, and no client can know.
        Replays the list commands of the append-only file to learn which message each
        pop took."""
        folder = self.folder / "aof-at-kill"
        manifest = (folder / "appendonly.aof.manifest").read_text().split("\n")
        commands: list[list[bytes]] = []
        for line in manifest:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == "i":  # incremental files, in order
                commands += _resp_commands((folder / fields[1]).read_bytes())
        lists: dict[bytes, list[bytes]] = {}
        popped: dict[str, tuple[int, str]] = {}  # task id -> (pop's index, delivery tag)
        for index, (name, *args) in enumerate(commands):
            verb = name.upper()
            if verb in (b"LPUSH", b"RPUSH"):
                queue = lists.setdefault(args[0], [])
                for value in args[1:]:
                    queue.insert(0, value) if verb == b"LPUSH" else queue.append(value)
                    popped.pop(_task_id(_message(value)), None)
            elif verb in (b"RPOP", b"LPOP") and lists.get(args[0]):
                message = _message(lists[args[0]].pop(-1 if verb == b"RPOP" else 0))
                popped[_task_id(message)] = (index, _delivery_tag(message))
            elif verb == b"DEL":
                for key in args:
                    lists.pop(key, None)
            elif verb == b"HSET" and args[0] == b"unacked":
                for value in args[2::2]:  # kombu's record: [envelope, exchange, routing key]
                    record = json.loads(value)
                    envelope = _message(record[0] if isinstance(record, list) else None)
                    popped.pop(_task_id(envelope), None)
        cutoff = len(commands) - tail
        return {task: tag for task, (index, tag) in popped.items() if task and index >= cutoff}


def _resp_commands(data: bytes) -> list[list[bytes]]:
    """The commands of an append-only file: RESP arrays of bulk strings."""
    commands: list[list[bytes]] = []
    at = 0
    with contextlib.suppress(ValueError):  # a command cut short by the kill ends it
        while at < len(data):
            end = data.index(b"\r\n", at)
            count, at = int(data[at + 1:end]), end + 2
            command = []
            for _ in range(count):
                end = data.index(b"\r\n", at)
                size, at = int(data[at + 1:end]), end + 2
                if at + size + 2 > len(data):
                    raise ValueError("truncated")
                command.append(data[at:at + size])
                at += size + 2
            commands.append(command)
    return commands


def _message(value: bytes | object) -> dict[str, object]:
    """A kombu envelope pushed on a list or kept in the unacked hash; {} for anything else
    (another list's entries)."""
    if isinstance(value, bytes):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def _delivery_tag(message: dict[str, object]) -> str:
    properties = message.get("properties")
    return str(properties.get("delivery_tag", "")) if isinstance(properties, dict) else ""


def _task_id(message: dict[str, object]) -> str:
    headers = message.get("headers")
    return str(headers.get("id", "")) if isinstance(headers, dict) else ""


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
