# Property test of SemaphoreClient alone: hypothesis drives random sequences of
# enqueue / cancel / admit / release / stop, a small fake holder that answers
# with random grants, leases, expiries, retirements, contention and free permits, and a wire
# that loses, repeats and reorders replies. Whatever happens, the client never
# admits an item twice, never uses more permits of a grant or lease than the
# holder issued, never claims inside the claim margin, never draws from a lease
# the holder already holds a final count for or dropped (unacknowledged), nor
# from an unacknowledged one inside the margin, never reports more released than
# claimed or drawn, and its held()/running() match. The handoff variant also ends
# chains whose turn ran out while a reply lists other workers' older items.
# due() passes by the keys it found quiet: after every step, a copy that looks at
# every key must find the same keys due and leave the same reports.
from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from durability_celery.client import SemaphoreClient
from durability_celery.client.permits import HANDOFF_TURN
from durability_celery.wire.request import parse_request

from .helpers import SEM, FakeClock

KEYS = ("k1", "k2")
GROUPS = (None, "g")
MARGIN = 1.0
GRANT_TIMEOUT = 6.0
URGENCY = ("calm", "roomy", "contended", "blocked", "waiting")
TTL = 100.0
"""Longer than a shutdown may take, so stop() (not expiry) must return the leases."""


@dataclass
class HGrant:
    group: str | None
    permits: int
    issued: int
    deadline: float
    claimed: int = 0
    released: int = 0
    status: str = "active"


@dataclass
class HLease:
    group: str | None
    permits: int
    last_report_at: float
    drawn: int = 0
    released: int = 0
    status: str = "active"
    confirmed: bool = False
    acknowledged: bool = False
    """Reported by the client since issue; until then dropped at issue + GRANT_TIMEOUT."""

    @property
    def drop_at(self) -> float | None:
        return None if self.acknowledged else self.issued_at + GRANT_TIMEOUT

    issued_at: float = 0.0


@dataclass
class FakeHolder:
    """Just enough of a holder: clamped high-water marks, reclaim, retire, settle."""

    grants: dict[str, HGrant] = field(default_factory=dict)
    leases: dict[str, HLease] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    """id -> key"""
    ids: itertools.count[int] = field(default_factory=itertools.count)

    def apply(self, message: dict[str, Any], now: float) -> None:
        for report in message["grants"]:
            g = self.grants.get(report["grant_id"])
            if g is not None:
                assert report["released"] <= report["claimed"] <= g.issued, (
                    "reported more released than claimed, or claimed than issued")
                g.claimed = max(g.claimed, min(report["claimed"], g.permits))
                g.released = max(g.released, min(report["released"], g.claimed))
        for report in message["leases"]:
            le = self.leases.get(report["lease_id"])
            if le is not None:
                assert report["released"] <= report["drawn"] <= le.permits, (
                    "reported more released than drawn, or drawn than issued")
                ceiling = le.drawn if le.confirmed else le.permits
                le.drawn = max(le.drawn, min(report["drawn"], ceiling))
                le.released = max(le.released, min(report["released"], le.drawn))
                le.confirmed = le.confirmed or report["stopped"]
                if report["stopped"]:
                    le.status = "retired"
                le.last_report_at = now
                le.acknowledged = True

    def issue(self, key: str, group: str | None, grant: int, lease: int, now: float) -> None:
        if grant:
            gid = f"g{next(self.ids)}"
            self.grants[gid] = HGrant(group, grant, grant, now + GRANT_TIMEOUT)
            self.keys[gid] = key
        if lease:
            lid = f"l{next(self.ids)}"
            self.leases[lid] = HLease(group, lease, now, issued_at=now)
            self.keys[lid] = key

    def tick(self, now: float) -> None:
        for gid, g in list(self.grants.items()):
            if g.status == "active" and g.claimed < g.permits and g.deadline <= now:
                g.permits, g.status = g.claimed, "expired"
            if g.claimed == g.released == g.permits:
                del self.grants[gid]
        for lid, le in list(self.leases.items()):
            if le.status == "active" and now - le.last_report_at >= TTL:
                le.status = "retired"
            if le.status == "retired" and le.confirmed and le.drawn == le.released:
                del self.leases[lid]
            elif le.drop_at is not None and le.drop_at <= now:
                del self.leases[lid]  # never acknowledged: dropped like an unclaimed grant

    def answer(self, key: str, message: dict[str, Any], now: float, *,
               urgency: str) -> dict[str, Any]:
        """`urgency`: "calm", "roomy" (calm, and permits said free: idle permits are kept
        longer), "contended" (unmet demand: the client returns idle leases), "blocked" (a
        group of the key refused: waited on, leases kept) or "waiting" (contended, and
        others' older items listed: chains give permits back for them)."""
        grants = [
            {"grant_id": gid, "group": g.group, "permits": g.permits, "claimed": g.claimed,
             "released": g.released, "claim_deadline": g.deadline, "status": g.status}
            for gid, g in self.grants.items() if self.keys[gid] == key]
        leases = [
            {"lease_id": lid, "group": le.group, "permits": le.permits, "drawn": le.drawn,
             "released": le.released, "status": le.status, "acknowledged": le.acknowledged,
             "expires_at": min(le.last_report_at + TTL, le.drop_at or math.inf)}
            for lid, le in self.leases.items() if self.keys[lid] == key]
        live = {g["grant_id"] for g in grants} | {le["lease_id"] for le in leases}
        grants += [{"grant_id": r["grant_id"], "group": None, "permits": 0, "claimed": 0,
                    "released": 0, "claim_deadline": None, "status": "not_found"}
                   for r in message["grants"] if r["grant_id"] not in live]
        leases += [{"lease_id": r["lease_id"], "group": None, "permits": 0, "drawn": 0,
                    "released": 0, "expires_at": None, "status": "settled"}
                   for r in message["leases"] if r["lease_id"] not in live]
        body = {"v": 1, "semaphore": SEM, "key": key, "round_at": now,
                "next_request_at": now + 2.0,
                "contended": urgency in ("contended", "waiting"),
                "grants": grants, "leases": leases,
                "blocked": ([{"group": "g", "reason": "limit", "queued": 1}]
                            if urgency == "blocked" else [])}
        if urgency == "roomy":
            # Room for no group, none in "g": both lingers in one reply.
            body["free"] = [{"group": None, "permits": 2}, {"group": "g", "permits": 0}]
        if urgency == "waiting":
            body["waiting"] = [
                {"group": None, "reason": "limit", "queued_at": [now - 400.0, now - 20.0]},
                {"group": "g", "reason": "group_limit", "queued_at": [now - 300.0]}]
        return body


