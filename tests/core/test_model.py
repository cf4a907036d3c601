# Stateful property test of the pure core against a small model of clients
# that claim, draw and release for real while their reports are lost,
# duplicated and reordered, time passes, and limits go up and down.
# After every step: clamps hold, the holder never believes more was released
# than really was, it counts at least what really runs, and whatever a round
# issues fits under the limit in force (limit + extra in `over` mode); and a round
# of several clients lists to each only others' items left waiting.
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core_harness import KEY, SEM, Limits, request, sync
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from durability_celery.core.config import Leases, Over, Strict, Under
from durability_celery.store.memory import MemorySemaphore

GRANT_TIMEOUT = 10.0
CLAIM_MARGIN = 2.0
CLIENTS = ("a", "b", "c")
GROUPS = (None, "w")


@dataclass
class Held:
    """What one client really did with one grant or lease (the ground truth)."""

    permits: int
    used: int = 0  # claimed (grant) or drawn (lease)
    released: int = 0
    deadline: float = 0.0
    status: str = "active"
    stopped: bool = False
    acknowledged: bool = True
    """A lease the holder says its client has reported since issue (else `deadline`
    is when it is dropped)."""


@dataclass
class Client:
    grants: dict[str, Held] = field(default_factory=dict)
    leases: dict[str, Held] = field(default_factory=dict)
    seen_round: int | None = None
    """The highest round of the replies it applied, sent with each message."""

    def report(self) -> dict[str, Any]:
        return {
            "grants": [(gid, h.used, h.released) for gid, h in self.grants.items()],
            "leases": [(lid, h.used, h.released, h.stopped) for lid, h in self.leases.items()],
            "seen_round": self.seen_round,
        }

    def running(self) -> int:
        held = [*self.grants.values(), *self.leases.values()]
        return sum(h.used - h.released for h in held)


