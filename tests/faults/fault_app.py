# The Celery app the fault-injection tests run in real worker subprocesses.
# Like tests/worker/gate_app.py (whose lease settings it reuses), its whole
# configuration is one JSON environment variable; on top of it:
# - limits are read live from the ledger Redis (`limit:<key>`, `group_limit:<group>`,
#   `group_raise:<group>` makes group_limit raise), so a test changes them mid-run;
# - a round can be made slow (`round_delay` seconds, `round_in_progress` is set while
#   the limit callback waits) so a test can SIGKILL a holder in the middle of a round;
# - the task records every start and end in the ledger (the same hashes gate_app
#   uses, plus an `events` list with the concurrency seen at each start), and the
#   ledger, not the library, is what the tests check;
# - DC_FAULT_WIRE ("drop=0.2,dup=0.1,delay=0.1") wraps the gate's publish and reply
#   handler in client workers: messages to the holder and replies from it are
#   dropped, duplicated or delayed (so reordered). Test code only, never the library.
from __future__ import annotations

import json
import os
import random
import time
from typing import Any

import redis
from celery import Celery

from durability_celery.app import Durability
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings
from durability_celery.worker import AdmittedTask
from tests.worker.gate_app import _leases

CONFIG_ENV = "DC_FAULT_TEST_CONFIG"
WIRE_ENV = "DC_FAULT_WIRE"

# KEYS: key, group ("" for none); ARGV: task id, now. Returns the key's concurrency.
_START = """
local n = redis.call('INCR', 'run:' .. KEYS[1])
if n > tonumber(redis.call('GET', 'max:' .. KEYS[1]) or '0') then
  redis.call('SET', 'max:' .. KEYS[1], n)
end
local g = 0
if KEYS[2] ~= '' then
  g = redis.call('INCR', 'run:' .. KEYS[1] .. ':' .. KEYS[2])
  if g > tonumber(redis.call('GET', 'max:' .. KEYS[1] .. ':' .. KEYS[2]) or '0') then
    redis.call('SET', 'max:' .. KEYS[1] .. ':' .. KEYS[2], g)
  end
end
redis.call('HINCRBY', 'starts', ARGV[1], 1)
redis.call('RPUSH', 'events', cjson.encode({ARGV[2], 'start', ARGV[1], KEYS[1], KEYS[2], n, g}))
return n
"""
_END = """
local n = redis.call('DECR', 'run:' .. KEYS[1])
local g = 0
if KEYS[2] ~= '' then g = redis.call('DECR', 'run:' .. KEYS[1] .. ':' .. KEYS[2]) end
redis.call('HINCRBY', 'ends', ARGV[1], 1)
redis.call('RPUSH', 'events', cjson.encode({ARGV[2], 'end', ARGV[1], KEYS[1], KEYS[2], n, g}))
return 1
"""


class LiveLimits:
    """Limit callbacks that read the ledger Redis on every call (the holder calls them)."""

    def __init__(self, ledger: redis.Redis, config: dict[str, Any]) -> None:
        self.ledger = ledger
        self.limits: dict[str, int] = config["limits"]
        self.group_limits: dict[str, int] = config.get("group_limits", {})

    def limit(self, key: str) -> int:
        delay = float(self.ledger.get("round_delay") or 0)
        if delay:
            self.ledger.set("round_in_progress", time.time())
            time.sleep(delay)
        live = self.ledger.get(f"limit:{key}")
        return int(live) if live is not None else self.limits.get(key, 3)

    def group_limit(self, key: str, group: str) -> int | None:
        if self.ledger.exists(f"group_raise:{group}"):
            raise RuntimeError(f"group_limit of {group} is failing on purpose")
        live = self.ledger.get(f"group_limit:{group}")
        return int(live) if live is not None else self.group_limits.get(group)


def make_app(config: dict[str, Any]) -> tuple[Celery, Durability]:
    app = Celery("fault_test")
    app.conf.update(
        broker_url=config["broker_url"],
        broker_transport_options=config.get("broker_transport_options", {}),
        broker_connection_retry_on_startup=True, broker_connection_max_retries=None,
        task_serializer="json", accept_content=["json"], result_backend=None,
        worker_prefetch_multiplier=1, task_ignore_result=True,
        worker_hijack_root_logger=True,
    )
    ledger = redis.Redis.from_url(config["ledger_url"], decode_responses=True)
    live = LiveLimits(ledger, config)
    sem = config["semaphore"]
    semaphore = DurabilitySemaphore(
        sem["name"], database=config["database"],
        limit=live.limit, group_limit=live.group_limit,
        round_wait=sem.get("round_wait", 0.05), round_period=sem.get("round_period", 0.2),
        grant_timeout=sem.get("grant_timeout", 5.0), leases=_leases(sem.get("leases")),
        **({"handoff_window": sem["handoff_window"]} if "handoff_window" in sem else {}),
    )
    settings = DurabilitySettings(**config.get("settings", {}))
    return app, Durability(app, [semaphore], settings=settings)


