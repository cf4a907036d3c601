# The simulated clients of benchmarks/holder_scale.py, in one or more processes.
#
# Each process simulates a share of the CLIENTS clients over every key they
# serve, single-threaded: it pushes requests and takes replies straight on Redis
# (requests as the kombu envelopes a client's Producer writes, the holder reads
# them through kombu; replies taken by one script over all its reply queues), so
# it costs the 2 cores as little as it can. The parent starts them, lets them warm
# up, starts their windows together and merges what they saw.
from __future__ import annotations

import base64
import heapq
import importlib
import json
import multiprocessing
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import redis

from durability_celery.queues import holder_queue_declaration, reply_queue_declaration
from durability_celery.wire.request import DemandEntry, GrantReport, Request
from durability_celery.wire.routing import reply_queue

CLIENTS = 100
CLIENTS_PER_KEY = 2
DEMAND = 2
BURST = 500
"""Initial requests published between two reply drains, so early replies are timed fairly."""
DRAIN_MAX = 0.05
"""Longest uninterrupted drain of replies (s). Unbounded, a holder answering without a
2 ms pause kept the simulator draining to the end of the window, sending nothing due."""
TAKE = 1000
"""Most replies taken from one reply queue per look."""

_TAKE_ALL = """
local taken = {}
for _, key in ipairs(KEYS) do
  local entries = redis.call('RPOP', key, ARGV[1])
  if entries then
    for _, entry in ipairs(entries) do taken[#taken + 1] = entry end
  end
end
return taken
"""
"""Every waiting reply of the process's queues in one command: a pipeline of one RPOP
per queue cost the server and the simulator more, looked at this often."""


@dataclass
class Tally:
    """What one window saw, from the replies."""

    sent: int = 0
    latencies: list[float] = field(default_factory=list)
    rounds: set[tuple[str, float]] = field(default_factory=set)
    messages_per_round: Counter[tuple[str, float]] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    granted: int = 0
    unanswered: list[float] = field(default_factory=list)
    """Ages (s) of the requests still unanswered at the end."""
    cpu_s: float = 0.0
    """CPU of the simulator process(es) over the window."""

    def merge(self, other: Tally) -> None:
        self.sent += other.sent
        self.latencies += other.latencies
        self.rounds |= other.rounds
        self.messages_per_round.update(other.messages_per_round)
        self.errors.update(other.errors)
        self.granted += other.granted
        self.unanswered += other.unanswered
        self.cpu_s += other.cpu_s


def _envelope(body: dict[str, Any], queue: str, reply_to: str, correlation_id: str) -> str:
    """What kombu's Producer.publish(body, exchange="", routing_key=queue, reply_to=...,
    correlation_id=..., serializer="json") pushes on Redis."""
    return json.dumps({
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8", "content-type": "application/json", "headers": {},
        "properties": {
            "reply_to": reply_to, "correlation_id": correlation_id, "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
            "body_encoding": "base64", "delivery_tag": str(uuid.uuid4()),
        },
    })


