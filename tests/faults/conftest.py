# Fixtures of the fault-injection suite. Its harness (harness.py) reuses the gate tests' `Cluster`
# (one holder + client workers as real subprocesses from one JSON config, an
# independent Redis ledger) with its own app module (tests/faults/fault_app.py:
# live limits, slow rounds, wire faults). Every test has a PRIVATE Redis server
# (tests/faults/services.py; DB 0 broker, DB 1 ledger), so runs of this folder
# never collide, even two at once; scenarios that restart a service restart a
# private Redis or PostgreSQL of their own, never the machine's shared ones.
from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import Processes, create_postgres_database

from tests.faults.harness import FaultCluster
from tests.faults.services import PrivatePostgres, PrivateRedis

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.fixture(scope="session")
def fault_database() -> Iterator[str]:
    """This suite's own database on the shared PostgreSQL, migrated once."""
    from durability_celery.semaphore import DurabilitySemaphore

    url, drop = create_postgres_database("dc_faults")
    try:
        DurabilitySemaphore.migrate(url)
        yield url
    finally:
        drop()


@pytest.fixture
def fault_cluster(processes: Processes, fault_database: str, tmp_path: Path
                  ) -> Iterator[Callable[..., FaultCluster]]:
    """`fault_cluster(limits=..., broker_url=..., database=..., env=...)` -> FaultCluster."""
    services = PrivateRedis(tmp_path)
    services.start()
    ledger_url = services.url(1)
    made: list[FaultCluster] = []

    def make(*, limits: dict[str, int], group_limits: dict[str, int] | None = None,
             leases: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
             transport: dict[str, Any] | None = None, broker_url: str | None = None,
             database: str | None = None, env: dict[str, str] | None = None,
             **semaphore: Any) -> FaultCluster:
        broker = broker_url or services.url(0)
        for url in {broker, ledger_url}:
            client = redis.Redis.from_url(url)
            client.flushdb()
            client.close()
        config = {
            "broker_url": broker, "ledger_url": ledger_url,
            "database": database or fault_database,
            "broker_transport_options": transport or {},
            "limits": limits, "group_limits": group_limits or {},
            "semaphore": {"name": f"flt-{secrets.token_hex(4)}", "leases": leases,
                          **semaphore},
            "settings": {"queue_prefix": f"dcf{secrets.token_hex(3)}", "shards": 2,
                         "request_timeout": 3.0, **(settings or {})},
        }
        cluster = FaultCluster(processes, config, env)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        processes.stop_all()
        for cluster in made:
            cluster.semaphore.close()
        services.kill()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A durable Redis server of this test only (it may be killed and restarted)."""
    server = PrivateRedis(tmp_path, durable=True)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL cluster of this test only, schema migrated (stopped and removed after)."""
    from durability_celery.semaphore import DurabilitySemaphore

    folder = Path(tempfile.mkdtemp(prefix="dc-faults-pg-"))
    server = PrivatePostgres(folder)
    try:
        server.init()
        server.start()
        DurabilitySemaphore.migrate(server.url)
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
