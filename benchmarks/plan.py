# What one `python -m benchmarks` run measures, full or --quick: the variants,
# sizes and time bounds in one place, so the report can print them verbatim.
# Rule: every count and every wait here is bounded; --quick keeps the whole run
# under about two minutes, the full run under about half an hour on 2 cores.
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

DEFAULT = {"round_wait": 1.0, "round_period": 2.0}  # the semaphore's defaults
FAST = {"round_wait": 0.01, "round_period": 0.05}
ONE_SHOT = {"handoff_window": 0.0}  # the spec's permits: every task's goes back to the holder
SEMAPHORES: dict[str, dict[str, Any]] = {
    "grants": {**DEFAULT, "leases": False},
    "leases": {**DEFAULT, "leases": True},
    "grants_oneshot": {**DEFAULT, **ONE_SHOT, "leases": False},
    "leases_oneshot": {**DEFAULT, **ONE_SHOT, "leases": True},
    "grants_fast": {**FAST, "leases": False},
    "leases_fast": {**FAST, "leases": True},
}
LABELS = {
    "plain": "plain Celery (no admission)",
    "diy": "DIY Redis INCR/DECR + retry(countdown=1)",
    "grants": "admitted, grants only, defaults (rounds 1/2 s, handoff 60 s)",
    "leases": "admitted, leases, defaults (rounds 1/2 s, handoff 60 s)",
    "grants_oneshot": "admitted, grants only, default rounds, one-shot permits (handoff 0)",
    "leases_oneshot": "admitted, leases, default rounds, one-shot permits (handoff 0)",
    "grants_fast": "admitted, grants only, fast rounds (0.01/0.05 s), handoff 60 s",
    "leases_fast": "admitted, leases, fast rounds (0.01/0.05 s), handoff 60 s",
}
VARIANTS = ("plain", "diy", "grants", "leases", "grants_oneshot", "leases_oneshot",
            "grants_fast", "leases_fast")