class Simulator:
    """`clients` of the CLIENTS clients, each with its own reply queue, over the keys of
    one semaphore they serve; replies are matched to (client, key) by correlation id."""

    def __init__(self, durability: Any, semaphore: str, keys: int, clients: list[int],
                 token: str, unstretched: float | None = None) -> None:
        self.durability = durability
        self.semaphore = semaphore
        self.unstretched = unstretched
        """A round_period: ask again by round_at + it, whatever period a reply told (a
        holder behind stretches it): the holder stays saturated."""
        prefix = durability.settings.queue_prefix
        self.client_ids = {i: f"celery@scale-{i}/{token}" for i in clients}
        self.reply_queues = {i: reply_queue(prefix, f"scale-{i}.{token}") for i in clients}
        mine = set(clients)
        # key k is served by clients 2k and 2k+1 (mod CLIENTS): 200 keys per client
        self.pairs = [(f"scale-{k}", client) for k in range(keys) for j in range(CLIENTS_PER_KEY)
                      if (client := (k * CLIENTS_PER_KEY + j) % CLIENTS) in mine]
        self.held: dict[tuple[str, int], dict[str, int]] = {}  # (key, client) -> grant -> permits
        self.pending: dict[str, tuple[str, int, float]] = {}  # correlation -> key, client, sent
        self.due: list[tuple[float, str, int]] = []  # heap of (epoch send time, key, client)
        self.enqueued_at = time.time()
        self.tally = Tally()
        self._redis = redis.Redis.from_url(durability.app.conf.broker_url)
        self._take = self._redis.register_script(_TAKE_ALL)
        self._queue_keys = list(self.reply_queues.values())
        self._pipe = self._redis.pipeline(transaction=False)
        with durability.app.connection_for_write() as connection:
            channel = connection.default_channel
            for name in durability.holder_queues():
                holder_queue_declaration(name)(channel).declare()  # type: ignore[no-untyped-call]
            for name in self._queue_keys:
                reply_queue_declaration(name, expires=durability.settings.reply_expires)(
                    channel).declare()  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._redis.close()

    def send(self, key: str, client: int) -> None:
        """Queue a request (pushed by `flush`)."""
        held = self.held.get((key, client), {})
        request = Request(
            type="request", client_id=self.client_ids[client],
            demand=(DemandEntry(None, DEMAND, self.enqueued_at),),
            grants=tuple(GrantReport(gid, permits, permits) for gid, permits in held.items()),
        )
        correlation_id = uuid.uuid4().hex
        queue = self.durability.queue_for(self.semaphore, key)
        self._pipe.lpush(queue, _envelope(request.to_wire(semaphore=self.semaphore, key=key),
                                          queue, self.reply_queues[client], correlation_id))
        self.pending[correlation_id] = (key, client, time.monotonic())
        self.tally.sent += 1

    def flush(self) -> None:
        if len(self._pipe):
            self._pipe.execute()

    def receive(self, timeout: float) -> int:
        """Take every reply waiting, or wait up to `timeout` for one; returns how many."""
        taken = self._take(keys=self._queue_keys, args=[TAKE])
        if not taken and timeout > 0:
            found = self._redis.brpop(self._queue_keys, timeout=max(timeout, 0.001))
            taken = [found[1]] if found else []
        for raw in taken:
            self._on_reply(json.loads(raw))
        return len(taken)

    def _on_reply(self, message: dict[str, Any]) -> None:
        received = time.monotonic()
        properties = message.get("properties") or {}
        found = self.pending.pop(str(properties.get("correlation_id")), None)
        if found is None:
            return  # the warm-up's, or an earlier window's
        raw = message["body"]
        if properties.get("body_encoding") == "base64":
            raw = base64.b64decode(raw)
        body = json.loads(raw)
        key, client, sent = found
        self.tally.latencies.append(received - sent)
        if "error" in body:
            self.tally.errors[str(body["error"].get("code"))] += 1
            heapq.heappush(self.due, (time.time() + 1.0, key, client))
            return
        at = (key, float(body["round_at"]))
        self.tally.rounds.add(at)
        self.tally.messages_per_round[at] += 1
        held = self.held.setdefault((key, client), {})
        for grant in body["grants"]:
            if grant["status"] == "active" and grant["claimed"] < grant["permits"]:
                if grant["grant_id"] not in held:
                    self.tally.granted += grant["permits"]
                held[grant["grant_id"]] = grant["permits"]  # "run" now, reported next time
            else:
                held.pop(grant["grant_id"], None)
        next_at = float(body["next_request_at"])
        if self.unstretched is not None:
            next_at = min(next_at, at[1] + self.unstretched)
        heapq.heappush(self.due, (next_at, key, client))

    def drain(self, until: float) -> None:
        """Take replies until none is waiting, `until` (monotonic) passes, or DRAIN_MAX
        did: replies that never pause must not stop the requests due meanwhile."""
        until = min(until, time.monotonic() + DRAIN_MAX)
        while time.monotonic() < until and self.receive(0.0):
            pass

    def warm_up(self, keys: list[str], timeout: float) -> None:
        """A request per key in `keys` (one per holder), answered once the holders
        consume: the window starts after them."""
        client = next(iter(self.client_ids))
        for key in keys:
            self.send(key, client)
        self.flush()
        deadline = time.monotonic() + timeout
        while self.pending:
            if time.monotonic() > deadline:
                raise RuntimeError("a holder did not answer the warm-up request")
            self.receive(0.5)
        self.due.clear()
        self.held.clear()
        self.tally = Tally()

    def run(self, seconds: float, *, settle: float = 0.0, stagger: float = 0.0) -> float:
        """Every (key, client) sends, then re-sends on schedule, for `settle` and then
        `seconds` more, whose replies alone are tallied; returns the tallied window. The
        first requests go at once, or evenly over `stagger` seconds."""
        started = time.monotonic()
        end = started + settle + seconds
        if stagger > 0:
            first = time.time()
            for n, (key, client) in enumerate(self.pairs):
                heapq.heappush(self.due, (first + stagger * n / len(self.pairs), key, client))
        else:
            for n in range(0, len(self.pairs), BURST):
                for key, client in self.pairs[n:n + BURST]:
                    self.send(key, client)
                self.flush()
                self.drain(end)
        if settle > 0:
            self._loop(started + settle)
            self.tally = Tally()
            started = time.monotonic()
        self._loop(end)
        return time.monotonic() - started

    def _loop(self, end: float) -> None:
        while time.monotonic() < end:
            now = time.time()
            while self.due and self.due[0][0] <= now:
                _, key, client = heapq.heappop(self.due)
                self.send(key, client)
            self.flush()
            wait = 0.05 if not self.due else min(0.05, max(0.0, self.due[0][0] - now))
            self.receive(wait)
            self.drain(end)

    def unanswered_ages(self) -> list[float]:
        now = time.monotonic()
        return [now - sent for _, _, sent in self.pending.values()]


