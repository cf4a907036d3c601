# Bad input gets a clear error naming the field and changes nothing; the
# other messages of the same round are served as if it had not been there.
from __future__ import annotations

from typing import Any

import pytest
from core_harness import KEY, SEM, Limits, granted, request, sync

from durability_celery.core.config import Leases, Over, RoundConfig, Strict, Under
from durability_celery.core.round import KeyState, parse_messages, run_round
from durability_celery.errors import ConfigurationError
from durability_celery.wire.request import parse_request

T0 = 1_000.0


def good() -> dict[str, Any]:
    return request("a", [(None, 1, 1.0)])


def with_(**changes: Any) -> dict[str, Any]:
    return good() | changes


BAD = [
    ("not-a-dict", ["type", "request"], "message"),
    ("wrong-type", with_(type="grab"), "type"),
    ("wrong-version", with_(v=2), "v"),
    ("bool-version", with_(v=True), "v"),
    ("other-semaphore", with_(semaphore="nope"), "semaphore"),
    ("other-key", with_(key="acct-7"), "key"),
    ("no-client", {k: v for k, v in good().items() if k != "client_id"}, "client_id"),
    ("empty-client", with_(client_id=""), "client_id"),
    ("negative-count", with_(demand=[{"group": None, "count": -1, "oldest_at": 1.0}]),
     "demand[0].count"),
    ("huge-count", with_(demand=[{"group": None, "count": 10**12, "oldest_at": 1.0}]),
     "demand[0].count"),
    ("float-count", with_(demand=[{"group": None, "count": 1.5, "oldest_at": 1.0}]),
     "demand[0].count"),
    ("nan-time", with_(demand=[{"group": None, "count": 1, "oldest_at": float("nan")}]),
     "demand[0].oldest_at"),
    ("duplicate-group", with_(demand=[{"group": "g", "count": 1, "oldest_at": 1.0}] * 2),
     "demand[1].group"),
    ("demand-not-list", with_(demand={"group": None}), "demand"),
    ("ages-not-list", with_(demand=[{"group": None, "count": 2, "oldest_at": 1.0,
                                     "queued_at": 1.0}]), "demand[0].queued_at"),
    ("ages-over-count", with_(demand=[{"group": None, "count": 1, "oldest_at": 1.0,
                                       "queued_at": [1.0, 2.0]}]), "demand[0].queued_at"),
    ("ages-over-cap", with_(demand=[{"group": None, "count": 10**6, "oldest_at": 1.0,
                                     "queued_at": [1.0] * 257}]), "demand[0].queued_at"),
    ("ages-over-message-cap", with_(demand=[
        {"group": f"g{i}", "count": 256, "oldest_at": 1.0, "queued_at": [1.0] * 256}
        for i in range(40)]), "demand[39].queued_at"),
    ("ages-not-from-oldest", with_(demand=[{"group": None, "count": 2, "oldest_at": 1.0,
                                            "queued_at": [0.5, 2.0]}]), "demand[0].queued_at"),
    ("ages-out-of-order", with_(demand=[{"group": None, "count": 3, "oldest_at": 1.0,
                                         "queued_at": [1.0, 3.0, 2.0]}]), "demand[0].queued_at"),
    ("ages-nan", with_(demand=[{"group": None, "count": 2, "oldest_at": 1.0,
                                "queued_at": [1.0, float("nan")]}]), "demand[0].queued_at[1]"),
    ("ready-over-count", with_(demand=[{"group": None, "count": 1, "oldest_at": 1.0,
                                        "ready": 2}]), "demand[0].ready"),
    ("ready-not-int", with_(demand=[{"group": None, "count": 1, "oldest_at": 1.0,
                                     "ready": "1"}]), "demand[0].ready"),
    ("released-over-claimed", with_(grants=[{"grant_id": "x", "claimed": 1, "released": 2}]),
     "grants[0].released"),
    ("duplicate-grant-id", with_(grants=[{"grant_id": "x", "claimed": 1, "released": 0}] * 2),
     "grants[1].grant_id"),
    ("released-over-drawn", with_(leases=[{"lease_id": "l", "drawn": 1, "released": 2}]),
     "leases[0].released"),
    ("duplicate-lease-id", with_(leases=[{"lease_id": "l", "drawn": 1, "released": 0}] * 2),
     "leases[1].lease_id"),
    ("lease-stopped-not-bool",
     with_(leases=[{"lease_id": "l", "drawn": 1, "released": 0, "stopped": "yes"}]),
     "leases[0].stopped"),
    ("lease-group-not-string",
     with_(leases=[{"lease_id": "l", "drawn": 1, "released": 0, "group": 7}]), "leases[0].group"),
    ("lease-group-empty",
     with_(leases=[{"lease_id": "l", "drawn": 1, "released": 0, "group": ""}]),
     "leases[0].group"),
    ("lease-group-too-long",
     with_(leases=[{"lease_id": "l", "drawn": 1, "released": 0, "group": "g" * 201}]),
     "leases[0].group"),
    ("sync-with-demand", sync("a") | {"demand": [{"group": None, "count": 1, "oldest_at": 1}]},
     "demand"),
    ("negative-seen-round", with_(seen_round=-1), "seen_round"),
    ("bool-seen-round", with_(seen_round=True), "seen_round"),
    ("huge-seen-round", with_(seen_round=2**63), "seen_round"),
    ("string-seen-round", with_(seen_round="3"), "seen_round"),
]


