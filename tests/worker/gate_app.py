# The Celery app the gate tests run in real worker subprocesses (client workers
# and the holder). Its whole configuration comes from one JSON environment
# variable, so the test process and every worker build the same Durability.
# Tasks record their start and end in an independent Redis ledger (its own DB):
# the ledger, not the library, proves the limits held.
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.worker.control import control_command

from durability_celery.app import Durability
from durability_celery.core.config import Leases, Over, Strict, Under
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings
from durability_celery.worker import AdmittedTask

CONFIG_ENV = "DC_GATE_TEST_CONFIG"


@control_command()  # type: ignore[untyped-decorator]
def gate_test_collect_publisher(state: Any) -> dict[str, Any]:
    """Tests only: collect the gate step's publishing connection under it, as kombu's
    publish retry does to a connection whose broker went away (test_reopen.py)."""
    step = getattr(state.consumer, "durability_step", None)
    if step is None or step._connection is None:
        return {"collected": False}  # the holder has no gate
    step._connection.collect()
    return {"collected": True}

# KEYS: key, group ("" for none); ARGV: task id, now. Counts this start, tracks the
# highest concurrency ever seen per key and per (key, group).
_START = """
local n = redis.call('INCR', 'run:' .. KEYS[1])
if n > tonumber(redis.call('GET', 'max:' .. KEYS[1]) or '0') then
  redis.call('SET', 'max:' .. KEYS[1], n)
end
if KEYS[2] ~= '' then
  local g = redis.call('INCR', 'run:' .. KEYS[1] .. ':' .. KEYS[2])
  if g > tonumber(redis.call('GET', 'max:' .. KEYS[1] .. ':' .. KEYS[2]) or '0') then
    redis.call('SET', 'max:' .. KEYS[1] .. ':' .. KEYS[2], g)
  end
end
redis.call('HINCRBY', 'starts', ARGV[1], 1)
redis.call('HSET', 'started_at', ARGV[1], ARGV[2])
return n
"""
_END = """
redis.call('DECR', 'run:' .. KEYS[1])
if KEYS[2] ~= '' then redis.call('DECR', 'run:' .. KEYS[1] .. ':' .. KEYS[2]) end
redis.call('HINCRBY', 'ends', ARGV[1], 1)
return 1
"""


def _leases(spec: dict[str, Any] | None) -> Leases | None:
    if spec is None:
        return None
    mode = spec["mode"]
    provisioning = (Strict() if mode == "strict" else Under(reserve=spec["reserve"])
                    if mode == "under" else Over(extra=spec["extra"]))
    return Leases(provisioning=provisioning, permits_per_lease=spec.get("per_lease", 4),
                  ttl=spec.get("ttl", 60.0))


def make_app(config: dict[str, Any]) -> tuple[Celery, Durability]:
    app = Celery("gate_test")
    app.conf.update(
        task_default_queue=config.get("task_queue", "celery"),
        broker_url=config["broker_url"],
        broker_transport_options=config.get("broker_transport_options", {}),
        broker_connection_retry_on_startup=True,
        task_serializer="json", accept_content=["json"], result_backend=None,
        worker_prefetch_multiplier=1, task_ignore_result=True,
        worker_hijack_root_logger=True,
    )
    limits: dict[str, int] = config["limits"]
    group_limits: dict[str, int] = config.get("group_limits", {})
    sem = config["semaphore"]
    semaphore = DurabilitySemaphore(
        sem["name"], database=config["database"],
        limit=lambda key: limits.get(key, config.get("default_limit", 3)),
        group_limit=lambda key, group: group_limits.get(group),
        round_wait=sem.get("round_wait", 0.05), round_period=sem.get("round_period", 0.2),
        grant_timeout=sem.get("grant_timeout", 5.0), leases=_leases(sem.get("leases")),
        **({"handoff_window": sem["handoff_window"]} if "handoff_window" in sem else {}),
    )
    settings = DurabilitySettings(**config.get("settings", {}))
    return app, Durability(app, [semaphore], settings=settings)


def _in_delivery() -> bool:
    """Whether the calling task runs inside the worker's callback for a delivered
    message (Celery's `on_task_received`), as a solo pool runs a task it gets."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "on_task_received":
            return True
        frame = frame.f_back
    return False


def define_tasks(app: Celery, config: dict[str, Any]) -> tuple[Any, Any]:
    """The admitted task and a plain one, named the same in every process."""
    ledger = redis.Redis.from_url(config["ledger_url"])
    start_script = ledger.register_script(_START)
    end_script = ledger.register_script(_END)

    def run(task_id: str, account: str, group: str | None, work: float, mode: str) -> str:
        start_script(keys=[account, group or ""], args=[task_id, time.time()])
        if mode == "where":
            ledger.hset("in_delivery", task_id, int(_in_delivery()))
        try:
            if mode == "raise":
                raise ValueError("task failed on purpose")
            if mode == "exit":  # the pool child dies mid-task: WorkerLostError
                os._exit(1)
            if mode in ("soft", "hard"):
                try:
                    time.sleep(30)
                except SoftTimeLimitExceeded:
                    return "soft"
            time.sleep(work)
            return "ok"
        finally:
            # A hard time limit or a killed process never gets here: the ledger then
            # keeps counting it as running, exactly as the holder does.
            end_script(keys=[account, group or ""], args=[task_id])

    @app.task(bind=True, base=AdmittedTask, name="gate.admitted",
              semaphore=config["semaphore"]["name"], key="account", group="group",
              max_retries=3, shared=False)
    def admitted(self: Any, account: str, group: str | None = None, work: float = 0.1,
                 mode: str = "ok") -> str:
        result = run(self.request.id, account, group, work, mode)
        if mode == "retry" and self.request.retries == 0:
            raise self.retry(countdown=0)
        return result

    @app.task(bind=True, name="gate.plain", shared=False)
    def plain(self: Any, published_at: float, work: float = 0.0) -> None:
        """Not admitted: records how long it waited from publish to start, then takes its
        pool slot for `work` seconds."""
        now = time.time()
        ledger.hset("plain_delay", self.request.id, now - published_at)
        ledger.hset("plain_started_at", self.request.id, now)
        time.sleep(work)

    return admitted, plain


if CONFIG_ENV in os.environ:
    config: dict[str, Any] = json.loads(os.environ[CONFIG_ENV])
    app, durability = make_app(config)
    admitted, plain = define_tasks(app, config)
