# `durability-celery demo`: a holder, two client workers and beat as child
# processes, a mixed workload for three accounts with different limits and a
# per-account ceiling on the `export` workflow, a live view, and a verdict
# computed from an independent ledger (the tasks' own start/end events), never
# from the holder's tables. Rule: every child is stopped on every way out.
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import ConfigurationError
from ..store import create_engine
from . import ledger
from .children import Children
from .view import AccountView, Check, GroupView, Snapshot, headless_line, live_view, verdict_table

ACCOUNTS = {"acme": 4, "globex": 2, "initech": 3}
"""Each account's limit: the most tasks it may run at once across all workers."""
ACCOUNT_WEIGHTS = {"acme": 0.4, "globex": 0.25, "initech": 0.35}
GROUP_CEILINGS = {"export": 1}
"""A workflow's ceiling inside each account (group_limit)."""
WORKFLOWS = {"sync": 0.5, "export": 0.25, None: 0.25}


@dataclass(frozen=True)
class Job:
    account: str
    workflow: str | None
    seconds: float


@dataclass
class DemoRun:
    """Names and paths of one demo run (unique, so runs never share state)."""

    home: Path
    run_id: str
    database_url: str
    broker_url: str | None
    leases: bool = True

    @property
    def semaphore(self) -> str:
        return f"demo_{self.run_id}"

    @property
    def prefix(self) -> str:
        return f"demo-{self.run_id}"

    @property
    def task_queue(self) -> str:
        return f"{self.prefix}.tasks"

    @property
    def ledger(self) -> Path:
        return self.home / "ledger.jsonl"

    def env(self) -> dict[str, str]:
        semaphores = {self.semaphore: {
            "limit": 1, "keys": ACCOUNTS, "groups": GROUP_CEILINGS,
            "round_wait": 0.1, "round_period": 0.5, "grant_timeout": 5,
            "leases": {"permits_per_lease": 2, "ttl": 60} if self.leases else None,
        }}
        env = {
            "DURABILITY_HOME": str(self.home),
            "DURABILITY_DATABASE_URL": self.database_url,
            "DURABILITY_SEMAPHORES": json.dumps(semaphores),
            "DURABILITY_IMPORTS": "durability_celery.cli.demo_tasks",
            "DURABILITY_QUEUE_PREFIX": self.prefix,
            "DURABILITY_SHARDS": "2",
            "DURABILITY_RECLAIM_INTERVAL": "5",
            "DURABILITY_DEMO_SEMAPHORE": self.semaphore,
            "DURABILITY_DEMO_LEDGER": str(self.ledger),
        }
        if self.broker_url:
            env["DURABILITY_BROKER_URL"] = self.broker_url
        return env

    def flags(self) -> dict[str, str]:
        """The flag that set each variable, to name it when its value is refused."""
        flags = {"DURABILITY_DATABASE_URL": "--database"}
        return {**flags, "DURABILITY_BROKER_URL": "--broker"} if self.broker_url else flags


def task_seconds(spec: str) -> tuple[float, float]:
    """`--task-seconds`: "MIN-MAX" or one number."""
    low, _, high = spec.partition("-")
    try:
        bounds = (float(low), float(high or low))
    except ValueError:
        raise ConfigurationError(f"--task-seconds must be MIN-MAX, got {spec!r}") from None
    if not 0 <= bounds[0] <= bounds[1] <= 600:
        raise ConfigurationError(f"--task-seconds must be within 0-600, got {spec!r}")
    return bounds