@pytest.mark.parametrize(("message", "field"), [(m, f) for _, m, f in BAD],
                         ids=[name for name, _, _ in BAD])
def test_bad_message_gets_an_error_naming_the_field(
    make_semaphore: Any, message: Any, field: str
) -> None:
    sem = make_semaphore(Limits(3))
    bad, fine = sem.run_round(KEY, [message, request("b", [(None, 3, 1.0)])], now=T0)
    assert set(bad) == {"v", "error"} and bad["error"]["code"] == "invalid_message"
    assert bad["error"]["message"].startswith(field)
    assert granted(fine) == 3
    assert sem.usage(KEY, now=T0).outstanding == 3


def test_a_lease_reports_group_is_optional_and_survives_the_wire() -> None:
    reports = [{"lease_id": "a", "drawn": 1, "released": 0, "group": "g1"},
               {"lease_id": "b", "drawn": 1, "released": 0, "group": None},
               {"lease_id": "c", "drawn": 1, "released": 0}]
    parsed = parse_request(with_(leases=reports), semaphore=SEM, key=KEY)
    assert [lr.group for lr in parsed.leases] == ["g1", None, None]
    again = parse_request(parsed.to_wire(semaphore=SEM, key=KEY), semaphore=SEM, key=KEY)
    assert again == parsed


def test_another_clients_ids_are_rejected_and_change_nothing(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(4), leases=Leases(Strict()))
    (mine,) = sem.run_round(KEY, [request("a", [(None, 2, 1.0)], supports_leases=True)], now=T0)
    gid = mine["grants"][0]["grant_id"]
    lid = mine["leases"][0]["lease_id"]
    before = sem.usage(KEY, now=T0 + 1)
    thief_g, thief_l = sem.run_round(KEY, [
        sync("b", grants=[(gid, 2, 2)]), sync("b", leases=[(lid, 2, 2, True)])
    ], now=T0 + 1)
    assert thief_g["error"]["message"].startswith("grants[0].grant_id")
    assert thief_l["error"]["message"].startswith("leases[0].lease_id")
    assert sem.usage(KEY, now=T0 + 1) == before


@pytest.mark.parametrize(
    ("build", "setting"),
    [
        (lambda: RoundConfig("s", grant_timeout=0), "grant_timeout"),
        (lambda: RoundConfig("s", round_wait=-1), "round_wait"),
        (lambda: RoundConfig("s", round_wait=0, round_period=0), "round_period"),
        (lambda: RoundConfig("", grant_timeout=1), "semaphore name"),
        (lambda: Leases(permits_per_lease=0), "Leases.permits_per_lease"),
        (lambda: Leases(ttl=0.5), "Leases.ttl"),
        (lambda: Leases(idle=-1.0), "Leases.idle"),
        (lambda: Leases(idle="5"), "Leases.idle"),  # type: ignore[arg-type]
        (lambda: Leases(limited_groups="all"), "Leases.limited_groups"),  # type: ignore[arg-type]
        (lambda: Under(reserve=-1), "Under.reserve"),
        (lambda: Over(), "Over needs exactly one"),
        (lambda: Over(extra=1, ratio=0.5), "Over needs exactly one"),
        (lambda: Over(ratio=float("inf")), "Over.ratio"),
        (lambda: Over(ratio=-0.5), "Over.ratio must be a number between 0 and 100"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_setting(build: Any, setting: str) -> None:
    with pytest.raises(ConfigurationError, match=setting):
        build()


@pytest.mark.parametrize("key", ["", "k" * 201, 7, None])
def test_a_key_no_round_could_serve_is_refused_before_the_round(key: Any) -> None:
    from durability_celery.errors import InvalidMessage
    from durability_celery.wire.fields import MAX_KEY_LENGTH
    from durability_celery.wire.request import check_key

    with pytest.raises(InvalidMessage, match=f"^key: must be a non-empty string of at most "
                                             f"{MAX_KEY_LENGTH} chars, got ") as raised:
        check_key(key)
    assert raised.value.code == "invalid_message"
    assert check_key("k" * MAX_KEY_LENGTH) == "k" * MAX_KEY_LENGTH


def test_messages_parsed_for_another_key_are_refused() -> None:
    config = RoundConfig("s", grant_timeout=10)
    parsed = parse_messages([], semaphore="s", key="other")
    with pytest.raises(ValueError, match="another key"):
        run_round(KeyState("s", KEY), parsed, config=config, limits=Limits(1), now=T0,
                  new_id=lambda: "id")