def _work(ledger: redis.Redis, account: str, seconds: float) -> None:
    """Sleep `seconds`, or less once the test ends the key's work (FaultCluster.end_work):
    a test can keep permits in use for as long as it needs them, however slow the machine."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not ledger.exists(f"end-work:{account}"):
        time.sleep(min(left, 0.1))


def define_tasks(app: Celery, config: dict[str, Any]) -> tuple[Any, Any]:
    """The admitted task (ledger start/end around a sleep) and an unused plain one."""
    ledger = redis.Redis.from_url(config["ledger_url"])
    start_script = ledger.register_script(_START)
    end_script = ledger.register_script(_END)

    @app.task(bind=True, base=AdmittedTask, name="fault.admitted",  # type: ignore[untyped-decorator]
              semaphore=config["semaphore"]["name"], key="account", group="group",
              shared=False)
    def admitted(self: Any, account: str, group: str | None = None,
                 work: float = 0.1) -> None:
        start_script(keys=[account, group or ""], args=[self.request.id, time.time()])
        try:
            _work(ledger, account, work)
        finally:  # a SIGKILLed worker never gets here: the ledger keeps it running
            end_script(keys=[account, group or ""], args=[self.request.id, time.time()])

    @app.task(name="fault.plain", shared=False)  # type: ignore[untyped-decorator]
    def plain() -> None:
        return None

    return admitted, plain


# -- wire faults (client workers only) -----------------------------------------


def parse_wire(spec: str) -> dict[str, float]:
    """"drop=0.2,dup=0.1,delay=0.1" -> probabilities (each 0 when absent)."""
    rates = {"drop": 0.0, "dup": 0.0, "delay": 0.0}
    for part in filter(None, spec.split(",")):
        name, value = part.split("=")
        rates[name.strip()] = float(value)
    return rates


def install_wire_faults(spec: str, ledger_url: str) -> None:
    """Wrap GateStep._publish (to the holder) and GateStep._on_reply (from it).

    Each message: dropped, or sent twice, or delayed by 0.2-1.5 s on the event
    loop's timer (so it arrives after later ones: reordered). Fates are dealt
    from shuffled decks of 20, so the rates are exact per 20 messages and every
    fault happens in every run. Every fault is counted in the ledger
    (`wire_faults`). The client's own backoff applies: capped at its
    request_timeout (docs/faults.md, finding 2).
    """
    from durability_celery.worker.step import GateStep

    rates = parse_wire(spec)
    ledger = redis.Redis.from_url(ledger_url)
    chance = random.Random()
    decks: dict[str, list[str]] = {"request": [], "reply": []}
    real_publish, real_reply = GateStep._publish, GateStep._on_reply

    def fate(direction: str) -> str:
        deck = decks[direction]
        if not deck:
            deck += [name for name in ("drop", "dup", "delay")
                     for _ in range(round(rates[name] * 20))]
            deck += ["ok"] * (20 - len(deck))
            chance.shuffle(deck)
        name = deck.pop()
        ledger.hincrby("wire_faults", f"{direction}:{name}", 1)
        return name

    def publish(self: Any, message: Any) -> None:
        what = fate("request")
        if what == "drop":
            return
        if what == "delay":
            self.c.timer.call_after(chance.uniform(0.2, 1.5), real_publish, (self, message))
            return
        real_publish(self, message)
        if what == "dup":
            real_publish(self, message)

    def on_reply(self: Any, body: Any, message: Any) -> None:
        what = fate("reply")
        if what == "drop":
            return
        if what == "delay":
            self.c.timer.call_after(chance.uniform(0.2, 1.5), real_reply, (self, body, message))
            return
        real_reply(self, body, message)
        if what == "dup":
            real_reply(self, body, message)

    GateStep._publish = publish  # type: ignore[method-assign]
    GateStep._on_reply = on_reply  # type: ignore[method-assign]


if CONFIG_ENV in os.environ:
    config: dict[str, Any] = json.loads(os.environ[CONFIG_ENV])
    app, durability = make_app(config)
    admitted, plain = define_tasks(app, config)
    if os.environ.get(WIRE_ENV):
        install_wire_faults(os.environ[WIRE_ENV], config["ledger_url"])