class _NoDraws:
    """Stands in for hypothesis data after the run: a stopped client sends no demand."""

    def draw(self, strategy: object) -> Any:
        raise AssertionError("a stopped client sent demand")


_NO_DRAWS: Any = _NoDraws()


class ClientMachine(RuleBasedStateMachine):
    OPTIONS: ClassVar[Mapping[str, Any]] = {}
    """More SemaphoreClient options, for a variant of the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(1000.0)
        self.client = SemaphoreClient(SEM, client_id="c1", clock=self.clock,
                                      claim_margin=MARGIN, request_timeout=5.0, **self.OPTIONS)
        self.holder = FakeHolder()
        self.wire: list[tuple[str, dict[str, Any]]] = []
        self.items = itertools.count()
        self.queued: dict[str, tuple[str, str | None]] = {}
        self.running: dict[str, tuple[str, str | None]] = {}
        self.ever_admitted: set[str] = set()
        self.used: dict[str, int] = {}

    @initialize(data=st.data())
    def start_with_work(self, data: st.DataObject) -> None:
        """Every run starts with items queued in each key and group, and permits for some."""
        for key in KEYS:
            for group in GROUPS:
                self.enqueue(key, group, 10.0, 2)
        self.roundtrip(data, urgency="calm")
        self.admit(None)

    # -- the client queue ----------------------------------------------------

    @rule(key=st.sampled_from(KEYS), group=st.sampled_from(GROUPS), age=st.floats(0, 50),
          count=st.integers(1, 3))
    def enqueue(self, key: str, group: str | None, age: float, count: int) -> None:
        for _ in range(count):
            item = f"i{next(self.items)}"
            assert self.client.enqueue(key, group, item, enqueued_at=self.clock.now - age)
            self.queued[item] = (key, group)

    @precondition(lambda self: self.queued or self.running)
    @rule(data=st.data())
    def enqueue_again(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(sorted([*self.queued, *self.running])))
        assert not self.client.enqueue("k1", None, item, enqueued_at=0.0)

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(sorted(self.queued)))
        assert self.client.cancel(item)
        del self.queued[item]

    @rule(limit=st.none() | st.integers(0, 3))
    def admit(self, limit: int | None) -> None:
        for permit in self.client.admit(limit=limit):
            assert permit.item_id in self.queued, "admitted an item that is not queued"
            assert (permit.key, permit.group) == self.queued.pop(permit.item_id)
            self.started(permit)

    @rule(key=st.sampled_from(KEYS), group=st.sampled_from(GROUPS))
    def arrive(self, key: str, group: str | None) -> None:
        """A delivery as the gate takes it: started at once on a permit at hand
        (admit_now), else queued."""
        item = f"i{next(self.items)}"
        permit = self.client.admit_now(key, group, item)
        if permit is None:
            assert self.client.enqueue(key, group, item, enqueued_at=self.clock.now)
            self.queued[item] = (key, group)
            return
        assert (permit.item_id, permit.key, permit.group) == (item, key, group)
        assert (key, group) not in self.queued.values(), "started ahead of older items"
        self.started(permit)

    def started(self, permit: Any) -> None:
        now = self.clock.now
        assert permit.item_id not in self.ever_admitted, "admitted twice"
        self.ever_admitted.add(permit.item_id)
        self.running[permit.item_id] = (permit.key, permit.group)
        if not permit.handed_off:  # else kept idle since its item ended: used once already
            self.check_use(permit, now)

    def check_use(self, permit: Any, now: float) -> None:
        """A claim or a draw: within what the holder issued, outside every margin."""
        self.used[permit.source_id] = self.used.get(permit.source_id, 0) + 1
        if permit.source == "grant":
            g = self.holder.grants.get(permit.source_id)
            issued = g.issued if g else 0
            assert g is not None and now < g.deadline - MARGIN, "claimed inside the margin"
            assert g.status == "active", "claimed from a grant the holder reclaimed"
        else:
            le = self.holder.leases.get(permit.source_id)
            assert le is not None, "drew from a lease the holder does not have (dropped)"
            assert not le.confirmed, "drew from a confirmed lease"
            assert le.drop_at is None or now < le.drop_at - MARGIN, (
                "drew from an unacknowledged lease inside the margin of its drop")
            issued = le.permits
        assert self.used[permit.source_id] <= issued, "more permits used than issued"

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(sorted(self.running)))
        assert self.client.release(item)
        assert not self.client.release(item)
        del self.running[item]

    @precondition(lambda self: len(self.ever_admitted) > 6)  # late in a run: teardown stops too
    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def release_and_refill(self, data: st.DataObject) -> None:
        """Steady work: an item ends and a new one of its key and group arrives."""
        item = data.draw(st.sampled_from(sorted(self.running)))
        key, group = self.running[item]
        self.release_item(item)
        self.enqueue(key, group, 0.0, 1)
        self.admit(None)

    @rule()
    def stop(self) -> None:
        self.client.stop()

    # -- the holder and the wire ---------------------------------------------

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.0, 2.0, 5.0, 12.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.holder.tick(self.clock.now)

    @rule(data=st.data(), urgency=st.sampled_from(URGENCY))
    def send_due(self, data: st.DataObject, urgency: str) -> None:
        now = self.clock.now
        for key in self.client.due():
            message = self.client.message(key)
            request = parse_request(message, semaphore=SEM, key=key)
            self.holder.apply(message, now)
            for entry in request.demand:
                self.holder.issue(key, entry.group,
                                  data.draw(st.integers(0, entry.count)),
                                  data.draw(st.sampled_from([0, 1, 3])), now)
            self.wire.append((key, self.holder.answer(key, message, now, urgency=urgency)))

    @rule(data=st.data(), urgency=st.sampled_from(URGENCY))
    def roundtrip(self, data: st.DataObject, urgency: str) -> None:
        """The common case: what is due is sent and answered at once, in order."""
        waiting = len(self.wire)
        self.send_due(data, urgency)
        while len(self.wire) > waiting:
            key, response = self.wire.pop(waiting)
            self.client.on_response(key, response)

    @precondition(lambda self: self.wire)
    @rule(data=st.data(), keep=st.booleans())
    def deliver(self, data: st.DataObject, keep: bool) -> None:
        """Any waiting reply, in any order; `keep` leaves a copy to deliver again."""
        index = data.draw(st.integers(0, len(self.wire) - 1))
        key, response = self.wire[index] if keep else self.wire.pop(index)
        self.client.on_response(key, response)

    @precondition(lambda self: self.wire)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        self.wire.pop(data.draw(st.integers(0, len(self.wire) - 1)))

    @rule(key=st.sampled_from(KEYS))
    def fail(self, key: str) -> None:
        self.client.on_failure(key)

    @rule(data=st.data())
    def work_arrives_near_a_drop(self, data: st.DataObject) -> None:
        """Time moves to inside the claim margin of an unacknowledged lease's drop, and an
        item of its key and group arrives: the client must not draw from that lease."""
        waiting = sorted((le.drop_at, lid) for lid, le in self.holder.leases.items()
                         if le.drop_at is not None and le.drop_at - MARGIN / 2 > self.clock.now)
        if not waiting:
            return
        drop_at, lid = data.draw(st.sampled_from(waiting))
        self.advance(drop_at - MARGIN / 2 - self.clock.now)
        lease = self.holder.leases[lid]
        self.enqueue(self.holder.keys[lid], lease.group, 0.0, 1)
        self.admit(None)

    @rule(data=st.data())
    def holder_retires_a_lease(self, data: st.DataObject) -> None:
        active = sorted(lid for lid, le in self.holder.leases.items() if le.status == "active")
        if active:
            self.holder.leases[data.draw(st.sampled_from(active))].status = "retired"

    def teardown(self) -> None:
        """Every run ends in a warm shutdown on a healthy wire: the client must settle."""
        for item in sorted(self.running):
            self.release_item(item)
        for item in sorted(self.queued):
            assert self.client.cancel(item)
        self.queued.clear()
        leases = sum(len(lg.leases) for lg in self.client._ledgers.values())
        event(f"leases at shutdown: {min(leases, 2)}")
        self.client.stop()
        for _ in range(40):  # past request_timeout plus the longest backoff
            self.roundtrip(_NO_DRAWS, urgency="calm")
            if self.client.settled():
                break
            self.advance(1.0)
        assert self.client.settled(), "did not settle after stop()"

    def release_item(self, item: str) -> None:
        assert self.client.release(item)
        del self.running[item]

    # -- what must always hold -----------------------------------------------

    @invariant()
    def queue_and_running_match(self) -> None:
        def counts(items: dict[str, tuple[str, str | None]]) -> dict[str, dict[str | None, int]]:
            out: dict[str, dict[str | None, int]] = {}
            for key, group in items.values():
                out.setdefault(key, {})
                out[key][group] = out[key].get(group, 0) + 1
            return out

        assert self.client.held() == counts(self.queued)
        assert self.client.running() == counts(self.running)

    @invariant()
    def passing_quiet_keys_by_misses_nothing(self) -> None:
        fresh = copy.deepcopy(self.client)
        fresh._talk.quiet.clear()
        assert self.client.due() == fresh.due(), "a key found quiet was due"
        assert ({k: lg.reports() for k, lg in self.client._ledgers.items()}
                == {k: lg.reports() for k, lg in fresh._ledgers.items()}), "a sweep was missed"

    @invariant()
    def timing_is_sane(self) -> None:
        at = self.client.next_due_at()
        assert at is None or at == at  # never NaN
        if self.client.stopped:
            assert self.client.admit() == []


class HandoffMachine(ClientMachine):
    """The options a worker's gate uses: ended items pass their permits on or keep them
    idle a while, idle leases go back, news supersedes a message in flight, and the pool's
    size bounds demand."""

    OPTIONS: ClassVar[Mapping[str, Any]] = {
        "handoff_window": 30.0, "handoff_linger": 1.0, "roomy_linger": 2.5, "lease_idle": 3.0,
        "supersede_after": 0.5, "capacity": 3}

    @precondition(lambda self: self.running and self.queued)
    @rule(data=st.data())
    def take_turns(self, data: st.DataObject) -> None:
        """A chain's turn runs out: a reply lists other workers' older items, a turn's
        time passes, and items with successors queued end, so grant permits go back
        between passes."""
        self.roundtrip(data, urgency="waiting")
        self.advance(HANDOFF_TURN)
        self.roundtrip(data, urgency="waiting")
        self.admit(None)  # fresh grants go to queued items, as the gate's loop does
        for item in sorted(self.running):
            if self.running[item] in self.queued.values():
                self.end(item)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def pass_on(self, data: st.DataObject) -> None:
        self.end(data.draw(st.sampled_from(sorted(self.running))))

    def end(self, item: str) -> None:
        key, group = self.running.pop(item)
        successor = self.client.pass_on(item)
        if successor is not None:
            assert (successor.key, successor.group) == (key, group)
            assert self.queued.pop(successor.item_id) == (key, group), "not a queued item"
            assert successor.item_id not in self.ever_admitted, "admitted twice"
            self.ever_admitted.add(successor.item_id)
            self.running[successor.item_id] = (key, group)


for machine in (ClientMachine, HandoffMachine):
    machine.TestCase.settings = settings(
        max_examples=100, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
TestClientMachine = ClientMachine.TestCase
TestHandoffMachine = HandoffMachine.TestCase
