"""Scaling: N children each doing T turns (one shell command per turn), against the ideal.

One warm cluster (embedded server, a coordinator, ``--workers`` worker processes x
``--concurrency`` threads) serves every N; the root runs in this process (``swarm run
--workers 0``). Each model answer takes ``--latency`` seconds. A job is::

    root   : 1 call -> N agent calls              ... 1 call -> final answer
    child i: T calls each running one command (echo), then 1 call answering

so the ideal wall time, when nothing queues, is ``(T + 3) x latency`` (root 2 calls, child
T + 1 calls), whatever N; the children's part (root's fan-out answer sent -> root's next
request) ideally takes ``(T + 1) x latency``. Efficiency = ideal / wall.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from bench.common import (
    CLK_TCK,
    Cluster,
    JobScript,
    WorkerSpec,
    analyse,
    busy_seconds,
    fmt_ms,
    log,
    machine_info,
    median,
    model_server,
    new_tag,
    p95,
    redis_info,
    run_root,
)
from bench.spawn import cpu_seconds
from swarm.store.connection import connect


def reaped_cpu_seconds(pid: int) -> float:
    """CPU seconds of the children ``pid`` has waited for (cutime + cstime): a worker's
    command processes (its boxes: bubblewrap, slirp4netns, the shells)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / CLK_TCK


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    out = {name: cpu_seconds(pid) for name, pid in pids.items()}
    out.update({f"{name} commands": reaped_cpu_seconds(pid) for name, pid in pids.items()
                if name.startswith("worker")})
    return out


def kind_of(name: str) -> str:
    """The kind of process a CPU figure is of: root, coordinator, workers, worker commands,
    Redis, model."""
    if name.startswith("worker"):
        return "worker commands" if name.endswith("commands") else "workers"
    return name.split("#")[0]


def measure_job(cluster: Cluster, model: Any, n: int, turns: int, latency: float,
                max_parallel: int, pids: dict[str, int]) -> dict[str, Any]:
    """One job of N children on a running cluster, with its timings, CPU and Redis commands."""
    client = connect(cluster.url)
    try:
        script = JobScript(new_tag(), n, turns)
        model.latency = latency
        before, cpu_before, busy = redis_info(client), cpu_of(pids), busy_seconds()
        invoked = time.perf_counter()
        run = run_root(cluster, model, script, max_parallel=max_parallel)
        after, cpu_after, busy = redis_info(client), cpu_of(pids), busy_seconds() - busy
    finally:
        client.close()
    times = analyse(script, run, invoked)
    ideal = (turns + 3) * latency
    phase_ideal = (turns + 1) * latency
    cpu = {k: round(cpu_after[k] - cpu_before[k], 2) for k in cpu_before}
    by_kind: dict[str, float] = {}
    for k, v in cpu.items():
        by_kind[kind_of(k)] = by_kind.get(kind_of(k), 0.0) + v
    # What the machine spent beyond the processes counted: with the sandbox, mostly the
    # boxes' own processes (their runners, bubblewrap), which no worker reaps; then the
    # kernel's threads and any other work.
    by_kind["rest of the machine"] = max(0.0, busy - sum(cpu.values()))
    return {
        "n": n, "turns": turns, "latency": latency, "wall": run.wall, "ideal": ideal,
        "ratio": run.wall / ideal, "efficiency": ideal / run.wall,
        "overhead_s": run.wall - ideal,
        "phase": times.phase, "phase_ideal": phase_ideal, "phase_ratio": times.phase / phase_ideal,
        "spawn": {"median": median(times.spawn), "p95": p95(times.spawn),
                  "max": max(times.spawn)},
        "turn_gap": {"median": median(times.turn_gaps), "p95": p95(times.turn_gaps),
                     "max": max(times.turn_gaps)},
        "first_gap": {"median": median(times.first_gaps), "p95": p95(times.first_gaps),
                      "max": max(times.first_gaps)} if times.first_gaps else None,
        "fanin": times.fanin, "root_startup": times.startup,
        "models_requests": times.models_requests,
        "peak_concurrent_model_requests": times.peak_concurrent_requests,
        "cpu_seconds": cpu, "cpu_total": round(sum(cpu.values()), 2),
        "machine_cpu_seconds": round(busy, 2),
        "cpu_floor_s": round(busy / (os.cpu_count() or 1), 2),
        "cpu_ms_per_child": {k: round(v * 1000 / n, 2) for k, v in by_kind.items()},
        "redis_commands": after["commands"] - before["commands"],
        "redis_commandstats": {k: v - before["commandstats"].get(k, 0)
                               for k, v in sorted(after["commandstats"].items(),
                                                  key=lambda kv: -kv[1])
                               if v - before["commandstats"].get(k, 0) > 0},
    }