def _child(config: dict[str, Any], semaphore: str, keys: int, clients: list[int], token: str,
           warm_keys: list[str], timing: tuple[float, float, float], saturate: bool,
           pipe: Connection) -> None:
    """One simulator process: warm up, say so, run its window when told, send its Tally."""
    # tests/holder is not a package: the parent put it on sys.path, which spawn passes on
    holder_app = importlib.import_module("holder_app")
    _app, durability = holder_app.make_app(config)
    period = float(next(s["round_period"] for s in config["semaphores"]
                        if s["name"] == semaphore))
    sim = Simulator(durability, semaphore, keys, clients, token,
                    unstretched=period if saturate else None)
    try:
        sim.warm_up(warm_keys, timeout=60.0)
        pipe.send("ready")
        pipe.recv()
        seconds, settle, stagger = timing
        own = time.process_time()
        elapsed = sim.run(seconds, settle=settle, stagger=stagger)
        tally = sim.tally
        tally.unanswered = sim.unanswered_ages()
        tally.cpu_s = time.process_time() - own
        pipe.send((elapsed, tally))
    finally:
        sim.close()


class Simulators:
    """`processes` simulator processes sharing the CLIENTS clients (client i in process
    i % processes), over `keys` keys of `semaphore`; `timing`: the window, the seconds
    before it, and the spread of the first requests (Simulator.run); `saturate`: clients
    ignore stretched periods (Simulator.unstretched)."""

    def __init__(self, config: dict[str, Any], semaphore: str, keys: int, processes: int,
                 warm_keys: list[str], timing: tuple[float, float, float],
                 saturate: bool = False) -> None:
        context = multiprocessing.get_context("spawn")  # no kombu or Redis state inherited
        token = os.urandom(3).hex()
        self._pipes: list[Connection] = []
        self._procs: list[Any] = []
        for n in range(processes):
            mine, theirs = context.Pipe()
            clients = list(range(n, CLIENTS, processes))
            proc = context.Process(target=_child, name=f"holder-sim-{n}", daemon=True, args=(
                config, semaphore, keys, clients, token, warm_keys, timing, saturate, theirs))
            proc.start()
            self._pipes.append(mine)
            self._procs.append(proc)

    def ready(self, timeout: float) -> None:
        for pipe in self._pipes:
            if not pipe.poll(timeout) or pipe.recv() != "ready":
                raise RuntimeError("a simulator process did not warm up")

    def start(self) -> None:
        """Start every simulator's run now."""
        for pipe in self._pipes:
            pipe.send("go")

    def results(self, timeout: float) -> tuple[float, Tally]:
        """The longest window and the merged tallies, once every simulator reported."""
        merged, elapsed = Tally(), 0.0
        for pipe in self._pipes:
            if not pipe.poll(timeout):
                raise RuntimeError("a simulator process did not report")
            seconds, tally = pipe.recv()
            elapsed = max(elapsed, seconds)
            merged.merge(tally)
        return elapsed, merged

    def close(self) -> None:
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
