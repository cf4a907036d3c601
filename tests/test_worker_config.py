# worker_config: environment variables -> validated configuration -> a Celery
# app whose three roles work, on the embedded default and on Redis / RabbitMQ +
# PostgreSQL. Bad values must fail at start-up naming the variable.
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from durability_celery.cli import ledger
from durability_celery.core.config import Over, Strict, Under
from durability_celery.wire.fields import MAX_ID_LENGTH
from worker_config.env import EnvError, build_semaphore, load_config, make_home, parse_semaphores

REDIS_DB = 8
pytestmark = pytest.mark.timeout(120)


def limit_of(key: str) -> int:
    """Used by the 'module:function' test below."""
    return len(key)


# --------------------------------------------------------------------------
# parsing


def test_embedded_default(tmp_path: Path) -> None:
    config = load_config({}, cwd=tmp_path)
    assert config.home == tmp_path / ".durability"
    assert config.broker_url == "durability-filesystem://"
    opts = config.broker_transport_options
    assert opts["data_folder_in"] == opts["data_folder_out"] == str(
        tmp_path / ".durability" / "broker" / "data")
    assert config.database_url == f"sqlite:///{tmp_path / '.durability' / 'durability.db'}"
    assert config.semaphores == () and config.settings.shards == 16


def test_plain_filesystem_url_gets_the_atomic_transport(tmp_path: Path) -> None:
    config = load_config({"DURABILITY_BROKER_URL": "filesystem://"}, cwd=tmp_path)
    assert config.broker_url == "durability-filesystem://" and config.embedded_broker


def test_redis_and_rabbitmq_brokers(tmp_path: Path) -> None:
    redis = load_config({"DURABILITY_BROKER_URL": "redis://h:6379/1"}, cwd=tmp_path)
    assert redis.broker_transport_options == {"visibility_timeout": 3600.0}
    longer = load_config({"DURABILITY_BROKER_URL": "redis://h/1",
                          "DURABILITY_VISIBILITY_TIMEOUT": "7200"}, cwd=tmp_path)
    assert longer.broker_transport_options["visibility_timeout"] == 7200.0
    amqp = load_config({"DURABILITY_BROKER_URL": "amqp://guest@h//"}, cwd=tmp_path)
    assert amqp.broker_transport_options == {}


def test_settings_from_env(tmp_path: Path) -> None:
    config = load_config({
        "DURABILITY_SHARDS": "4", "DURABILITY_QUEUE_PREFIX": "acme",
        "DURABILITY_RECLAIM_INTERVAL": "2.5", "DURABILITY_SUPPORTS_LEASES": "no",
        "DURABILITY_MAX_HELD": "none", "DURABILITY_HOLD_DEADLINE": "120",
        "DURABILITY_SHARD_QUEUE_TYPE": "quorum", "DURABILITY_CLAIM_MARGIN": "null",
    }, cwd=tmp_path)
    s = config.settings
    assert (s.shards, s.queue_prefix, s.reclaim_interval) == (4, "acme", 2.5)
    assert s.shard_queue_arguments == {"x-queue-type": "quorum"}
    assert s.supports_leases is False and s.max_held is None and s.hold_deadline == 120.0
    assert s.claim_margin is None


