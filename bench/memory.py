"""Resident memory per concurrent child in one worker process (threads pool), and what each
child's box costs outside it.

For each N: a fresh cluster with ONE worker process of N + 16 threads, its commands run as
``python -m bench --sandbox`` says (default ``auto``: in bubblewrap, as a deployment runs
them); a warm-up job; the worker's RSS at rest (baseline); then a job of N children whose one
command waits at a gate in its own workspace (``mkfifo gate.I && exec cat gate.I``), so all
N are alive at once. The gate is a FIFO: ``cat`` blocks opening it until the benchmark opens
it for writing through ``/proc/PID/cwd`` of that ``cat``, which reaches the workspace as the
box sees it (a box sees none of the benchmark's files, and the benchmark none of a box's
private mounts). Once N ``cat`` processes run under the worker, the worker's RSS is
sampled for a second (``/proc``), with its thread count and every process under it (the
boxes: bubblewrap, its network helper, the command), RSS and PSS summed by name; then the
gates are opened and the job finishes. Per child = (RSS with N alive - baseline) / N.

The part fails (an exception: ``python -m bench`` exits 1 and says FAILED) when the N
children do not all reach their gate within :data:`READY_TIMEOUT`: a figure over fewer
children than N would not be per child.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import threading
import time
from collections import defaultdict
from typing import Any

from bench.common import (
    Cluster,
    JobScript,
    WorkerSpec,
    log,
    model_server,
    new_tag,
    pss_kb,
    rss_kb,
    run_root,
    status,
    tree,
)
from bench.spawn import _kept_env

READY_TIMEOUT = 120.0
GATE = re.compile(rb"^cat\0gate\.(\d+)\0$")
COMMAND = "mkfifo gate.{i} && exec cat gate.{i}"


def gates(worker: int) -> dict[int, int]:
    """Child index -> pid of its ``cat gate.I`` under the worker."""
    out: dict[int, int] = {}
    for pid in tree(worker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                match = GATE.match(f.read())
        except OSError:
            continue
        if match:
            out[int(match.group(1))] = pid
    return out


def open_gate(pid: int, i: int) -> bool:
    """Let child ``i``'s ``cat`` go: open its FIFO for writing and close it (EOF). False
    when it has not opened its end yet (try again)."""
    try:
        fd = os.open(f"/proc/{pid}/cwd/gate.{i}", os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        return e.errno not in (errno.ENXIO,)  # ENXIO: no reader yet; gone: nothing to open
    try:
        os.write(fd, b"go\n")
    finally:
        os.close(fd)
    return True


def box_processes(worker: int) -> dict[str, dict[str, float]]:
    """Every process under the worker, RSS and PSS (KiB) summed by name."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"procs": 0, "rss_kb": 0, "pss_kb": 0})
    for pid in tree(worker):
        if pid == worker:
            continue
        name = str(status(pid).get("Name", "?"))
        row = out[name]
        row["procs"] += 1
        row["rss_kb"] += rss_kb(pid)
        row["pss_kb"] += pss_kb(pid)
    return dict(out)


def watch(worker: int, n: int, done: threading.Event, out: dict[str, Any]) -> None:
    """Wait until N children are at their gate, sample, then open every gate (a thread)
    until the job is over."""
    deadline = time.monotonic() + READY_TIMEOUT
    peak, seen = 0, {}
    while time.monotonic() < deadline and not done.is_set():
        peak = max(peak, rss_kb(worker))
        seen = gates(worker)
        if len(seen) >= n:
            break
        time.sleep(0.2)
    out["ready_after_s"] = time.monotonic() - out["t0"]
    out["alive"] = len(seen)
    if seen:
        samples, threads = [], 0
        for _ in range(10):
            samples.append(rss_kb(worker))
            threads = max(threads, int(status(worker).get("Threads", 0)))
            time.sleep(0.1)
        out.update(rss_alive_kb=max(samples), threads=threads, peak_before_alive_kb=peak,
                   processes=box_processes(worker))
    opened: set[int] = set()  # by pid: a command run again waits at its gate again
    while not done.is_set():
        for i, pid in gates(worker).items():
            if pid not in opened and open_gate(pid, i):
                opened.add(pid)
        done.wait(0.1 if len(opened) < n else 1.0)  # all let go: only a straggler is left


