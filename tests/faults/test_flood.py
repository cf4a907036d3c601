# A flood of malformed and hostile messages on the holder queue while real
# workers run admitted tasks: garbage bytes, pickle, wrong JSON types, huge and
# negative counts, unknown versions and types, too many entries, NaN times, and
# reports of ANOTHER client's real grant and lease ids (which, if accepted, would
# free capacity that is in use). Each must get an error answer (or, without a
# reply_to, be dropped with a log line); the holder keeps serving; the attacked
# key's grants and leases do not change; real work keeps every invariant.
# Out of scope, by design: a WELL-FORMED request under a forged client id; the
# client id is not an authentication (restrict who may publish, or `can_grant`).
from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kombu.messaging import Consumer, Producer

from durability_celery.holder import holder_queue_declaration
from durability_celery.queues import reply_queue_declaration
from durability_celery.wire.request import MAX_BODY_BYTES
from tests.faults.harness import FaultCluster, check_invariants, report

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LIMITS = {"busy": 3, "frozen": 4}
ROUNDS = 8  # times the whole catalogue of bad messages is sent
# The frozen key's tasks run until the flood is over (FaultCluster.end_work), so its
# grants and leases stay the victim's however long a loaded machine takes.
FROZEN_WORK = 100.0


class Attacker:
    """Publishes raw bodies to a holder queue and collects replies by correlation id."""

    def __init__(self, cluster: FaultCluster) -> None:
        self.cluster = cluster
        self.connection = cluster.app.connection_for_write()
        prefix = cluster.durability.settings.queue_prefix
        self.reply_to = f"{prefix}.reply.attacker-{uuid.uuid4().hex[:6]}"
        self.replies: dict[str, Any] = {}
        self.consumer = Consumer(self.connection.channel(),  # type: ignore[no-untyped-call]
                                 [reply_queue_declaration(self.reply_to, expires=60)],
                                 no_ack=True, accept=["json"], on_message=self._on_message)
        self.consumer.consume()  # type: ignore[no-untyped-call]
        self.producer = Producer(self.connection.channel())  # type: ignore[no-untyped-call]

    def _on_message(self, message: Any) -> None:
        self.replies[message.properties["correlation_id"]] = message.decode()

    def send(self, key: str, body: Any, *, reply: bool = True, **options: Any) -> str:
        queue = self.cluster.durability.queue_for(self.cluster.semaphore.name, key)
        holder_queue_declaration(queue)(self.producer.channel).declare()  # type: ignore[no-untyped-call]
        correlation_id = uuid.uuid4().hex
        extra = {"reply_to": self.reply_to} if reply else {}
        options.setdefault("serializer", "json")
        self.producer.publish(body, exchange="", routing_key=queue,  # type: ignore[no-untyped-call]
                              correlation_id=correlation_id, **extra, **options)
        return correlation_id

    def drain(self, wanted: set[str], timeout: float) -> set[str]:
        deadline = time.monotonic() + timeout
        while wanted - set(self.replies) and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                self.connection.drain_events(timeout=0.2)
        return wanted - set(self.replies)

    def close(self) -> None:
        self.connection.release()


def catalogue(cluster: FaultCluster, key: str, victim: dict[str, Any]
              ) -> dict[str, tuple[Any, dict[str, Any]]]:
    """name -> (body, publish options) of every bad message sent about `key`."""
    good = {"type": "request", "v": 1, "semaphore": cluster.semaphore.name, "key": key,
            "client_id": "attacker", "demand": [], "grants": [], "leases": []}
    raw = {"content_type": "application/json", "content_encoding": "utf-8",
           "serializer": None}
    demand = {"group": None, "count": 1, "oldest_at": time.time()}
    return {
        "garbage": (b"{not json", raw),
        "pickle": ({"a": 1}, {"serializer": "pickle"}),
        "list": ([1, 2, 3], {}),
        "huge_body": ({"pad": "x" * (MAX_BODY_BYTES + 10)}, {}),
        "unknown_semaphore": ({**good, "semaphore": "nope"}, {}),
        "key_not_str": ({**good, "key": 5}, {}),
        "version_2": ({**good, "v": 2}, {}),
        "version_str": ({**good, "v": "1"}, {}),
        "no_version": ({k: v for k, v in good.items() if k != "v"}, {}),
        "unknown_type": ({**good, "type": "release"}, {}),
        "client_not_str": ({**good, "client_id": 7}, {}),
        "demand_not_list": ({**good, "demand": {"count": 1}}, {}),
        "count_str": ({**good, "demand": [{**demand, "count": "12"}]}, {}),
        "count_huge": ({**good, "demand": [{**demand, "count": 10**12}]}, {}),
        "count_negative": ({**good, "demand": [{**demand, "count": -5}]}, {}),
        "time_nan": ({**good, "demand": [{**demand, "oldest_at": float("nan")}]}, {}),
        "ages_not_list": ({**good, "demand": [{**demand, "queued_at": "soon"}]}, {}),
        "ages_over_count": ({**good, "demand": [
            {**demand, "queued_at": [demand["oldest_at"]] * 2}]}, {}),
        "ages_out_of_order": ({**good, "demand": [
            {**demand, "count": 3, "queued_at": [demand["oldest_at"] + d for d in (0, 2, 1)]}]},
            {}),
        "too_many": ({**good, "demand": [{**demand, "group": f"g{i}"}
                                         for i in range(10_001)]}, {}),
        "released_over_claimed": ({**good, "grants": [
            {"grant_id": "x", "claimed": 1, "released": 2}]}, {}),
        "leases_flag_str": ({**good, "supports_leases": "yes"}, {}),
        # Another client's real ids, reported as all released: would free capacity.
        "foreign_grants": ({**good, "grants": [
            {"grant_id": g["grant_id"], "claimed": g["permits"], "released": g["permits"]}
            for g in victim["grants"]]}, {}),
        "foreign_leases": ({**good, "leases": [
            {"lease_id": lease["lease_id"], "drawn": lease["permits"],
             "released": lease["permits"], "stopped": True}
            for lease in victim["leases"]]}, {}),
    }