class SemaphoreModel(RuleBasedStateMachine):
    provisioning: Strict | Under | Over | None = Strict()

    def __init__(self) -> None:
        super().__init__()
        self.limits = Limits(6, groups={"w": 3})
        leases = None if self.provisioning is None else Leases(
            self.provisioning, permits_per_lease=3, ttl=30.0)
        self.sem = MemorySemaphore(SEM, self.limits, grant_timeout=GRANT_TIMEOUT, leases=leases)
        self.now = 1_000.0
        self.clients = {c: Client() for c in CLIENTS}
        self.sent: list[dict[str, Any]] = []

    # -- the wire -------------------------------------------------------------

    def deliver(self, message: dict[str, Any], client: str | None, *, lost_reply: bool) -> None:
        grants_before = {g.grant_id for g in self.sem.state(KEY).grants}
        leases_before = {le.lease_id for le in self.sem.state(KEY).leases}
        (reply,) = self.sem.run_round(KEY, [message], now=self.now)
        assert "error" not in reply, reply
        state = self.sem.state(KEY)
        new_grants = {g.grant_id for g in state.grants} - grants_before
        # Issued ones: a report of a lease the holder does not know adopts it retired,
        # charged as reported, whatever the limit (see Ledger.apply).
        new_leases = {le.lease_id for le in state.leases if le.status == "active"} - leases_before
        if new_grants or new_leases:
            self.check_issue_fits(grant_issued=bool(new_grants))
        self.sent.append(message)
        if client is not None and not lost_reply:
            self.apply(self.clients[client], reply)

    def apply(self, client: Client, reply: dict[str, Any]) -> None:
        client.seen_round = max(client.seen_round or 0, reply["round"])
        for g in reply["grants"]:
            held = client.grants.setdefault(g["grant_id"], Held(g["permits"]))
            held.permits, held.status = g["permits"], g["status"]
            held.deadline = g["claim_deadline"] or 0.0
            if g["status"] == "not_found" and held.used == held.released:
                del client.grants[g["grant_id"]]
        for le in reply["leases"]:
            # As the real client does: nothing of ours runs on a lease we did not know
            # (a lost reply, or a stale report the holder adopted after we forgot it).
            held = client.leases.setdefault(
                le["lease_id"], Held(le["permits"], used=le["drawn"], released=le["drawn"]))
            held.status = le["status"]
            held.acknowledged = le.get("acknowledged", True)
            held.deadline = le["expires_at"] or 0.0
            if le["status"] != "active":
                held.stopped = True  # a retired lease draws no more
            if le["status"] == "settled":
                del client.leases[le["lease_id"]]

    def check_issue_fits(self, *, grant_issued: bool) -> None:
        """What a round issued fits under the limit in force (docs/guarantees.md)."""
        usage = self.sem.usage(KEY, now=self.now)
        limit = self.limits.value
        assert isinstance(limit, int)
        if isinstance(self.provisioning, Over):
            if grant_issued:
                assert usage.outstanding <= limit
            assert usage.in_use <= limit + self.provisioning.extra_for(limit)
        else:
            assert usage.in_use <= limit

    # -- rules ----------------------------------------------------------------

    @rule(client=st.sampled_from(CLIENTS), group=st.sampled_from(GROUPS),
          count=st.integers(0, 8), lost_reply=st.booleans(), leases=st.booleans(),
          ready=st.none() | st.integers(0, 8))
    def ask(self, client: str, group: str | None, count: int, lost_reply: bool,
            leases: bool, ready: int | None) -> None:
        message = request(client, [(group, count, self.now - count)],
                          supports_leases=leases, **self.clients[client].report())
        if ready is not None:  # items this client could start now: any, up to count
            message["demand"][0]["ready"] = min(ready, count)
        self.deliver(message, client, lost_reply=lost_reply)

    @rule(counts=st.lists(st.integers(0, 6), min_size=2, max_size=3),
          group=st.sampled_from(GROUPS))
    def ask_together(self, counts: list[int], group: str | None) -> None:
        """Clients' requests in one round: each reply lists only other clients' items
        left waiting (see Waiting), never more than that client's unmet demand."""
        asked = {}
        messages = []
        for i, count in enumerate(counts):
            client = CLIENTS[i]
            asked[client] = self.now - count - i / 10  # distinct per client
            messages.append(request(client, [(group, count, asked[client])],
                                    **self.clients[client].report()))
        before = self.sem.state(KEY)
        replies = self.sem.run_round(KEY, messages, now=self.now)
        state = self.sem.state(KEY)
        new_grants = {g.grant_id for g in state.grants} - {g.grant_id for g in before.grants}
        new_leases = ({le.lease_id for le in state.leases if le.status == "active"}
                      - {le.lease_id for le in before.leases})
        if new_grants or new_leases:
            self.check_issue_fits(grant_issued=bool(new_grants))
        unmet = {CLIENTS[i]: next((b["queued"] for b in r["blocked"]
                                   if b["reason"] in ("limit", "group_limit")), 0)
                 for i, r in enumerate(replies)}
        for i, reply in enumerate(replies):
            client = CLIENTS[i]
            for entry in reply.get("waiting", []):
                event("a reply lists others' waiting items")
                assert entry["group"] == group
                for other in {o for o in asked if o != client}:
                    listed = entry["queued_at"].count(asked[other])
                    assert listed <= unmet[other]
                assert set(entry["queued_at"]) <= {asked[o] for o in asked if o != client}
            self.sent.append(messages[i])
            self.apply(self.clients[client], reply)

    @rule(client=st.sampled_from(CLIENTS), lost=st.booleans(), lost_reply=st.booleans())
    def report(self, client: str, lost: bool, lost_reply: bool) -> None:
        message = sync(client, **self.clients[client].report())
        if lost:
            self.sent.append(message)  # may still arrive later, reordered
        else:
            self.deliver(message, client, lost_reply=lost_reply)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def replay_old_message(self, data: st.DataObject) -> None:
        """A duplicated or reordered message arrives late; its reply is lost."""
        self.deliver(data.draw(st.sampled_from(self.sent)), None, lost_reply=True)

    @rule(data=st.data())
    def replay_a_report_of_a_forgotten_lease(self, data: st.DataObject) -> None:
        """The late copy that matters most, rare among all: it names, in use, a lease its
        client has since forgotten, which the holder adopts again."""
        stale = [m for m in self.sent
                 if any(le["drawn"] > le["released"]
                        and le["lease_id"] not in self.clients[m["client_id"]].leases
                        for le in m["leases"])]
        if stale:
            event("a stale report names a forgotten lease")
            self.deliver(data.draw(st.sampled_from(stale)), None, lost_reply=True)

    @rule(client=st.sampled_from(CLIENTS))
    def run_a_task_on_a_lease(self, client: str) -> None:
        """A lease's whole life in one step, as most of them go: asked for, drawn from
        with the draw reported, the task done, stopped, reported and settled."""
        held = self.clients[client]
        self.deliver(request(client, [(None, 1, self.now)], supports_leases=True,
                             **held.report()), client, lost_reply=False)
        lease = next((h for h in held.leases.values()
                      if h.status == "active" and not h.stopped and h.used < h.permits), None)
        if lease is None:
            return
        lease.used += 1
        self.deliver(sync(client, **held.report()), client, lost_reply=False)
        lease.released, lease.stopped = lease.used, True
        self.deliver(sync(client, **held.report()), client, lost_reply=False)

    @rule(client=st.sampled_from(CLIENTS), data=st.data())
    def claim(self, client: str, data: st.DataObject) -> None:
        """Claims stay clear of the deadline and reach the holder before it (the claim margin)."""
        choices = [h for h in self.clients[client].grants.values()
                   if h.status == "active" and h.used < h.permits
                   and self.now < h.deadline - CLAIM_MARGIN]
        if choices:
            data.draw(st.sampled_from(choices)).used += 1
            self.deliver(sync(client, **self.clients[client].report()), client, lost_reply=True)

    @rule(client=st.sampled_from(CLIENTS), data=st.data())
    def draw(self, client: str, data: st.DataObject) -> None:
        """Draws from a lease not yet acknowledged, like claims, stay clear of the
        deadline and reach the holder before it (the holder drops it then)."""
        choices = [h for h in self.clients[client].leases.values()
                   if not h.stopped and h.used < h.permits
                   and (h.acknowledged or self.now < h.deadline - CLAIM_MARGIN)]
        if choices:
            held = data.draw(st.sampled_from(choices))
            held.used += 1
            if not held.acknowledged:
                self.deliver(sync(client, **self.clients[client].report()), client,
                             lost_reply=True)

    @rule(client=st.sampled_from(CLIENTS), data=st.data())
    def release(self, client: str, data: st.DataObject) -> None:
        held = self.clients[client]
        choices = [h for h in [*held.grants.values(), *held.leases.values()]
                   if h.used > h.released]
        if choices:
            data.draw(st.sampled_from(choices)).released += 1

    @rule(client=st.sampled_from(CLIENTS))
    def stop_leases(self, client: str) -> None:
        for held in self.clients[client].leases.values():
            held.stopped = True

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 11.0, 31.0]))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def alarm(self) -> None:
        self.sem.reclaim(KEY, now=self.now)

    @rule(limit=st.integers(0, 8), group=st.sampled_from([None, 1, 3, 5]))
    def change_limits(self, limit: int, group: int | None) -> None:
        self.limits.value = limit
        self.limits.groups["w"] = group

    # -- invariants -----------------------------------------------------------

    @invariant()
    def marks_stay_within_their_clamps(self) -> None:
        state = self.sem.state(KEY)
        for g in state.grants:
            assert 0 <= g.released <= g.claimed <= g.permits
        for le in state.leases:
            assert 0 <= le.released <= le.drawn <= le.permits

    @invariant()
    def nothing_is_freed_that_was_not_freed(self) -> None:
        state = self.sem.state(KEY)
        for g in state.grants:
            truth = self.clients[g.client_id].grants.get(g.grant_id)
            if truth is not None:
                assert g.claimed <= truth.used and g.released <= truth.released
        for le in state.leases:
            truth = self.clients[le.client_id].leases.get(le.lease_id)
            if truth is not None:
                assert le.drawn <= truth.used and le.released <= truth.released

    @invariant()
    def only_leases_their_client_knows_are_acknowledged(self) -> None:
        # A stale copy can bring back a lease its client forgot; acknowledged, it would
        # stay charged while the client lives, since the client never names it again.
        for le in self.sem.state(KEY).leases:
            if le.acknowledged:
                assert le.lease_id in self.clients[le.client_id].leases, le

    @invariant()
    def the_holder_counts_at_least_what_runs(self) -> None:
        running = sum(c.running() for c in self.clients.values())
        assert running <= self.sem.usage(KEY, now=self.now).in_use


class UnderModel(SemaphoreModel):
    provisioning = Under(reserve=2)


class OverModel(SemaphoreModel):
    provisioning = Over(extra=3)


class GrantsOnlyModel(SemaphoreModel):
    provisioning = None


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestStrict = SemaphoreModel.TestCase
TestStrict.settings = SETTINGS
TestUnder = UnderModel.TestCase
TestUnder.settings = SETTINGS
TestOver = OverModel.TestCase
TestOver.settings = SETTINGS
TestGrantsOnly = GrantsOnlyModel.TestCase
TestGrantsOnly.settings = SETTINGS