@pytest.mark.parametrize(("env", "variable", "fragment"), [
    ({"DURABILITY_SHARDS": "many"}, "DURABILITY_SHARDS", "integer"),
    ({"DURABILITY_SHARDS": "0"}, "DURABILITY_SHARDS", "between 1 and 4096"),
    ({"DURABILITY_SUPPORTS_LEASES": "maybe"}, "DURABILITY_SUPPORTS_LEASES", "true or false"),
    ({"DURABILITY_CLAIM_MARGIN": "soon"}, "DURABILITY_CLAIM_MARGIN",
     "must be a number, got 'soon'"),
    ({"DURABILITY_MAX_HELD": "4.5"}, "DURABILITY_MAX_HELD", "must be an integer, got '4.5'"),
    ({"DURABILITY_QUEUE_PREFIX": "a b"}, "DURABILITY_QUEUE_PREFIX", "queue_prefix"),
    ({"DURABILITY_SHARD_QUEUE_TYPE": "stream"}, "DURABILITY_SHARD_QUEUE_TYPE",
     "'classic' or 'quorum', got 'stream'"),
    ({"DURABILITY_BROKER_URL": "kafka://x"}, "DURABILITY_BROKER_URL", "unsupported"),
    ({"DURABILITY_BROKER_URL": "localhost"}, "DURABILITY_BROKER_URL", "not a broker URL"),
    ({"DURABILITY_BROKER_URL": "redis://h", "DURABILITY_VISIBILITY_TIMEOUT": "-1"},
     "DURABILITY_VISIBILITY_TIMEOUT", "between"),
    ({"DURABILITY_DATABASE_URL": "nowhere"}, "DURABILITY_DATABASE_URL", "not a database URL"),
    ({"DURABILITY_SEMAPHORES": "accounts"}, "DURABILITY_SEMAPHORES", "NAME=LIMIT"),
    ({"DURABILITY_SEMAPHORES": "accounts=-1"}, "DURABILITY_SEMAPHORES", "non-negative"),
    ({"DURABILITY_SEMAPHORES": "a=1,a=2"}, "DURABILITY_SEMAPHORES", "twice"),
    ({"DURABILITY_SEMAPHORES": "{bad"}, "DURABILITY_SEMAPHORES", "invalid JSON"),
    ({"DURABILITY_SEMAPHORES": '{"a": {"limt": 1}}'}, "DURABILITY_SEMAPHORES", "limt"),
    ({"DURABILITY_SEMAPHORES": '{"a": {"limit": 1, "leases": {"provisioning": "x"}}}'},
     "DURABILITY_SEMAPHORES", "strict, under or over"),
    ({"DURABILITY_SEMAPHORES": '{"a": {"limit": 1, "leases": {"ttl": 0}}}'},
     "DURABILITY_SEMAPHORES", "ttl"),
    ({"DURABILITY_SEMAPHORES": '{"a": {"limit": "nosuchmodule:f"}}'},
     "DURABILITY_SEMAPHORES", "cannot import"),
])
def test_bad_values_name_the_variable(
    tmp_path: Path, env: dict[str, str], variable: str, fragment: str
) -> None:
    with pytest.raises(EnvError) as raised:
        load_config(env, cwd=tmp_path)
    assert raised.value.variable == variable
    assert str(raised.value).startswith(f"{variable}: ")
    assert fragment in str(raised.value)


def test_semaphores_short_form() -> None:
    specs = parse_semaphores("accounts=10, exports=3")
    assert [(s.name, s.limit) for s in specs] == [("accounts", 10), ("exports", 3)]


def test_semaphore_names_as_long_as_the_store_saves() -> None:
    longest = "s" * MAX_ID_LENGTH
    assert [s.name for s in parse_semaphores(f"{longest}=1")] == [longest]
    with pytest.raises(EnvError, match="bad semaphore name"):
        parse_semaphores(f"{longest}s=1")


def test_semaphores_json_form() -> None:
    raw = json.dumps({
        "accounts": {"limit": 5, "keys": {"big": 50}, "group_limit": 3, "groups": {"export": 1},
                     "grant_timeout": 20, "round_period": 1, "handoff_window": 0,
                     "leases": {"provisioning": "under", "reserve": 2, "permits_per_lease": 8}},
        "bursty": {"limit": 10, "leases": {"provisioning": "over", "ratio": 0.5}},
        "plain": 4,
        "strict": {"limit": 1, "leases": True},
        "computed": {"limit": "test_worker_config:limit_of"},
    })
    specs = {s.name: s for s in parse_semaphores(raw)}
    accounts = specs["accounts"]
    assert callable(accounts.limit) and accounts.limit("big") == 50 and accounts.limit("x") == 5
    assert accounts.group_limit is not None
    assert accounts.group_limit("x", "export") == 1 and accounts.group_limit("x", "sync") == 3
    assert dict(accounts.timing) == {"grant_timeout": 20.0, "round_period": 1.0,
                                     "handoff_window": 0.0}
    assert accounts.leases is not None and accounts.leases.provisioning == Under(reserve=2)
    assert accounts.leases.permits_per_lease == 8
    bursty = specs["bursty"].leases
    assert bursty is not None and bursty.provisioning == Over(ratio=0.5)
    assert specs["plain"].limit == 4 and specs["plain"].leases is None
    assert specs["strict"].leases is not None
    assert specs["strict"].leases.provisioning == Strict()
    computed = specs["computed"].limit
    assert callable(computed) and computed("abcd") == 4


def test_semaphore_limits_reach_the_holder(database_url: str) -> None:
    [spec] = parse_semaphores('{"accounts": {"limit": 2, "keys": {"big": 7}}}')
    sem = build_semaphore(spec, database_url)
    try:
        sem.migrate()
        assert sem.usage("big").limit == 7 and sem.usage("small").limit == 2
    finally:
        sem.close()


# --------------------------------------------------------------------------
# the app