def median_job(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median wall time (the lower middle of an even count), with every run's
    wall time beside it: one job on a shared 2-core machine is noisy."""
    ordered = sorted(runs, key=lambda r: r["wall"])
    job = dict(ordered[(len(ordered) - 1) // 2])
    job["walls"] = [r["wall"] for r in runs]
    return job


def cluster_pids(cluster: Cluster, client: Any, model: Any = None) -> dict[str, int]:
    model_pids = getattr(model, "pids", [])
    pids = {"root" if model_pids else "root + model": os.getpid(),
            "Redis": int(client.info("server")["process_id"]),
            "coordinator": cluster.procs["coordinator"].pid}
    pids.update({f"worker{i}": pid for i, pid in enumerate(cluster.worker_pids)})
    pids.update({f"model#{i}": pid for i, pid in enumerate(model_pids)})
    return pids


def model_processes(args: argparse.Namespace) -> int:
    """``--model-processes``: -1 (auto) is a quarter of the cores, 1 to 4."""
    if args.model_processes >= 0:
        return int(args.model_processes)
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes: list[int] = args.sizes
    specs = [WorkerSpec(args.concurrency) for _ in range(args.workers)]
    began = time.perf_counter()
    jobs = []
    procs = model_processes(args)
    with model_server(args.latency, procs) as model, Cluster(specs) as cluster:
        client = connect(cluster.url)
        pids = cluster_pids(cluster, client, model)
        machine = machine_info(client)
        client.close()
        log(f"scaling: cluster of {args.workers} x {args.concurrency} ready in "
            f"{time.perf_counter() - began:.1f} s")
        warm = measure_job(cluster, model, min(args.warm_up, max(sizes)), 1, 0.05,
                           max(64, args.warm_up), pids)
        log(f"scaling: warm-up N={warm['n']} {warm['wall']:.2f} s")
        for n in sizes:
            max_parallel = args.max_parallel or max(64, n)
            runs = []
            for _ in range(max(1, args.repeats) if n <= args.repeat_max else 1):
                run_ = measure_job(cluster, model, n, args.turns, args.latency, max_parallel,
                                   pids)
                runs.append(run_)
                log(f"scaling: N={n} wall {run_['wall']:.2f} s (ideal {run_['ideal']:.1f}), "
                    f"spawn p95 {fmt_ms(run_['spawn']['p95'])} ms, CPU "
                    f"{run_['cpu_total']:.1f} s")
            job = median_job(runs)
            job["max_parallel"] = max_parallel
            jobs.append(job)
    return {"benchmark": "scaling", "machine": machine,
            "config": {"sizes": sizes, "turns": args.turns, "latency": args.latency,
                       "workers": args.workers, "concurrency": args.concurrency,
                       "max_parallel": args.max_parallel or "max(64, N)",
                       "repeats": args.repeats, "repeat_max": args.repeat_max,
                       "model_processes": procs, "warm_up": args.warm_up,
                       "child": f"{args.turns} turns of one command (echo) + 1 answer",
                       "ideal": "(turns + 3) x latency: root 2 calls + child turns + 1"},
            "jobs": jobs, "run_seconds": time.perf_counter() - began}


def runs_range(job: dict[str, Any]) -> str:
    walls = job.get("walls") or [job["wall"]]
    return f"{min(walls):.2f}-{max(walls):.2f}" if len(walls) > 1 else "1 run"


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    lines = [f"2. scaling: {cfg['workers']} worker process(es) x {cfg['concurrency']} threads, "
             f"T={cfg['turns']} command turns + 1 answer per child, model latency "
             f"{cfg['latency']:g} s, max_parallel {cfg['max_parallel']}; ideal = (T+3) x latency"
             f"; the model in {cfg.get('model_processes', 0) or 'the bench'} process(es) "
             f"{'of its own' if cfg.get('model_processes') else ''}",
             f"  each N up to {cfg.get('repeat_max', 0)}: the job of median wall time of "
             f"{cfg.get('repeats', 1)}, the range of all under 'runs'; larger N: one job",
             "     N | wall s | runs s      | ideal | wall/ideal | effic. | children s (ideal) "
             "| spawn ms med   p95   max | turn gap ms med  p95 | fan-in ms | CPU s | "
             "Redis cmds/child"]
    for j in out["jobs"]:
        lines.append(
            f"  {j['n']:>4} | {j['wall']:>6.2f} | {runs_range(j):<11} | {j['ideal']:>5.1f} | "
            f"{j['ratio']:>10.2f} | "
            f"{j['efficiency']:>5.0%} | {j['phase']:>9.2f} ({j['phase_ideal']:.1f}) | "
            f"{fmt_ms(j['spawn']['median']):>12} {fmt_ms(j['spawn']['p95']):>5} "
            f"{fmt_ms(j['spawn']['max']):>5} | {fmt_ms(j['turn_gap']['median']):>15} "
            f"{fmt_ms(j['turn_gap']['p95']):>4} | {fmt_ms(j['fanin']):>9} | "
            f"{j['cpu_total']:>5.1f} | {j['redis_commands'] / j['n']:>6.0f}")
    if out["jobs"]:
        big = out["jobs"][-1]
        lines.append(f"  CPU seconds at N={big['n']}: " + ", ".join(
            f"{k} {v:.1f}" for k, v in big["cpu_seconds"].items())
            + (f"; the whole machine {big['machine_cpu_seconds']:.1f} (/proc/stat)"
               if "machine_cpu_seconds" in big else ""))
        lines.append("  the whole machine's CPU over its cores, the least wall it allows (x "
                     "ideal): " + "; ".join(
                         f"N={j['n']}: {j['cpu_floor_s']:.2f} s "
                         f"({j['cpu_floor_s'] / j['ideal']:.2f}x)"
                         for j in out["jobs"] if "cpu_floor_s" in j))
        lines.append("  the turn gap after a child's first answer (its first command, and its "
                     "box's start), median / p95 / max ms: " + "; ".join(
                         f"N={j['n']}: " + " / ".join(fmt_ms(j['first_gap'][k]).strip()
                                                      for k in ("median", "p95", "max"))
                         for j in out["jobs"] if j.get("first_gap")))
        lines.append("  CPU ms a child, by kind of process: " + "; ".join(
            f"N={j['n']}: " + ", ".join(f"{k} {v:.1f}" for k, v in j["cpu_ms_per_child"].items())
            for j in out["jobs"] if "cpu_ms_per_child" in j))
        if big.get("redis_commandstats"):
            lines.append(f"  Redis commands a child at N={big['n']} (INFO commandstats, scripts' "
                         "own calls included): " + ", ".join(
                             f"{k} {v / big['n']:.1f}"
                             for k, v in big["redis_commandstats"].items()))
    return lines