def snapshot(cluster: FaultCluster, key: str) -> dict[str, Any]:
    """The key's grants and leases, without the times a client's heartbeat moves."""
    state = cluster.semaphore.state(key)
    return {
        "grants": sorted((g.grant_id, g.client_id, g.group, g.permits, g.claimed,
                          g.released, g.status) for g in state.grants),
        "leases": sorted((lease.lease_id, lease.client_id, lease.group, lease.permits,
                          lease.drawn, lease.released, lease.status, lease.confirmed)
                         for lease in state.leases),
    }


def test_flood_of_bad_messages_while_real_work_runs(
        fault_cluster: Callable[..., FaultCluster]) -> None:
    cluster = fault_cluster(limits=LIMITS, leases={"mode": "strict", "per_lease": 2})
    holder, *_ = cluster.start(clients=2, pool="threads", concurrency=3)
    frozen_ids = cluster.publish(3, key="frozen", work=FROZEN_WORK)

    def frozen_claimed() -> bool:
        # Settled: all three reported running, and no grant or lease left unused (its
        # owner hands it back during the flood, or the holder reclaims it at its
        # deadline: both legitimate changes).
        state = cluster.semaphore.state("frozen")
        return (sum(g.claimed for g in state.grants) + sum(x.drawn for x in state.leases) == 3
                and all(g.claimed == g.permits for g in state.grants)
                and all(x.drawn > 0 for x in state.leases))

    cluster.wait_for("the frozen key's tasks to be reported running", frozen_claimed,
                     timeout=20, context=lambda: str(cluster.semaphore.state("frozen")))
    before = snapshot(cluster, "frozen")
    victim = {"grants": [{"grant_id": g[0], "permits": g[3]} for g in before["grants"]],
              "leases": [{"lease_id": x[0], "permits": x[3]} for x in before["leases"]]}
    assert victim["grants"] or victim["leases"]
    busy_ids = cluster.publish(30, key="busy", work=0.2)

    attacker = Attacker(cluster)
    expected: dict[str, str] = {}
    silent = 0
    began = time.monotonic()
    try:
        for _ in range(ROUNDS):
            for key in ("frozen", "busy"):
                for name, (body, options) in catalogue(cluster, key, victim).items():
                    if name.startswith("foreign") and key != "frozen":
                        continue  # another key's ids are merely unknown there (not_found)
                    expected[attacker.send(key, body, **options)] = name
                attacker.send(key, b"\x00\xff garbage", reply=False,
                              content_type="application/json", content_encoding="binary")
                silent += 1
                # Valid JSON that fails validation inside the round, with no reply_to.
                attacker.send(key, catalogue(cluster, key, victim)["version_2"][0], reply=False)
        missing = attacker.drain(set(expected), timeout=30)
        flood_seconds = time.monotonic() - began
        assert not missing, sorted({expected[c] for c in missing})
        codes: dict[str, set[str]] = {}
        for cid, name in expected.items():
            reply = attacker.replies[cid]
            assert isinstance(reply, dict) and "error" in reply, (name, reply)
            codes.setdefault(name, set()).add(reply["error"]["code"])
        assert codes.pop("unknown_semaphore") == {"unknown_semaphore"}
        assert set().union(*codes.values()) == {"invalid_message"}, codes
    finally:
        attacker.close()
    assert snapshot(cluster, "frozen") == before, "the attacked key's state changed"
    cluster.end_work("frozen")
    assert holder.popen.poll() is None

    def logged() -> dict[str, int]:
        text = holder.log()
        return {"rejected": text.count("rejected a message"),
                "round_rejections": text.count("unsupported version"),
                "without_reply_to": text.count("reply_to=-")}

    # Every message is logged: garbage refused by the consumer, and a message refused
    # by the round's validation, also when it has no reply_to to be answered on.
    # Those without reply_to get no reply for drain() to wait on, so their lines may
    # still be on the way when every reply is in (a CI run read 15 of 16): wait.
    def all_logged() -> bool:
        counts = logged()  # one read of the log per check
        return (counts["rejected"] >= silent and counts["round_rejections"] >= 2 * ROUNDS
                and counts["without_reply_to"] >= 2 * ROUNDS)

    cluster.wait_for("the holder to log every refused message", all_logged, timeout=15,
                     context=lambda: f"{logged()}, {silent} garbage, {ROUNDS} rounds")
    round_rejections_logged = logged()["round_rejections"]
    outcome = check_invariants(cluster, frozen_ids + busy_ids, limits=LIMITS, timeout=60)
    report("flood", bad_messages=len(expected) + 2 * silent, error_replies=len(expected),
           round_rejections_logged=round_rejections_logged,
           flood_seconds=round(flood_seconds, 1), tasks=outcome.ran,
           max_running=outcome.max_running, usage_zero_after=outcome.usage_zero_after)