@dataclass(frozen=True)
class Plan:
    quick: bool
    overhead_tasks: int
    overhead_cap: float
    overhead_pools: tuple[str, ...] = ("threads", "prefork")
    overhead_concurrency: int = 4
    overhead_keys: tuple[int, ...] = (1, 16)
    overhead_passes: int = 5
    """Times each pool and key count runs the variants with targets, each between two
    plain runs (the others run in the first pass only). A target near the ratio is
    judged on the median of the passes: on 2026-12-01 single runs of one cell ranged
    0.72-1.27, and with three passes the leases medians of three cells came out
    0.84-0.91 in a full run while 4-pass probes right after gave 0.96-0.98."""
    solo_passes: int = 3
    """Passes of the solo pool (concurrency 1, one key; no target: the issue's are for
    threads and prefork); 0: none."""
    raised_hold: int = 32
    """max_held per pool slot of the extra overhead run (the default is 8)."""
    raised_hold_keys: int = 16
    """Keys of that run; 0: no such run."""
    works: tuple[float, ...] = (1.0, 0.1, 0.01)
    limits: tuple[int, ...] = (4, 20)
    busy_seconds: dict[float, float] = field(default_factory=dict)
    contention_clients: int = 2
    contention_concurrency: int = 16  # 2 x 16 = 32 slots >= limit 20 + 12
    contention_variants: tuple[str, ...] = VARIANTS
    latency_variants: tuple[str, ...] = VARIANTS
    latency_samples: int = 40
    latency_spacing: float = 0.05
    scale_keys: int = 10_000
    scale_seconds: float = 8.0
    fleet_passes: int = 3
    """Passes of each fleet deployment (benchmarks/fleets.py), every variant in each."""
    custom: bool = False
    """Passes, pools or variants narrowed on the command line (`customize`): written to
    files of its own, never over the full run's that docs/benchmarks.md shows."""
    others: bool = True
    """Run the variants without a target (DIY counter, one-shot permits, fast rounds) in
    the first pass, and the raised-hold run; off for a run that only needs the targets."""

    @property
    def suffix(self) -> str:
        """Of the results and plot files: the full run's have none."""
        return "-quick" if self.quick else "-custom" if self.custom else ""

    def pass_variants(self, passage: int) -> tuple[str, ...]:
        """The variants of one overhead pass, each between two plain runs: the ones with
        targets in every pass; the others, far from any target or only for comparison,
        in the first (one-shot permits wait a round per task, and most of their runs
        reach the time bound).

        The two with targets take turns going first. With leases always first, twelve
        passes of threads over 16 keys gave leases 0.929 and grants 0.956 (means); with
        grants always first, leases 0.958 and grants 0.934: over 16 keys the first of the
        two lost about 2.5 points to its place alone (over one key, no such effect)."""
        others = (("diy", "leases_oneshot", "grants_oneshot", "leases_fast", "grants_fast")
                  if passage == 0 and self.others else ())
        return between_plain((*self.targets(passage), *others))

    @staticmethod
    def targets(passage: int) -> tuple[str, str]:
        """The two variants with targets, in the order of this pass (they take turns going
        first; see pass_variants). Every overhead pass orders them so: the main runs', the
        raised-hold run's and solo's."""
        return ("leases", "grants") if passage % 2 == 0 else ("grants", "leases")

    def overhead_warm(self, keys: int) -> int:
        """Unmeasured tasks per key before each overhead run: a pool's worth in all, so
        one key starts the run with the permits a busy pool keeps (with 2, grants only
        ran its first seconds on 2 of 4 slots), and at least 2 per key. No more: with 16
        keys, 4 each overflowed max_held, the warm-up's grants came over two rounds, and
        keys whose idle permits had just gone back waited a round_period to ask again
        (measured: 0.51 of plain instead of 0.91 over the run, the same after its start)."""
        return max(2, -(-self.overhead_concurrency // keys))

    def first_round(self, variant: str) -> float:
        """Feeding time added before the measured window, for the first grant to arrive."""
        spec = SEMAPHORES.get(variant)
        return 0.5 if spec is None else spec["round_wait"] + 1.0


OVERHEAD_POOLS = ("threads", "prefork", "solo")
MAX_PASSES = 50


def between_plain(variants: tuple[str, ...]) -> tuple[str, ...]:
    """Every variant between two plain runs: each is compared with the mean of the two
    (report.py). This machine is shared and its speed drifts by up to a third within
    minutes; with plain only first and last in a pass, one cell moved by up to 0.23
    between two runs of near-identical code."""
    order = ["plain"]
    for variant in variants:
        order += [variant, "plain"]
    return tuple(order)


def customize(plan: Plan, *, passes: int | None = None, pools: tuple[str, ...] | None = None,
              keys: tuple[int, ...] | None = None, targets_only: bool = False) -> Plan:
    """Narrow the overhead section for a longer look at fewer cells (say 12 passes of
    threads alone: a cell's median then moves less than the five passes' +-0.05).
    Raises ValueError on a count or pool it cannot run."""
    if passes is None and pools is None and keys is None and not targets_only:
        return plan
    changes: dict[str, Any] = {"custom": True}
    if keys is not None:
        if set(keys) - set(plan.overhead_keys) or not keys:
            raise ValueError(f"keys must be some of {', '.join(map(str, plan.overhead_keys))}, "
                             f"got {', '.join(map(str, keys)) or 'none'}")
        changes["overhead_keys"] = tuple(k for k in plan.overhead_keys if k in keys)
    if passes is not None:
        if not 1 <= passes <= MAX_PASSES:
            raise ValueError(f"passes must be 1 to {MAX_PASSES}, got {passes}")
        changes["overhead_passes"] = passes
    if pools is not None:
        unknown = sorted(set(pools) - set(OVERHEAD_POOLS))
        if unknown or not pools:
            raise ValueError(f"pools must be some of {', '.join(OVERHEAD_POOLS)}, "
                             f"got {', '.join(pools) or 'none'}")
        # solo has passes of its own (solo_passes), not a place among the main pools
        changes["overhead_pools"] = tuple(p for p in OVERHEAD_POOLS
                                          if p != "solo" and p in pools)
        if "solo" not in pools:
            changes["solo_passes"] = 0
        elif passes is not None:
            changes["solo_passes"] = passes
    if targets_only:
        changes.update(others=False, raised_hold_keys=0)
    return replace(plan, **changes)


def make_plan(quick: bool) -> Plan:
    if quick:
        return Plan(quick=True, overhead_tasks=300, overhead_cap=4.0,
                    overhead_pools=("threads",), overhead_keys=(1,), overhead_passes=1,
                    solo_passes=0, raised_hold_keys=0,
                    works=(1.0, 0.01),
                    limits=(20,),
                    busy_seconds={1.0: 3.0, 0.1: 1.5, 0.01: 1.5},
                    contention_variants=("plain", "diy", "leases", "leases_fast"),
                    latency_variants=("plain", "diy", "leases", "leases_fast", "grants_fast"),
                    latency_samples=15, scale_keys=500, scale_seconds=2.0,
                    fleet_passes=1)
    return Plan(quick=False, overhead_tasks=2000, overhead_cap=12.0,
                # 100 ms tasks get the 1 s tasks' 20 s: in 4 s (two rounds) a key's
                # first rounds decided the cell, and leases showed 0.96-0.99 at limit 20
                # where 20 s windows gave 0.81-0.97 (probes, 2026-12-01).
                busy_seconds={1.0: 20.0, 0.1: 20.0, 0.01: 3.0})