def workload(count: int, *, seconds: tuple[float, float] = (1.0, 3.0),
             seed: int = 7) -> list[Job]:
    """A reproducible mix of accounts, workflows and durations."""
    rng = random.Random(seed)
    accounts = rng.choices(list(ACCOUNT_WEIGHTS), weights=list(ACCOUNT_WEIGHTS.values()), k=count)
    flows = rng.choices(list(WORKFLOWS), weights=list(WORKFLOWS.values()), k=count)
    return [Job(a, w, round(rng.uniform(*seconds), 2)) for a, w in zip(accounts, flows,
                                                                             strict=True)]


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(args: argparse.Namespace) -> int:
    if args.tasks < 1 or args.tasks > 10_000:
        raise ConfigurationError("--tasks must be between 1 and 10000")
    seconds = task_seconds(args.task_seconds)
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="durability-demo-"))
    home.mkdir(parents=True, exist_ok=True)
    run = DemoRun(home=home.resolve(), run_id=secrets.token_hex(3),
                  database_url=args.database or f"sqlite:///{home.resolve() / 'demo.db'}",
                  broker_url=args.broker, leases=not args.no_leases)
    os.environ.update(run.env())  # this process publishes through the same worker_config
    app, sem = _prepare(run)
    (home / "logs").mkdir(exist_ok=True)
    children = Children(home / "logs", dict(os.environ))
    with _sigterm_as_interrupt():
        try:
            _start_children(children, run)
            jobs = workload(args.tasks, seconds=seconds)
            published = _publish(app, run, jobs)
            _watch(args, run, sem, children, published)
            # Celery's warm shutdown takes seconds per worker: say why nothing moves.
            print("stopping the client workers, then the holder and beat ...", flush=True)
        finally:
            children.stop_all()
    return _report(args, run, published)


def _prepare(run: DemoRun) -> tuple[Any, Any]:
    """Build the app, create the schema, and check the broker answers (before any child)."""
    import worker_config
    from worker_config.env import EnvError, load_config

    try:
        load_config(os.environ)
    except EnvError as exc:
        flag = run.flags().get(exc.variable)
        raise (ConfigurationError(f"{flag}: {exc.problem}") if flag else exc) from None
    create_engine(run.database_url, setting="--database").dispose()
    app = worker_config.app
    sem = worker_config.durability.semaphore(run.semaphore)
    # The broker first: a demo that cannot run leaves no schema behind.
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=5)
    except Exception as exc:
        raise ConfigurationError(f"broker unreachable ({run.broker_url}): {exc}") from None
    sem.migrate()
    return app, sem


def _start_children(children: Children, run: DemoRun) -> None:
    # Started together: the atomic filesystem transport (durability_celery.transport) makes the
    # simultaneous first start safe (kombu's own races on exchange files).
    common = ["--loglevel=INFO", "--without-mingle", "--without-gossip"]
    started = [children.start("holder", [
        "worker", "--durability-holder", "-Q", f"{run.prefix}.holder.control",
        "-n", f"holder-{run.run_id}@%h", "--pool=threads", "--concurrency=1", *common],
        stage=1)]
    started += [
        children.start(f"client-{i}", [
            "worker", "-Q", run.task_queue, "-n", f"client{i}-{run.run_id}@%h",
            "--pool=threads", "--concurrency=6", *common])
        for i in (1, 2)
    ]
    for child in started:
        child.wait_ready(r"\bready\.", timeout=60)
    children.start("beat", ["beat", "--loglevel=INFO"], stage=1).wait_ready(
        r"beat: Starting", timeout=60)


def _publish(app: Any, run: DemoRun, jobs: list[Job]) -> dict[str, Job]:
    from .demo_tasks import work

    published: dict[str, Job] = {}
    for job in jobs:
        result = work.apply_async((job.account, job.workflow, job.seconds), queue=run.task_queue)
        published[result.id] = job
    return published


def snapshot(run: DemoRun, sem: Any, published: dict[str, Job], started_at: float) -> Snapshot:
    tally = ledger.tally(ledger.read(run.ledger))
    per_account = Counter(job.account for job in published.values())
    views = []
    for account, limit in ACCOUNTS.items():
        found = sem.usage(account)
        blocked = {b.group: b.reason for b in found.blocked}
        groups = [
            GroupView(flow, tally.running_group.get((account, flow), 0),
                      GROUP_CEILINGS.get(flow) if flow else None, blocked.get(flow))
            for flow in WORKFLOWS
        ]
        views.append(AccountView(
            account=account, limit=limit, running=tally.running.get(account, 0),
            queued=per_account[account] - tally.started.get(account, 0),
            done=tally.finished.get(account, 0), total=per_account[account],
            peak=tally.peak.get(account, 0), in_use=found.in_use, leases=found.leases,
            lease_footprint=found.lease_footprint, groups=groups,
        ))
    done = len(tally.finished_ids & published.keys())
    return Snapshot(title=f"durability-celery demo: semaphore {run.semaphore} "
                    f"(2 client workers x 6 threads, 1 holder, beat)",
                    elapsed=time.monotonic() - started_at, done=done,
                    total=len(published), accounts=views)


