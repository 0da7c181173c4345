"""Across workers: the same N children on 1, 2 and 4 worker processes, and on two "hosts".

Each configuration gets a fresh cluster with the same total number of threads (N + 16,
split evenly), a warm-up job that reaches every worker, then one job of N children x T
turns at ``--latency`` (as in the scaling part). The two "hosts" are two worker processes,
each in its own UTS namespace (``unshare --uts``: ``socket.gethostname()`` differs, as on
two machines) with its own ``SWARM_HOME``, sharing only the Redis; where namespaces are not
allowed they differ only by Celery hostname (the JSON says which).

Speed-up is against the 1-worker wall; scaling efficiency = speed-up / workers (at most
the number of CPUs over the number of workers on one machine).
"""

from __future__ import annotations

import argparse
import collections
import math
import time
from typing import Any

from bench.common import Cluster, WorkerSpec, fmt_ms, log, model_server
from bench.scaling import cluster_pids, measure_job, model_processes
from swarm.store.connection import connect
from swarm.store.ledger import Ledger


def specs_for(config: str, n: int) -> list[WorkerSpec]:
    if config == "hosts":
        per = math.ceil((n + 16) / 2)
        return [WorkerSpec(per, uts_host="bench-host-a"), WorkerSpec(per, uts_host="bench-host-b")]
    workers = int(config)
    return [WorkerSpec(math.ceil((n + 16) / workers)) for _ in range(workers)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, turns, latency = args.workers_n, args.turns, args.latency
    configs = [c.strip() for c in args.workers_configs.split(",") if c.strip()]
    began = time.perf_counter()
    rows = []
    with model_server(latency, model_processes(args)) as model:
        for config in configs:
            specs = specs_for(config, n)
            with Cluster(specs) as cluster:
                client = connect(cluster.url)
                pids = cluster_pids(cluster, client, model)
                measure_job(cluster, model, 2 * len(specs) + 1, 1, 0.05, 64, pids)
                job = measure_job(cluster, model, n, turns, latency, max(64, n), pids)
                ledger = Ledger(client)
                swarm_id = ledger.latest_swarm() or ""
                hosts = collections.Counter((a.host or "?") for a in ledger.agents(swarm_id)
                                            if a.kind == "child")
                client.close()
                job.update(config=config, workers=len(specs),
                           threads_per_worker=specs[0].concurrency,
                           hosts=dict(hosts), uts_namespaces=cluster.uts,
                           worker_cpu=[job["cpu_seconds"][f"worker{i}"]
                                       for i in range(len(specs))])
            rows.append(job)
            log(f"workers: {config}: wall {job['wall']:.2f} s, children per host {dict(hosts)}")
    base = next((r["wall"] for r in rows if r["config"] == "1"), None)
    for r in rows:
        r["speedup_vs_1"] = base / r["wall"] if base else None
        r["scaling_efficiency"] = base / r["wall"] / r["workers"] if base else None
    return {"benchmark": "workers",
            "config": {"n": n, "turns": turns, "latency": latency, "configs": configs,
                       "threads_total": n + 16},
            "rows": rows, "run_seconds": time.perf_counter() - began}


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    lines = [f"5. across workers: N={cfg['n']} children x T={cfg['turns']} turns, latency "
             f"{cfg['latency']:g} s, {cfg['threads_total']} threads in all; ideal "
             f"{(cfg['turns'] + 3) * cfg['latency']:g} s",
             "  workers        | wall s | wall/ideal | effic. | speed-up vs 1 | scaling eff. | "
             "spawn p95 ms | turn gap p95 ms | CPU s per worker"]
    for r in out["rows"]:
        label = (f"2 hosts ({'UTS' if r['uts_namespaces'] else 'names only'})"
                 if r["config"] == "hosts" else f"{r['workers']} x {r['threads_per_worker']}")
        speed = "-" if r["speedup_vs_1"] is None else f"{r['speedup_vs_1']:.2f}"
        eff = "-" if r["scaling_efficiency"] is None else f"{r['scaling_efficiency']:.0%}"
        lines.append(f"  {label:<14} | {r['wall']:>6.2f} | {r['ratio']:>10.2f} | "
                     f"{r['efficiency']:>5.0%} | {speed:>13} | {eff:>12} | "
                     f"{fmt_ms(r['spawn']['p95']):>12} | {fmt_ms(r['turn_gap']['p95']):>15} | "
                     + " ".join(f"{c:.1f}" for c in r["worker_cpu"]))
    hosts = next((r for r in out["rows"] if r["config"] == "hosts"), None)
    if hosts:
        lines.append(f"  children per host (ledger): {hosts['hosts']}")
    return lines