def test_build_app_settings_and_roles(tmp_path: Path) -> None:
    from durability_celery.beat import SCHEDULE_NAME
    from worker_config import build_app

    config = load_config({"DURABILITY_SEMAPHORES": "accounts=3",
                          "DURABILITY_IMPORTS": "a.b, c"}, cwd=tmp_path)
    app, durability = build_app(config, main="t_build")
    conf = app.conf
    assert conf.worker_prefetch_multiplier == 1 and conf.task_acks_late is False
    assert conf.task_serializer == "json" and conf.accept_content == ["json"]
    assert list(conf.imports) == ["a.b", "c"]
    assert Path(config.broker_transport_options["data_folder_in"]).is_dir()
    assert list(durability.semaphores) == ["accounts"]
    assert conf.beat_schedule[SCHEDULE_NAME]["options"]["queue"] == durability.control_queue
    assert "--durability-holder" in {o for opt in app.user_options["worker"] for o in opt.opts}


def run_celery(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "worker_config", *args],
        env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=60,
    )


def test_bad_variable_stops_celery_with_one_line(tmp_path: Path) -> None:
    done = run_celery(["worker"], {"DURABILITY_SHARDS": "0"}, tmp_path)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "worker_config: DURABILITY_SHARDS: shards must be between 1 and 4096, got 0"]
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize(("spec", "problem"), [
    ("abc", "'abc' is not N or N-M"),
    ("0-99", "'0-99' is outside 0-15 (DurabilitySettings.shards=16)")])
def test_bad_shard_list_stops_the_holder_with_one_line(tmp_path: Path, spec: str,
                                                       problem: str) -> None:
    done = run_celery(["worker", "--durability-holder", f"--durability-shards={spec}"], {},
                      tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: Invalid value for '--durability-shards': {problem}")
    assert "Traceback" not in done.stderr + done.stdout


# --------------------------------------------------------------------------
# the three roles for real


def _run_roles(processes: Any, env: dict[str, str], tmp_path: Path) -> None:
    """Holder + client worker + beat from worker_config; admitted tasks run within limits.

    (The embedded default runs the same roles in tests/cli/test_demo.py.)"""
    import os

    from durability_celery.semaphore import DurabilitySemaphore

    os_env = {**env, "DURABILITY_HOME": str(tmp_path / "home"),
              "DURABILITY_SEMAPHORES": json.dumps({"wc": {
                  "limit": 2, "round_wait": 0.1, "round_period": 0.5}}),
              "DURABILITY_IMPORTS": "durability_celery.cli.demo_tasks",
              "DURABILITY_DEMO_SEMAPHORE": "wc",
              "DURABILITY_DEMO_LEDGER": str(tmp_path / "ledger.jsonl"),
              "DURABILITY_QUEUE_PREFIX": f"wc{os.getpid()}", "DURABILITY_SHARDS": "2"}
    config = load_config(os_env)
    make_home(config)
    DurabilitySemaphore.migrate(config.database_url)
    prefix = os_env["DURABILITY_QUEUE_PREFIX"]
    processes.start_worker("worker_config", "--durability-holder", "-Q", f"{prefix}.holder.control",
                           "--pool=threads", "-c", "1", env=os_env, name="holder", cwd=tmp_path)
    processes.start_worker("worker_config", "-Q", f"{prefix}.tasks", "--pool=threads", "-c", "4",
                           env=os_env, name="client", cwd=tmp_path)
    processes.start_beat("worker_config", env=os_env, cwd=tmp_path)
    code = ("from durability_celery.cli.demo_tasks import work\n"
            f"for i in range(6): work.apply_async(('acct', None, 0.5), queue='{prefix}.tasks')\n")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, **os_env}, cwd=tmp_path,
                   check=True, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tally = ledger.tally(ledger.read(tmp_path / "ledger.jsonl"))
        if tally.finished.get("acct", 0) == 6:
            break
        time.sleep(0.3)
    assert tally.finished.get("acct", 0) == 6
    assert tally.peak["acct"] <= 2


@pytest.mark.integration
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_roles_on_a_server_broker_and_postgresql(
    broker: str, processes: Any, tmp_path: Path, postgres_url: str,
    redis_url_factory: Any,
) -> None:
    from support import require_service, reset_postgres

    reset_postgres(postgres_url)
    if broker == "redis":
        url = redis_url_factory(REDIS_DB)
    else:
        url = "amqp://guest:guest@127.0.0.1:5672//"
        require_service("RabbitMQ at 127.0.0.1:5672", lambda: _amqp_ping(url))
    _run_roles(processes, {"DURABILITY_BROKER_URL": url,
                           "DURABILITY_DATABASE_URL": postgres_url}, tmp_path)


def _amqp_ping(url: str) -> None:
    from kombu import Connection

    with Connection(url, connect_timeout=5) as conn:
        conn.ensure_connection(max_retries=1)
