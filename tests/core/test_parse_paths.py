# parse_request reads a message in C (msgspec.convert) and falls back to the
# field-by-field parser, which names the bad field, when that fails; the rules no
# type states are checked after either, once. The fast path may refuse more, never
# less: whatever it accepts, the slow one accepts as the same Request; and every
# message a client sends takes it. Each rule's own bad message is in test_validation.
from __future__ import annotations

from typing import Any

from core_harness import KEY, SEM
from hypothesis import event, given, settings
from hypothesis import strategies as st

from durability_celery.errors import InvalidMessage
from durability_celery.wire.request import (
    DemandEntry,
    GrantReport,
    LeaseReport,
    Request,
    _convert,
    _parse_field_by_field,
)

IDS = st.sampled_from(["g1", "g2", "c-1"])
ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 10), st.sampled_from([10**12, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1e9),
    st.sampled_from(["", "g1", "x" * 201, "request", "sync"]), st.just([]), st.just({}))


@st.composite
def requests(draw: st.DrawFn) -> Request:
    kind = draw(st.sampled_from(["request", "sync"]))
    demand = []
    for group in draw(st.lists(st.none() | IDS, unique=True, max_size=3)) if kind == "request" \
            else []:
        count = draw(st.integers(0, 8))
        times = tuple(sorted(draw(st.lists(st.floats(0, 1e9), max_size=min(count, 5)))))
        ready = draw(st.none() | st.integers(0, count))
        demand.append(DemandEntry(group, count, times[0] if times else draw(st.floats(0, 1e9)),
                                  times, ready))
    marks = st.integers(0, 9).flatmap(lambda taken: st.tuples(st.just(taken),
                                                                st.integers(0, taken)))
    grants = [GrantReport(gid, *draw(marks))
              for gid in draw(st.lists(IDS, unique=True, max_size=3))]
    leases = [LeaseReport(lid, *draw(marks), draw(st.booleans()), draw(st.none() | IDS))
              for lid in draw(st.lists(IDS, unique=True, max_size=3))]
    return Request(kind, draw(IDS), tuple(demand), tuple(grants), tuple(leases),
                   draw(st.booleans()), draw(st.none() | st.integers(0, 2**63 - 1)))


def _slots(value: Any) -> list[tuple[Any, Any]]:
    """(container, index or name) of every value inside a message, at any depth."""
    found: list[tuple[Any, Any]] = []
    inner = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for slot, item in inner:
        found.append((value, slot))
        found += _slots(item)
    return found


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A message a client could send with up to two things changed: a value replaced by
    anything, a field removed, an entry of a list repeated, the other kind named."""
    message = draw(requests()).to_wire(semaphore=SEM, key=KEY)
    for _ in range(draw(st.integers(0, 2))):
        slots = _slots(message)
        change = draw(st.sampled_from(["replace", "remove", "repeat", "kind"]))
        listed = [(container, slot) for container, slot in slots if isinstance(container, list)]
        if change == "kind":
            message["type"] = "sync" if message.get("type") == "request" else "request"
        elif change == "repeat" and listed:
            container, slot = draw(st.sampled_from(listed))
            container.append(container[slot])
        else:
            container, slot = draw(st.sampled_from(slots))
            if change == "remove" and isinstance(container, dict):
                del container[slot]
            else:
                container[slot] = draw(ANYTHING)
    return message


@settings(max_examples=1000, deadline=None)
@given(near_valid())
def test_the_fast_path_accepts_only_what_the_slow_one_accepts_and_reads_it_alike(
        message: dict[str, Any]) -> None:
    fast = _convert(message, SEM, KEY)
    try:
        slow: Request | None = _parse_field_by_field(message, SEM, KEY)
    except InvalidMessage:
        slow = None
    event("both accept" if fast is not None else
          "only the slow path accepts" if slow is not None else "both refuse")
    if fast is not None:
        assert slow == fast


@settings(max_examples=300, deadline=None)
@given(requests())
def test_every_message_a_client_sends_takes_the_fast_path(request: Request) -> None:
    assert _convert(request.to_wire(semaphore=SEM, key=KEY), SEM, KEY) == request
