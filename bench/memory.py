"""Resident memory per concurrent child in one worker process (threads pool).

For each N: a fresh cluster with ONE worker process of N + 16 threads; a warm-up job; the
worker's RSS at rest (baseline); then a job of N children whose one command waits on a lock
the benchmark holds (``touch ready.I; flock -s gate true``), so all N are alive at once.
When every child has touched its file, the worker's RSS is sampled for a second (``/proc``),
with its thread count and the command processes under it; then the lock is released and
the job finishes. Per child = (RSS with N alive - baseline) / N. The command processes
(bash + flock, each child's shell command) live outside the worker and are shown apart.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Cluster,
    JobScript,
    WorkerSpec,
    log,
    model_server,
    new_tag,
    rss_kb,
    run_root,
    status,
    tree,
)

READY_TIMEOUT = 120.0


def watch(worker: int, ready_dir: Path, n: int, lock_fd: int, out: dict[str, Any]) -> None:
    """Wait until N children are in their command, sample, then let them go (a thread)."""
    deadline = time.monotonic() + READY_TIMEOUT
    peak = 0
    try:
        while time.monotonic() < deadline:
            peak = max(peak, rss_kb(worker))
            if sum(1 for _ in ready_dir.glob("ready.*")) >= n:
                break
            time.sleep(0.05)
        out["ready_after_s"] = time.monotonic() - out["t0"]
        out["alive"] = sum(1 for _ in ready_dir.glob("ready.*"))
        samples, threads, cmd_procs, cmd_rss = [], 0, 0, 0
        for _ in range(10):
            samples.append(rss_kb(worker))
            threads = max(threads, int(status(worker).get("Threads", 0)))
            time.sleep(0.1)
        below = [p for p in tree(worker) if p != worker]
        cmd_procs = len(below)
        cmd_rss = sum(rss_kb(p) for p in below)
        out.update(rss_alive_kb=max(samples), threads=threads, command_processes=cmd_procs,
                   command_rss_kb=cmd_rss, peak_before_alive_kb=peak)
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)


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
        ready = cluster.home / "gate-dir"
        ready.mkdir()
        gate = ready / "gate"
        fd = os.open(gate, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        script = JobScript(new_tag(), n, 1,
                           command=f"touch {ready}/ready.{{i}}; flock -s {gate} true")
        out: dict[str, Any] = {"t0": time.monotonic()}
        watcher = threading.Thread(target=watch, args=(worker, ready, n, fd, out), daemon=True)
        watcher.start()
        try:
            run = run_root(cluster, model, script, max_parallel=max(64, n))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            watcher.join(timeout=10)
            os.close(fd)
        after = rss_kb(worker)
    alive = out.get("alive", 0)
    grown = out.get("rss_alive_kb", 0) - baseline
    return {"n": n, "worker_threads_configured": n + 16, "alive_at_once": alive,
            "all_alive_after_s": out.get("ready_after_s"), "job_wall": run.wall,
            "baseline_rss_mib": baseline / 1024, "rss_alive_mib": out.get("rss_alive_kb", 0)
            / 1024, "rss_after_job_mib": after / 1024,
            "per_child_kib": grown / max(alive, 1),
            "threads_baseline": base_threads, "threads_alive": out.get("threads", 0),
            "command_processes": out.get("command_processes", 0),
            "command_rss_per_child_kib": out.get("command_rss_kb", 0) / max(alive, 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    rows = []
    for n in args.memory_sizes:
        row = measure(n, 0.1)
        rows.append(row)
        log(f"memory: N={n}: {row['alive_at_once']} alive, worker {row['baseline_rss_mib']:.0f}"
            f" -> {row['rss_alive_mib']:.0f} MiB, {row['per_child_kib']:.0f} KiB per child")
    return {"benchmark": "memory",
            "config": {"sizes": args.memory_sizes, "pool": "threads",
                       "child": "1 command that waits on a lock until all N are alive"},
            "rows": rows, "run_seconds": time.perf_counter() - began}


def report(out: dict[str, Any]) -> list[str]:
    lines = ["4. memory per concurrent child, one worker process (threads pool, N+16 threads), "
             "all N children alive at once (each blocked in its command)",
             "     N | alive | worker RSS MiB at rest -> N alive | per child KiB | threads "
             "rest -> alive | command procs, RSS per child KiB (outside the worker)"]
    for r in out["rows"]:
        lines.append(f"  {r['n']:>4} | {r['alive_at_once']:>5} | {r['baseline_rss_mib']:>14.0f}"
                     f" -> {r['rss_alive_mib']:>7.0f} | {r['per_child_kib']:>13.0f} | "
                     f"{r['threads_baseline']:>7} -> {r['threads_alive']:>5} | "
                     f"{r['command_processes']:>5}, {r['command_rss_per_child_kib']:.0f}")
    return lines
