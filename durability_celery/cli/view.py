# How the CLI draws things with rich: the usage table, the live view of busy
# keys (one panel per key: the demo's accounts, or `top`'s busiest keys of a
# running deployment) and the demo's verdict. Rule: rendering only; every
# number shown comes from a Snapshot or Verdict built elsewhere (the demo's
# ledger, or the workers' inspect replies and the holder's usage).
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ..core.usage import Usage


def _group_name(group: str | None) -> str:
    return "(no group)" if group is None else group


def _limit_caption(found: Usage) -> str | None:
    """Why the live limit is unknown: rounds admit nothing for the key meanwhile."""
    if found.limit_error is None:
        return None
    shown = "the limit shown is the last round's" if found.limit is not None else "no limit known"
    return (f"limit_resolution_error: {found.limit_error}; rounds admit nothing new for "
            f"this key until it resolves ({shown})")


def usage_table(found: Usage) -> Table:
    """`durability-celery usage`: the key's budget, per group, and blocked demand."""
    limit = "?" if found.limit is None else str(found.limit)
    table = Table(
        title=f"{found.semaphore} / {found.key}: {found.in_use} in use of {limit} "
        f"({found.grants} grants, {found.leases} leases)",
        title_justify="left",
        caption=_limit_caption(found), caption_justify="left",
    )
    for column in ("group", "outstanding", "lease footprint", "group limit", "blocked"):
        table.add_column(column, justify="left" if column in ("group", "blocked") else "right")
    blocked = {b.group: f"{b.reason} ({b.queued} queued)" for b in found.blocked}
    groups = {g.group: g for g in found.groups}
    for group in sorted({*groups, *blocked}, key=lambda g: (g is not None, g or "")):
        usage = groups.get(group)
        table.add_row(
            _group_name(group),
            str(usage.outstanding) if usage else "0",
            str(usage.lease_footprint) if usage else "0",
            "-" if usage is None or usage.limit is None else str(usage.limit),
            blocked.get(group, ""),
        )
    table.add_row("total", str(found.outstanding), str(found.lease_footprint),
                  limit, "", style="bold")
    return table


@dataclass
class GroupView:
    group: str | None
    running: int
    ceiling: int | None
    blocked: str | None
    held: int | None = None
    """Tasks of the group held by the workers' gates (`top`; the demo does not count them)."""


@dataclass
class AccountView:
    """One key in the live view: the demo ledger's or the workers' numbers, and the
    holder's. `done`, `total` and `peak` only the demo's ledger knows."""

    account: str
    limit: int | None
    running: int
    queued: int
    done: int | None = None
    total: int | None = None
    peak: int | None = None
    in_use: int | None = None
    leases: int = 0
    lease_footprint: int = 0
    groups: list[GroupView] = field(default_factory=list)


@dataclass
class Snapshot:
    title: str
    elapsed: float
    done: int | None
    total: int | None
    accounts: list[AccountView]
    group_label: str = "workflow"
    queued_label: str = "queued"
    footer: str | None = None
    """Shown instead of the progress bar when there is no total (`top`)."""


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _account_table(view: AccountView, snapshot: Snapshot) -> Table:
    limit = view.limit if view.limit is not None else 0
    over = "red bold" if view.limit is not None and view.running > view.limit else "green"
    table = Table(show_header=True, header_style="dim", expand=True, box=None)
    held = any(group.held is not None for group in view.groups)
    columns = [snapshot.group_label, "running", *(["held"] if held else []), "ceiling",
               "blocked"]
    for column in columns:
        table.add_column(column, justify="left" if column in (columns[0], "blocked")
                         else "right")
    for group in view.groups:
        table.add_row(
            _group_name(group.group), str(group.running),
            *([_count(group.held)] if held else []),
            "-" if group.ceiling is None else str(group.ceiling),
            Text(group.blocked or "", style="yellow"),
        )
    peak: list[tuple[str, str]] = [] if view.peak is None else [
        ("  peak ", "dim"), (str(view.peak), "red bold" if view.peak > limit else "bold")]
    done: list[tuple[str, str]] = [] if view.done is None else [
        ("  done ", "dim"), (f"{view.done}/{_count(view.total)}", "bold")]
    header = Text.assemble(
        ("running ", "dim"), (f"{view.running}/{_count(view.limit)}", over), *peak,
        (f"  {snapshot.queued_label} ", "dim"), (str(view.queued), "bold"),
        ("\nholder: in use ", "dim"), (_count(view.in_use), "bold"),
        ("  leases ", "dim"), (f"{view.leases} ({view.lease_footprint} permits)", "bold"),
        *done,
    )
    bar = ProgressBar(total=max(limit, 1), completed=min(view.running, limit), width=30)
    outer = Table.grid()
    outer.add_row(header)
    outer.add_row(bar)
    outer.add_row(table)
    return outer


def live_view(snapshot: Snapshot) -> RenderableType:
    """One frame: a panel per key, then the demo run's progress (or the footer)."""
    panels = [
        Panel(_account_table(view, snapshot), title=Text.assemble(
            (view.account, "bold"), f" limit {_count(view.limit)}"), title_align="left")
        for view in snapshot.accounts
    ]
    if snapshot.done is None or snapshot.total is None:
        footer = Text(snapshot.footer or "", style="dim")
        return Group(Text(snapshot.title, style="bold cyan"), *panels, footer)
    progress = Table.grid(padding=(0, 1))
    progress.add_row(
        Text(f"{snapshot.done}/{snapshot.total} tasks", style="bold"),
        ProgressBar(total=max(snapshot.total, 1), completed=snapshot.done, width=50),
        Text(f"{snapshot.elapsed:5.1f}s", style="dim"),
    )
    return Group(Text(snapshot.title, style="bold cyan"), *panels, progress)


def headless_line(snapshot: Snapshot) -> str:
    """One plain line per tick for --headless."""
    parts = [f"[{snapshot.elapsed:5.1f}s] done {snapshot.done}/{snapshot.total}"]
    for view in snapshot.accounts:
        blocked = ",".join(sorted({g.blocked for g in view.groups if g.blocked}))
        parts.append(
            f"{view.account} run {view.running}/{view.limit} q {view.queued}"
            + (f" blocked:{blocked}" if blocked else "")
        )
    return " | ".join(parts)


@dataclass
class Check:
    what: str
    peak: int
    limit: int

    @property
    def ok(self) -> bool:
        return self.peak <= self.limit


def verdict_table(checks: Sequence[Check], *, published: int, run: int, lost: int,
                  duplicates: int, passed: bool) -> RenderableType:
    table = Table(title="Verdict (from the independent ledger)", title_justify="left")
    for column in ("budget", "peak concurrency", "limit", "ok"):
        table.add_column(column, justify="left" if column == "budget" else "right")
    for check in checks:
        table.add_row(check.what, str(check.peak), str(check.limit),
                      Text("yes", style="green") if check.ok else Text("NO", style="red bold"))
    summary = Text.assemble(
        f"tasks published {published}, run {run}, lost {lost}, run twice {duplicates}\n",
        ("PASSED: no budget was exceeded and no task was lost" if passed
         else "FAILED", "bold green" if passed else "bold red"),
    )
    return Group(table, summary)
