"""``python -m bench.chaos``: a seeded fault campaign over simulated machines, checked from the
evidence afterwards.

The deployment (:class:`Deployment`): three worker hosts (:mod:`bench.hosts`: each its own
network namespace on a bridge, host name and ``SWARM_HOME`` disk; the third with its clock
30 s ahead under libfaketime), two coordinators and a Valkey server with its append-only
file on the "laptop", which also runs the root ``swarm run`` and the scripted model (on the
bridge's address). The job (:class:`Job`): the root calls P parents, each parent runs one
command, calls its children and parks; each child runs T commands and answers. Every
command sleeps a little, then sends ``J tag p c k time host`` to the journal's collector
in this process, which adds the pid of the worker that ran it and appends the line
(:mod:`bench.chaos_journal`, which says why a Unix socket: a partition must not cut the
evidence): evidence of each real execution.

``--sandbox auto`` runs the workers as a deployment's run by default: every command in
bubblewrap, as ``SWARM_SANDBOX_UID`` (65534) on these root workers, its own pid namespace
and ``/tmp``; ``none`` (the default) runs them unconfined. A box gets an allowlisted
environment, so libfaketime's preload stays out of it: on the host whose clock runs ahead
the worker's clock is ahead, its boxed commands' is not, and their lines are read so
(every line's own time is checked against when it arrived, :func:`chaos_evidence.clock_skewed`).

Faults (:func:`schedule`, from ``--seed``; they overlap): SIGKILL of a worker process every
few seconds (restarted 1-3 s later; its commands are not killed: a process crash, not a
machine's), SIGKILL of a coordinator (restarted), SIGKILL of Valkey (restarted from its
append-only file), a worker host's link down for longer than ``SWARM_LEASE`` (then up),
bursts of 429/500 answers from the model. Then :mod:`bench.chaos_evidence` checks the
invariants and this prints a table per fault kind, the seed and a verdict; the exit status
is 1 on a violation, 2 when the deployment cannot be made here (the reason is printed).

``--short``: a fixed seed, 20 children, each fault kind once, in about two minutes
(``tests/fault/test_chaos_short.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis as redis_lib

from bench import chaos_evidence as ev
from bench.chaos_deploy import (
    AHEAD,
    HOSTS,
    SECRET,
    SHORT_SEED,
    SKEWED,
    Deployment,
    Event,
    Injector,
    Plan,
    Unavailable,
    unavailable,
)
from swarm.store import keys
from swarm.store.ledger import Ledger
from swarm.testing.scripts import task_of, turn_of


def make_plan(args: argparse.Namespace) -> Plan:
    if args.short:
        return Plan(seed=args.seed if args.seed is not None else SHORT_SEED, minutes=1.0,
                    parents=4, per_parent=5, turns=3, concurrency=8, max_parallel=8,
                    worker_kill_every=8.0, long_sleep=0.3, short=True, sandbox=args.sandbox)
    children = max(args.children, 1)
    parents = max(1, round(math.sqrt(children / 2)))
    per = math.ceil(children / parents)
    parallel = 24
    # Enough turns that the job outlasts the faults: children x T x ~2.5 s / parallel.
    turns = max(2, math.ceil(args.minutes * 60 * parallel / (parents * per * 2.5)))
    return Plan(seed=args.seed if args.seed is not None else random.randrange(1 << 30),
                minutes=args.minutes, parents=parents, per_parent=per, turns=turns,
                concurrency=parallel, max_parallel=parallel, sandbox=args.sandbox)


def schedule(plan: Plan) -> list[Event]:
    """The faults, from the seed: each kind on its own clock, so they overlap."""
    rng = random.Random(plan.seed)
    span = plan.minutes * 60
    out: list[Event] = []
    if plan.short:  # each kind once, early, overlapping; the worker kills throughout
        out += [Event(2, "model 429/500", "", 4),
                Event(4, "partition", rng.choice(HOSTS[:2]), plan.lease * 2.2),
                Event(8, "coordinator kill", rng.choice("01"), 3),
                Event(12, "Redis kill", "", 2)]
    else:
        for kind, every, length in (
                ("coordinator kill", plan.coordinator_kill_every, (2.0, 5.0)),
                ("Redis kill", plan.redis_kill_every, (1.0, 3.0)),
                ("partition", plan.partition_every, (1.6 * plan.lease, 2.5 * plan.lease)),
                ("model 429/500", plan.burst_every, (2.0, 5.0))):
            at = rng.uniform(0.2, 0.6) * every
            while at < span:
                target = {"coordinator kill": rng.choice("01"),
                          "partition": rng.choice(HOSTS)}.get(kind, "")
                out.append(Event(at, kind, target, rng.uniform(*length)))
                at += rng.uniform(0.6, 1.4) * every
    at = rng.uniform(2, 4)
    while at < span:
        out.append(Event(at, "worker kill", rng.choice(HOSTS), rng.uniform(1, 3)))
        at += rng.uniform(0.5, 1.5) * plan.worker_kill_every
    return sorted(out)


# -- the campaign ----------------------------------------------------------------------------


def run(plan: Plan, keep: bool = False) -> dict[str, Any]:
    reason = unavailable()
    if reason:
        raise Unavailable(reason)
    base = Path(tempfile.mkdtemp(prefix="swarm-chaos-"))
    os.chmod(base, 0o755)
    dep = Deployment(plan, base)
    began = time.time()
    injector: Injector | None = None
    try:
        dep.start()
        dep.start_root()
        events = schedule(plan)
        injector = Injector(dep, events)
        skew = ev.Injected("clock ahead", dep.names[SKEWED], began, began)
        if dep.skew_reason:
            print(f"chaos: no clock ahead: {dep.skew_reason}", file=sys.stderr)
        injector.thread.start()
        assert dep.root is not None
        root = dep.root
        limit = plan.minutes * 60 + (120 if plan.short else 900)
        deadline = time.monotonic() + limit
        faults_until = time.time() + plan.minutes * 60
        while root.poll() is None and time.monotonic() < deadline and \
                time.time() < faults_until:
            time.sleep(0.5)
        injector.finish()
        while root.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        skew.end = time.time()
        code = root.poll()
        if code is None:
            root.kill()
            code = -9
        wall = time.time() - began
        faults = injector.faults if dep.skew_reason else [skew, *injector.faults]
        evidence = gather(dep, faults, code)
        evidence["no_clock_ahead"] = dep.skew_reason
    finally:
        dep.stop()
        dep.close()
    out = {"seed": plan.seed, "plan": asdict(plan), "wall": wall, "root_exit": code,
           "revived": injector.revived if injector else [],
           "base": str(base), **evidence}
    if keep or out["violations"]:
        print(f"chaos: evidence kept in {base}", file=sys.stderr)
    else:
        shutil.rmtree(base, ignore_errors=True)
    return out


def gather(dep: Deployment, faults: list[ev.Injected], code: int) -> dict[str, Any]:
    """The invariants checked from the evidence, and the table per fault kind."""
    plan, job = dep.plan, dep.job
    client = dep.client()
    swarm_id = Ledger(client).latest_swarm() or ""
    agent_ids = [str(a) for a in client.zrange(keys.swarm_agents(swarm_id), 0, -1)]
    agents = {a: client.hgetall(keys.agent(a)) for a in agent_ids}
    runs = {a: client.hgetall(keys.run(row["run"])) for a, row in agents.items() if row.get("run")}
    run_of: dict[str, str] = {a: row["run"] for a, row in agents.items() if row.get("run")}
    agent_of = {r: a for a, r in run_of.items()}
    by_task: dict[str, str] = {}
    index: dict[tuple[int, int], str] = {}
    for agent, row in runs.items():
        message = row.get("message", "")
        by_task[message] = run_of[agent]
        m = re.match(re.escape(job.tag) + r"-(?:P(\d+)|C(\d+)\.(\d+)):", message)
        if m and m.group(1) is not None:
            index[(int(m.group(1)), -1)] = run_of[agent]
        elif m:
            index[(int(m.group(2)), int(m.group(3)))] = run_of[agent]
    parent_of = {run_of[a]: run_of.get(row.get("parent", ""), "") for a, row in agents.items()
                 if a in run_of}
    events: Counter[str] = Counter()
    for _, fields in client.xrange(keys.events(swarm_id)):
        if fields.get("kind") == "settled":
            events[fields.get("agent", "")] += 1
    raw_sessions = {a: client.hget(keys.session(agents[a].get("session") or a), "messages")
                    for a in agent_ids}
    dump = _dump(client)
    client.close()

    aof = ev.aof_data(dep.redis_dir / "appendonlydir")
    timeline = ev.by_run(ev.fill_times(ev.marks(ev.resp_commands(aof), plan.lease)))
    # A box's environment has no libfaketime: only unconfined commands see host c's clock.
    skewed = not dep.skew_reason and plan.sandbox == "none"
    lines = ev.journal(dep.journal, {dep.names[SKEWED]: AHEAD} if skewed else {})
    requests = dep.model.requests
    violations: list[ev.Violation] = []
    expected_runs = [index.get((p, c), f"missing p{p} c{c}") for p in range(plan.parents)
                     for c in [-1, *range(plan.per_parent)]]
    violations += ev.settled_once(timeline, expected_runs, events, agent_of)
    violations += ev.zombies(lines, index, timeline, dep.lives)
    violations += ev.clock_skewed(lines)
    for p in range(plan.parents):
        task = job.parent_task(p)
        after = [r for r in requests if task_of(r) == task and turn_of(r) == 2]
        violations += ev.results_in_order(after, [job.child_answer(p, c)
                                                  for c in range(plan.per_parent)],
                                          f"parent p{p}", index.get((p, -1), ""))
    root_after = [r for r in requests if task_of(r) == job.root_task and turn_of(r) == 1]
    violations += ev.results_in_order(root_after, [job.parent_answer(p)
                                                   for p in range(plan.parents)], "the root")
    for agent in agent_ids:
        violations += ev.paired(agent, raw_sessions[agent])
    sources = {"Redis keys": dump, "the append-only file": aof,
               "the journal": dep.journal.read_bytes()}
    sources.update({f"logs/{p.name}": p.read_bytes() for p in dep.logs.iterdir() if p.is_file()})
    violations += ev.secrets_in(SECRET, sources)
    answer = (dep.logs / "root.out").read_text(errors="replace")
    if code != 0:
        violations.append(ev.Violation("root answer", f"the root exited {code}"))
    for p in range(plan.parents):
        for c in range(plan.per_parent):
            seen = len(re.findall(re.escape(job.child_answer(p, c)) + r"\b", answer))
            if seen != 1:
                violations.append(ev.Violation(
                    "root answer", f"{job.child_answer(p, c)!r} {seen} times in the answer",
                    index.get((p, c), "")))
    rows = ev.fault_rows(faults, timeline, job.log, by_task, violations, parent_of)
    executions = Counter((ln.parent, ln.child, ln.turn) for ln in lines)
    return {
        "faults": [asdict(f) for f in faults],
        "rows": [r.cells() for r in rows],
        "violations": [asdict(v) for v in violations],
        "invariants": dict(Counter(v.invariant for v in violations)),
        "children": plan.children, "parents": plan.parents,
        "journal_lines": len(lines),
        "lines_without_worker": sum(1 for ln in lines if not ln.pid),
        "sandbox": plan.sandbox,
        "commands_run_twice": sum(1 for n in executions.values() if n > 1),
        "claims": sum(1 for steps in timeline.values() for m in steps if m.kind == "claim"),
        "model_requests": len(job.log),
        "model_faults": sum(1 for _, _, s in job.log if s >= 400),
    }


def _dump(client: redis_lib.Redis) -> bytes:
    """Every value in Redis, as text (to look for the key in)."""
    parts: list[str] = []
    for key in client.scan_iter(count=500):
        kind = client.type(key)
        if kind == "string":
            parts.append(str(client.get(key)))
        elif kind == "hash":
            parts.append(json.dumps(client.hgetall(key)))
        elif kind == "list":
            parts.append(json.dumps(client.lrange(key, 0, -1)))
        elif kind == "set":
            parts.append(json.dumps(sorted(client.smembers(key))))
        elif kind == "zset":
            parts.append(json.dumps(client.zrange(key, 0, -1)))
        elif kind == "stream":
            parts.append(json.dumps(client.xrange(key)))
        parts.append(str(key))
    return "\n".join(parts).encode()


HEADER = ["fault", "injected", "children affected", "recovered", "recover median s",
          "recover max s", "violations"]


def report(out: dict[str, Any]) -> list[str]:
    rows = [HEADER, *out["rows"]]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(HEADER))]
    lines = [f"chaos: seed {out['seed']}, sandbox {out.get('sandbox', 'none')}, "
             f"{out['parents']} parents x "
             f"{out['children'] // max(out['parents'], 1)} children, faults for "
             f"{out['plan']['minutes']:g} min, wall {out['wall']:.0f} s, "
             f"{out['claims']} claims, {out['journal_lines']} journal lines "
             f"({out['commands_run_twice']} commands ran twice), "
             f"{out['model_requests']} model requests ({out['model_faults']} faults)"]
    for row in rows:
        lines.append("  " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    if out.get("lines_without_worker"):
        lines.append(f"  journal lines whose sender was gone before its worker was found: "
                     f"{out['lines_without_worker']}")
    if out.get("no_clock_ahead"):
        lines.append(f"  clock ahead: not injected: {out['no_clock_ahead']}")
    if out.get("revived"):
        lines.append(f"  restarted after exiting on their own: {', '.join(out['revived'])}")
    unattributed = sum(1 for v in out["violations"] if not v["run"])
    if unattributed:
        lines.append(f"  violations not tied to a run: {unattributed}")
    for v in out["violations"][:20]:
        lines.append(f"  ! {v['invariant']}: {v['text']}")
    count = len(out["violations"])
    kinds = ", ".join(f"{k} {n}" for k, n in out["invariants"].items())
    verdict = ("HELD: zero invariant violations" if not count else
               f"BROKEN: {count} violations ({kinds})")
    lines.append(f"verdict (seed {out['seed']}): {verdict}")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=None,
                   help=f"seed of the fault schedule and the job (default random; --short: "
                        f"{SHORT_SEED})")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="minutes of faults; the job runs until it is done (default 10)")
    p.add_argument("--children", type=int, default=200, help="children at depth 2 (default 200)")
    p.add_argument("--short", action="store_true",
                   help="the CI size: fixed seed, 20 children, each fault once, ~2 min")
    p.add_argument("--sandbox", choices=("none", "auto"), default="none",
                   help="the workers' SWARM_SANDBOX: none (commands unconfined, the default) "
                        "or auto (bubblewrap, as a deployment's workers run them)")
    p.add_argument("--keep", action="store_true", help="keep the evidence folder")
    p.add_argument("--json", type=Path, default=None, help="write the result here as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    plan = make_plan(args)
    try:
        out = run(plan, keep=args.keep)
    except Unavailable as exc:
        print(f"chaos: cannot run here: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print("\n".join(report(out)))
    return 1 if out["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
