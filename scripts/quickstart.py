"""Helper of scripts/quickstart: the README's Quickstart, run as written.

  extract README WORKDIR ...   writes WORKDIR/proj.py from the README's ```python block
                               under "## Quickstart" (only the broker URL, database URL,
                               limits and the task body substituted), WORKDIR/install.txt
                               (the pip install command of "## Try it") and
                               WORKDIR/commands.txt (the ```bash block under "## Quickstart",
                               one command a line, comments dropped).
  run ...                      (the venv's python, in WORKDIR) publishes the tasks, waits for
                               them to finish while the workers live, and checks the ledger:
                               every task ran exactly once, no key or group above its limit.

Standard library only, except `run`, which imports the generated proj.py (and so Celery
and redis from the venv the README's install command filled).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

LEDGER_KEY = "quickstart:ledger"
# The Quickstart's group (group_limit's workflow that has a ceiling), read from the README.
GROUP_RE = re.compile(r'workflow\s*==\s*"([^"]+)"')


def section(readme: str, title: str) -> str:
    """The text of `## title` up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if not match:
        sys.exit(f"README.md has no '## {title}' section")
    return match.group(1)


def fenced(text: str, lang: str, where: str) -> str:
    """The first ```lang block of `text`."""
    match = re.search(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)
    if not match:
        sys.exit(f"README.md: no ```{lang} block under '## {where}'")
    return match.group(1)


def sub_once(pattern: str, replacement: str, text: str, what: str) -> str:
    new, count = re.subn(pattern, replacement, text, flags=re.M)
    if count != 1:
        sys.exit(f"README.md Quickstart: expected exactly one {what} "
                 f"(/{pattern}/), found {count}; update scripts/quickstart.py with the README")
    return new


def make_proj(source: str, args: argparse.Namespace) -> str:
    proj = sub_once(r'\bbroker="[^"]*"', f'broker="{args.broker}"', source, "broker URL")
    proj = sub_once(r'\bdatabase="[^"]*"', f'database="{args.database}"', proj, "database URL")
    proj = sub_once(r"(\blimit=lambda [^:]+:\s*)\d+", rf"\g<1>{args.limit}", proj, "limit=")
    proj = sub_once(r"(\bgroup_limit=lambda [^:]+:\s*)\d+", rf"\g<1>{args.group_limit}",
                    proj, "group_limit=")
    # The task body `...` becomes: a start and an end entry in the ledger around a sleep.
    # Entries are RPUSHed, so the list's order is the order things happened in.
    body = (
        "import json, time\n"
        "import redis\n"
        f"ledger = redis.Redis.from_url({args.broker!r})\n"
        "entry = [export.request.id, account_id, workflow_id, export.request.hostname]\n"
        f"ledger.rpush({LEDGER_KEY!r}, json.dumps(['start', *entry]))\n"
        "try:\n"
        f"    time.sleep({args.seconds})\n"
        "finally:\n"
        f"    ledger.rpush({LEDGER_KEY!r}, json.dumps(['end', *entry]))\n"
    )

    def indent(match: re.Match[str]) -> str:
        pad = match.group(1)
        return "".join(pad + line + "\n" for line in body.splitlines())

    match = re.search(r"^def export\(.*?\).*:\n^(\s+)\.\.\.\n", proj, re.M)
    if not match:
        sys.exit("README.md Quickstart: no `def export(...):` with a `...` body")
    return proj[:match.start()] + re.sub(r"^(\s+)\.\.\.\n", indent, match.group(0),
                                         flags=re.M) + proj[match.end():]


def extract(args: argparse.Namespace) -> None:
    readme = Path(args.readme).read_text()
    workdir = Path(args.workdir)
    quick = section(readme, "Quickstart")
    source = fenced(quick, "python", "Quickstart")
    group = GROUP_RE.search(source)
    if not group:
        sys.exit("README.md Quickstart: group_limit names no workflow (workflow == \"...\")")
    (workdir / "proj.py").write_text(make_proj(source, args))
    (workdir / "group.txt").write_text(group.group(1) + "\n")

    commands = []
    for line in fenced(quick, "bash", "Quickstart").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(shlex.join(words))
    (workdir / "commands.txt").write_text("".join(c + "\n" for c in commands))

    try_it = fenced(section(readme, "Try it"), "bash", "Try it")
    installs = [part.strip() for line in try_it.splitlines()
                for part in line.split("#")[0].split("&&") if " pip install" in part]
    if len(installs) != 1:
        sys.exit(f"README.md Try it: expected one pip install command, found {installs}")
    (workdir / "install.txt").write_text(installs[0] + "\n")


def alive(pids: list[int]) -> list[int]:
    dead = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.append(pid)
    return dead