def measure(n: int, latency: float) -> dict[str, Any]:
    with model_server(latency) as model, Cluster([WorkerSpec(n + 16)]) as cluster:
        worker = cluster.worker_pids[0]
        warm = JobScript(new_tag(), 3, 1)
        run_root(cluster, model, warm, max_parallel=64)
        time.sleep(1.0)
        rest = []
        for _ in range(5):
            rest.append(rss_kb(worker))
            time.sleep(0.1)
        baseline = min(rest)
        base_threads = int(status(worker).get("Threads", 0))
        script = JobScript(new_tag(), n, 1, command=COMMAND)
        out: dict[str, Any] = {"t0": time.monotonic()}
        done = threading.Event()
        watcher = threading.Thread(target=watch, args=(worker, n, done, out), daemon=True)
        watcher.start()
        try:
            run = run_root(cluster, model, script, max_parallel=max(64, n),
                           timeout=READY_TIMEOUT + 120)
        finally:
            done.set()
            watcher.join(timeout=10)
        after = rss_kb(worker)
    alive = out.get("alive", 0)
    if alive < n:
        raise RuntimeError(
            f"memory: {alive} of {n} children were alive at once, at their gate, after "
            f"{out.get('ready_after_s', 0):.0f} s (the job ended, or {READY_TIMEOUT:.0f} s "
            f"passed; SWARM_SANDBOX={_kept_env.get('SWARM_SANDBOX', '')}): no figure per "
            f"child. Each runs `{COMMAND}` in its workspace: see what the command said in "
            "the job's sessions (`swarm logs`), and the worker's log")
    procs = out.get("processes", {})
    grown = out["rss_alive_kb"] - baseline
    return {"n": n, "worker_threads_configured": n + 16, "alive_at_once": alive,
            "all_alive_after_s": out.get("ready_after_s"), "job_wall": run.wall,
            "baseline_rss_mib": baseline / 1024, "rss_alive_mib": out["rss_alive_kb"] / 1024,
            "rss_after_job_mib": after / 1024, "per_child_kib": grown / alive,
            "threads_baseline": base_threads, "threads_alive": out.get("threads", 0),
            "command_processes": sum(int(r["procs"]) for r in procs.values()),
            "command_rss_per_child_kib": sum(r["rss_kb"] for r in procs.values()) / alive,
            "command_pss_per_child_kib": sum(r["pss_kb"] for r in procs.values()) / alive,
            "box_own_pss_per_child_kib": sum(r["pss_kb"] for k, r in procs.items()
                                             if k != "cat") / alive,
            "box_own_rss_per_child_kib": sum(r["rss_kb"] for k, r in procs.items()
                                             if k != "cat") / alive,
            "processes_by_name": {k: {"procs": v["procs"], "rss_per_child_kib": v["rss_kb"] / alive,
                                      "pss_per_child_kib": v["pss_kb"] / alive}
                                  for k, v in sorted(procs.items())}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    rows = []
    for n in args.memory_sizes:
        row = measure(n, 0.1)
        rows.append(row)
        log(f"memory: N={n}: {row['alive_at_once']} alive, worker {row['baseline_rss_mib']:.0f}"
            f" -> {row['rss_alive_mib']:.0f} MiB, {row['per_child_kib']:.0f} KiB per child; "
            f"outside it {row['command_processes']} processes, "
            f"{row['command_pss_per_child_kib']:.0f} KiB PSS per child "
            f"({row['box_own_pss_per_child_kib']:.0f} without the command's `cat`)")
    return {"benchmark": "memory",
            "config": {"sizes": args.memory_sizes, "pool": "threads",
                       "sandbox": _kept_env.get("SWARM_SANDBOX", ""),
                       "child": f"1 command that waits at a FIFO until all N are alive: {COMMAND}"},
            "rows": rows, "run_seconds": time.perf_counter() - began}


def report(out: dict[str, Any]) -> list[str]:
    lines = ["4. memory per concurrent child, one worker process (threads pool, N+16 threads), "
             f"all N children alive at once (each blocked in its command), SWARM_SANDBOX="
             f"{out['config'].get('sandbox', '?')}",
             "     N | alive | worker RSS MiB at rest -> N alive | per child KiB | threads "
             "rest -> alive | processes outside the worker, RSS / PSS per child KiB"]
    for r in out["rows"]:
        lines.append(f"  {r['n']:>4} | {r['alive_at_once']:>5} | {r['baseline_rss_mib']:>14.0f}"
                     f" -> {r['rss_alive_mib']:>7.0f} | {r['per_child_kib']:>13.0f} | "
                     f"{r['threads_baseline']:>7} -> {r['threads_alive']:>5} | "
                     f"{r['command_processes']:>5}, {r['command_rss_per_child_kib']:.0f} / "
                     f"{r.get('command_pss_per_child_kib', 0):.0f}")
        if "box_own_pss_per_child_kib" in r:
            lines.append(f"         what runs the command (all but its `cat`): RSS "
                         f"{r['box_own_rss_per_child_kib']:.0f} / PSS "
                         f"{r['box_own_pss_per_child_kib']:.0f} KiB per child")
        for name, v in r.get("processes_by_name", {}).items():
            lines.append(f"         {name:<16} {v['procs']:>5} processes, RSS "
                         f"{v['rss_per_child_kib']:>6.0f} / PSS {v['pss_per_child_kib']:>6.0f}"
                         " KiB per child")
    return lines