def _watch(args: argparse.Namespace, run: DemoRun, sem: Any, children: Children,
           published: dict[str, Job]) -> None:
    started_at = time.monotonic()
    deadline = started_at + args.timeout
    svg = getattr(args, "snapshot_svg", None)
    if args.headless:
        last_line = 0.0
        while True:
            snap = snapshot(run, sem, published, started_at)
            if time.monotonic() - last_line >= 2 or snap.done == snap.total:
                print(headless_line(snap), flush=True)
                last_line = time.monotonic()
            if snap.done == snap.total or time.monotonic() > deadline:
                return
            children.check_alive()
            time.sleep(0.5)
    from rich.live import Live

    with Live(refresh_per_second=4, transient=False) as live:
        while True:
            snap = snapshot(run, sem, published, started_at)
            live.update(live_view(snap))
            if svg and (snap.done or 0) >= (snap.total or 0) // 3:
                _save_svg(snap, Path(svg))
                svg = None
            if snap.done == snap.total or time.monotonic() > deadline:
                return
            children.check_alive()
            time.sleep(0.25)


def _save_svg(snap: Snapshot, path: Path) -> None:
    """One frame of the live view as SVG (docs/demo.png is made from it)."""
    from rich.console import Console

    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=100, file=sink)
        console.print(live_view(snap))
    svg = console.export_svg(title="durability-celery demo")
    # Renderers other than browsers drop the non-breaking spaces at span edges
    # unless whitespace is preserved explicitly.
    path.write_text(svg.replace("<svg ", '<svg xml:space="preserve" ', 1))


def verdict(run: DemoRun, published: dict[str, Job]) -> dict[str, Any]:
    """Peak concurrency per account and per (account, capped workflow), tasks run and lost."""
    tally = ledger.tally(ledger.read(run.ledger))
    checks = [Check(f"account {a}", tally.peak.get(a, 0), limit) for a, limit in ACCOUNTS.items()]
    for account in ACCOUNTS:
        for flow, ceiling in GROUP_CEILINGS.items():
            peak = tally.peak_group.get((account, flow), 0)
            checks.append(Check(f"account {account} / workflow {flow}", peak, ceiling))
    run_ids = tally.finished_ids & published.keys()
    lost = len(published) - len(run_ids)
    duplicates = len(tally.duplicates)
    passed = all(c.ok for c in checks) and lost == 0 and duplicates == 0
    return {"checks": checks, "published": len(published), "run": len(run_ids),
            "lost": lost, "duplicates": duplicates, "passed": passed}


def _report(args: argparse.Namespace, run: DemoRun, published: dict[str, Job]) -> int:
    result = verdict(run, published)
    if args.json:
        out = dict(result, checks=[
            {"budget": c.what, "peak": c.peak, "limit": c.limit, "ok": c.ok}
            for c in result["checks"]])
        print(json.dumps(out, indent=2))
    elif args.headless:
        for c in result["checks"]:
            print(f"{c.what}: peak {c.peak} / limit {c.limit} {'ok' if c.ok else 'EXCEEDED'}")
        print(f"tasks published {result['published']}, run {result['run']}, "
              f"lost {result['lost']}, run twice {result['duplicates']}")
        print("VERDICT: " + ("PASSED" if result["passed"] else "FAILED"))
    else:
        from rich.console import Console

        Console().print(verdict_table(
            result["checks"], published=result["published"], run=result["run"],
            lost=result["lost"], duplicates=result["duplicates"], passed=result["passed"]))
    print(f"demo files and logs: {run.home}", flush=True)
    return 0 if result["passed"] else 2
