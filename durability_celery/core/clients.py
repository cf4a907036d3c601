# Which clients hold what under a key, when each was last heard from, and how
# a client confirmed gone is forgotten. The spec leaves a vanished client's
# claims charged forever; forgetting is the one move that frees them, so it
# is explicit, per client, and never decided here (the caller confirms death).
from __future__ import annotations

from dataclasses import dataclass

from msgspec.structs import replace

from .keystate import ClientSeen, KeyState

SEEN_RESOLUTION = 5.0
"""Seconds a client's last-seen stamp may lag: a client heard again sooner keeps it.
Reconciliation, its only reader, needs no finer (reconcile_after is at least 10 s, and
a client heard every round_period is never staler than this plus that), and a stamp
kept for a while spares most report rounds a rewrite of the key's clients row."""


def seen(clients: tuple[ClientSeen, ...], holding: set[str], heard: set[str],
         now: float) -> tuple[ClientSeen, ...]:
    """A round's new clients, by client id, for a state whose clients are `clients` and
    whose grants and leases are held by `holding`: the clients `heard` from stamped (see
    SEEN_RESOLUTION), and only clients that still hold something kept."""
    order = sorted(holding)
    if len(clients) == len(order):
        for client, client_id in zip(clients, order, strict=True):
            if client.client_id != client_id or (
                    client_id in heard and now - client.last_seen_at >= SEEN_RESOLUTION):
                break
        else:
            return clients  # the usual round: the same holders, none due a new stamp
    stamps = {c.client_id: c.last_seen_at for c in clients}
    for client_id in heard:
        stamp = stamps.get(client_id)
        if stamp is None or now - stamp >= SEEN_RESOLUTION:
            stamps[client_id] = now
    # A holder with no stamp (state written before stamps existed) counts as seen now.
    return tuple(ClientSeen(client_id, stamps.get(client_id, now))
                 for client_id in order)


@dataclass(frozen=True)
class Forgotten:
    """What forgetting one client freed under one key."""

    client_id: str
    grants: int
    leases: int
    permits: int
    """Footprint that stopped counting against the limit."""


def forget_client(state: KeyState, client_id: str) -> tuple[KeyState, Forgotten]:
    """Drop every grant and lease of `client_id`: only for a client confirmed gone."""
    grants = [g for g in state.grants if g.client_id == client_id]
    leases = [le for le in state.leases if le.client_id == client_id]
    freed = sum(g.footprint for g in grants) + sum(le.footprint for le in leases)
    new_state = replace(
        state,
        grants=tuple(g for g in state.grants if g.client_id != client_id),
        leases=tuple(le for le in state.leases if le.client_id != client_id),
        clients=tuple(c for c in state.clients if c.client_id != client_id),
    )
    return new_state, Forgotten(client_id, len(grants), len(leases), freed)