def run(args: argparse.Namespace) -> None:
    import redis

    sys.path.insert(0, os.getcwd())
    import proj

    ledger = redis.Redis.from_url(args.broker)
    keys = [f"acct-{i}" for i in range(1, args.keys + 1)]
    workflows = [args.group, None]
    published = {}
    for i in range(args.tasks):
        key, workflow = keys[i % len(keys)], workflows[(i // len(keys)) % 2]
        published[proj.export.delay(key, workflow).id] = (key, workflow)
    print(f"published {len(published)} tasks for {len(keys)} keys "
          f"(limit {args.limit} per key, {args.group_limit} in workflow {args.group!r})",
          flush=True)

    started = time.monotonic()
    ended = 0
    while True:
        entries = [json.loads(e) for e in ledger.lrange(LEDGER_KEY, 0, -1)]
        ended = sum(1 for e in entries if e[0] == "end")
        if ended >= len(published):
            break
        dead = alive(args.pids)
        if dead:
            fail(f"process(es) {dead} exited while {len(published) - ended} tasks were left")
        if time.monotonic() - started > args.timeout:
            fail(f"only {ended} of {len(published)} tasks ended within {args.timeout:.0f} s")
        time.sleep(0.5)
    took = time.monotonic() - started
    time.sleep(1)  # any late duplicate would show up now
    entries = [json.loads(e) for e in ledger.lrange(LEDGER_KEY, 0, -1)]
    check(entries, published, args, took)


def check(entries: list[list[str | None]], published: dict[str, tuple[str, str | None]],
          args: argparse.Namespace, took: float) -> None:
    problems = []
    starts = Counter(e[1] for e in entries if e[0] == "start")
    ends = Counter(e[1] for e in entries if e[0] == "end")
    for task_id in published:
        if starts[task_id] != 1 or ends[task_id] != 1:
            problems.append(f"task {task_id} {published[task_id]} started {starts[task_id]}x, "
                            f"ended {ends[task_id]}x (want exactly once)")
    unknown = set(starts) - published.keys()
    if unknown:
        problems.append(f"{len(unknown)} tasks ran that were not published: {sorted(unknown)}")

    running: Counter[tuple[str | None, ...]] = Counter()
    peak: Counter[tuple[str | None, ...]] = Counter()
    for event, _task_id, key, workflow, _worker in entries:
        for scope in ((key,), (key, workflow)):
            running[scope] += 1 if event == "start" else -1
            peak[scope] = max(peak[scope], running[scope])
    for key in sorted({k for k, _ in published.values()}):
        line = f"{key}: peak {peak[(key,)]} (limit {args.limit}), " \
               f"{args.group} peak {peak[(key, args.group)]} (limit {args.group_limit})"
        print(line, flush=True)
        if peak[(key,)] > args.limit:
            problems.append(f"{key} ran {peak[(key,)]} tasks at once, limit {args.limit}")
        if peak[(key, args.group)] > args.group_limit:
            problems.append(f"{key}/{args.group} ran {peak[(key, args.group)]} at once, "
                            f"limit {args.group_limit}")
        if peak[(key,)] < args.limit:
            problems.append(f"{key} never reached its limit {args.limit} (peak {peak[(key,)]}): "
                            "the limit did not bind, so the check proves nothing")
    # The point of the library: one budget across workers. Both must have run tasks.
    workers = Counter(e[4] for e in entries if e[0] == "start")
    print("tasks per worker: " + ", ".join(f"{w} {n}" for w, n in sorted(workers.items())),
          flush=True)
    if len(workers) < 2:
        problems.append(f"only {len(workers)} worker(s) ran tasks: the limits were not shared")
    if problems:
        fail("; ".join(problems))
    print(f"all {len(published)} tasks ran exactly once in {took:.1f} s, within their limits",
          flush=True)


FAIL_FILE: str | None = None


def fail(message: str) -> None:
    print(f"CHECK FAILED: {message}", file=sys.stderr, flush=True)
    if FAIL_FILE:
        Path(FAIL_FILE).write_text(message)
    sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("extract", "run"):
        p = sub.add_parser(name)
        p.add_argument("--broker", required=True)
        p.add_argument("--limit", type=int, required=True)
        p.add_argument("--group-limit", type=int, required=True)
    ex = sub.choices["extract"]
    ex.add_argument("readme")
    ex.add_argument("workdir")
    ex.add_argument("--database", required=True)
    ex.add_argument("--seconds", type=float, default=0.3)
    rn = sub.choices["run"]
    rn.add_argument("--group", required=True)
    rn.add_argument("--keys", type=int, default=2)
    rn.add_argument("--tasks", type=int, default=20)
    rn.add_argument("--timeout", type=float, default=90)
    rn.add_argument("--pids", type=int, nargs="*", default=[])
    rn.add_argument("--fail-file", help="where to write the failure, for the FAIL line")
    args = parser.parse_args()
    global FAIL_FILE
    FAIL_FILE = getattr(args, "fail_file", None)
    extract(args) if args.command == "extract" else run(args)


if __name__ == "__main__":
    main()
