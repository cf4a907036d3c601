# Fixtures for the holder tests: a backend (Redis + PostgreSQL, or the embedded
# filesystem broker + SQLite; with DC_TEST_HOLDER_RABBITMQ=1 also RabbitMQ +
# PostgreSQL), the test app built from one JSON config, and holder worker
# subprocesses that are always killed at the end of the test.
from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from holder_app import CONFIG_ENV, make_app  # noqa: E402
from support import Proc, Processes, create_postgres_database, filesystem_broker  # noqa: E402

from durability_celery.app import Durability  # noqa: E402
from durability_celery.blocking import BlockingClient  # noqa: E402
from durability_celery.semaphore import DurabilitySemaphore  # noqa: E402

REDIS_DB = 1
RABBITMQ_URL = os.environ.get("DC_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
BACKENDS = ["redis+postgresql", "filesystem+sqlite"] + (
    ["rabbitmq+postgresql"] if os.environ.get("DC_TEST_HOLDER_RABBITMQ") else [])
"""The backends of every holder test that takes one. RabbitMQ runs them all but the
Redis-specific ones when asked (tests/holder/test_rabbitmq.py runs on it always)."""


@pytest.fixture(scope="session")
def holder_pg_url() -> Iterator[str]:
    """The holder tests' own PostgreSQL database (dropped at the end)."""
    url, drop = create_postgres_database(prefix="dc_holder")
    try:
        yield url
    finally:
        drop()


def embedded_broker(folder: Path) -> dict[str, Any]:
    """The shared filesystem broker settings, with the atomic-write variant of the
    transport (durability_celery.transport): plain `filesystem://` loses
    about one message in a hundred to a read-before-write race in kombu 5.7."""
    from durability_celery.transport import SCHEME

    return {**filesystem_broker(folder), "broker_url": f"{SCHEME}://"}


@dataclass
class Backend:
    name: str
    broker: dict[str, Any]
    database: str


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path,
            redis_url_factory: Callable[[int], str]) -> Backend:
    from support import reset_postgres

    if request.param.endswith("+postgresql"):
        url: str = request.getfixturevalue("holder_pg_url")
        reset_postgres(url)
        broker = (RABBITMQ_URL if request.param.startswith("rabbitmq")
                  else redis_url_factory(REDIS_DB))
        return Backend(request.param, {"broker_url": broker}, url)
    return Backend(request.param, embedded_broker(tmp_path),
                   f"sqlite:///{tmp_path / 'durability.db'}")


@pytest.fixture
def redis_pg_backend(tmp_path: Path, redis_url_factory: Callable[[int], str],
                     holder_pg_url: str) -> Backend:
    from support import reset_postgres

    reset_postgres(holder_pg_url)
    return Backend("redis+postgresql", {"broker_url": redis_url_factory(REDIS_DB)},
                   holder_pg_url)


@dataclass
class HolderRig:
    """One test's holder setup: the config, the app as clients see it, the holders."""

    config: dict[str, Any]
    durability: Durability
    processes: Processes
    clients: list[BlockingClient] = field(default_factory=list)
    holders: list[Proc] = field(default_factory=list)

    def semaphore(self, name: str = "jobs") -> DurabilitySemaphore:
        return self.durability.semaphore(name)

    def start_holder(self, *args: str, name: str = "holder") -> Proc:
        proc = self.start_worker("--durability-holder", "--pool=solo",
                                 f"--queues={self.durability.control_queue}", *args, name=name)
        proc.wait_for_log(r"durability holder: consuming", timeout=20)
        self.holders.append(proc)
        return proc

    def start_worker(self, *args: str, name: str) -> Proc:
        """A worker of this config's app (a client worker unless `args` make it a holder)."""
        env = {CONFIG_ENV: json.dumps(self.config)}
        return self.processes.start_worker("holder_app", *args, env=env, name=name,
                                           pythonpath=[HERE])

    def client(self, name: str = "jobs", *, timeout: float = 5.0) -> BlockingClient:
        client = BlockingClient(self.durability, name, timeout=timeout)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                client._disconnect()


def semaphore_config(name: str, database: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "database": database, **options}


def _rig_factory(processes: Processes, rigs: list[HolderRig]) -> Callable[..., HolderRig]:

    def make(backend: Backend, semaphores: list[dict[str, Any]],
             settings: dict[str, Any] | None = None) -> HolderRig:
        config = {**backend.broker, "semaphores": semaphores,
                  "settings": {"queue_prefix": f"dch{uuid.uuid4().hex[:6]}", "shards": 4,
                               "claim_margin": 0.2, **(settings or {})}}
        _app, durability = make_app(config)
        for semaphore in durability.semaphores.values():
            semaphore.migrate()
        rig = HolderRig(config, durability, processes)
        rigs.append(rig)
        return rig

    return make


def _close_rigs(rigs: list[HolderRig]) -> None:
    for rig in rigs:
        rig.close()
        for semaphore in rig.durability.semaphores.values():
            semaphore.close()


@pytest.fixture
def make_rig(processes: Processes) -> Iterator[Callable[..., HolderRig]]:
    """`make_rig(backend, [semaphore_config(...)], settings)`: holders die with the test."""
    rigs: list[HolderRig] = []
    try:
        yield _rig_factory(processes, rigs)
    finally:
        _close_rigs(rigs)


SHARED_SEMAPHORES: dict[str, dict[str, Any]] = {
    # one holder serves every test that only needs a running holder; each test
    # has its own semaphore settings here and its own keys
    "batch": {"limit": 20, "round_wait": 1.0, "round_period": 1.5},
    "many": {"limit": 2, "round_wait": 0.05, "round_period": 0.1, "grant_timeout": 5.0},
    # Limit 0: a key with demand stays contended, so its rounds are batched by period.
    "period": {"limit": 0, "round_wait": 0.05, "round_period": 0.6},
    "told": {"limit": 0, "round_wait": 1.0, "round_period": 0.6},
    "alarm": {"limit": 3, "round_wait": 0.05, "round_period": 0.1, "grant_timeout": 1.5},
    "alarm-leases": {"limit": 3, "round_wait": 0.05, "round_period": 0.1,
                     "grant_timeout": 1.5, "per_lease": 2},
}


@pytest.fixture(scope="session", params=BACKENDS)
def shared_rig(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[HolderRig]:
    """One holder worker per backend for the whole module (worker start-up costs ~5 s)."""
    from support import _redis_ping_flush, reset_postgres

    tmp = tmp_path_factory.mktemp("shared-holder")
    if request.param.endswith("+postgresql"):
        url: str = request.getfixturevalue("holder_pg_url")
        reset_postgres(url)
        broker = (RABBITMQ_URL if request.param.startswith("rabbitmq")
                  else _redis_ping_flush(REDIS_DB))
        backend = Backend(request.param, {"broker_url": broker}, url)
    else:
        backend = Backend(request.param, embedded_broker(tmp), f"sqlite:///{tmp / 'd.db'}")
    (tmp / "logs").mkdir()
    processes = Processes(tmp / "logs")
    rigs: list[HolderRig] = []
    try:
        rig = _rig_factory(processes, rigs)(backend, [
            semaphore_config(name, backend.database, **options)
            for name, options in SHARED_SEMAPHORES.items()
        ])
        rig.start_holder(name="shared-holder")
        yield rig
    finally:
        processes.stop_all()
        _close_rigs(rigs)
