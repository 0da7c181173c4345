"""Seeding again: two fan-outs from the same repository, the second after a one-file edit.

The repository of ``seed`` (``--seed-files`` files, ``--seed-mb`` MB), N children
(``--seed-n``) over two worker "hosts" (UTS namespaces, each its own ``SWARM_HOME``), one
command each. Runs, in order: a warm-up job (empty children), the first seeded fan-out
(the hosts hold no snapshot of the repository), the second seeded fan-out after one file
was edited (one line appended), and an empty fan-out (``seed: false``) to compare with.

Reported for each: wall, the snapshot stored (bytes put into Redis by the root; its base:
what it is a delta over), the bytes each host fetched for it (the snapshots of its chain
it lacked), and the child's first model request after the fan-out (min / median / max).
The target: the second fan-out moves < 1 MB for the 50 MB repository and its children ask
the model as early as empty ones.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

from bench.common import (
    Cluster,
    JobScript,
    WorkerSpec,
    analyse,
    log,
    model_server,
    new_tag,
    run_root,
)
from bench.seed import _spread, make_repo
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.snapshots import SnapshotStore


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, latency = args.seed_n, args.latency
    began = time.perf_counter()
    per = math.ceil((n + 16) / 2)
    specs = [WorkerSpec(per, uts_host="reseed-host-a"), WorkerSpec(per, uts_host="reseed-host-b")]
    jobs: list[dict[str, Any]] = []
    view = getattr(args, "seed_view", "auto")
    os.environ["SWARM_SEED_VIEW"] = view  # the workers' (started by the cluster)
    with model_server(latency) as model, Cluster(specs) as cluster:
        repo = cluster.home / "repo"
        files, size = make_repo(repo, args.seed_files, args.seed_mb)
        log(f"reseed: repository of {files} files, {size / 1e6:.1f} MB")
        client = connect(cluster.url)
        ledger, store = Ledger(client), SnapshotStore(client)
        warm = JobScript(new_tag(), 4, 1, command="true", seed=False)
        run_root(cluster, model, warm, max_parallel=64, workspace=repo)
        counted: dict[str, dict[str, int]] = {}  # what each snapshot's hosts had fetched
        edited = repo / "d000" / "f00000.txt"
        for label, seeded in (("first", True), ("edited", True), ("empty", False)):
            if label == "edited":
                with edited.open("a") as f:
                    f.write("one more line\n")
            script = JobScript(new_tag(), n, 1, command=args.seed_command, seed=seeded)
            done = run_root(cluster, model, script, max_parallel=max(64, n), workspace=repo,
                            timeout=900)
            times = analyse(script, done)
            swarm_id = ledger.latest_swarm() or ""
            children = [a for a in ledger.agents(swarm_id) if a.kind == "child"]
            seed = next((a.seed for a in children if a.seed and a.seed != "empty"), "")
            meta = store.meta(seed) if seed else None
            fetched: dict[str, int] = {}
            sid = seed
            while sid:  # what the hosts fetched of its chain during this job
                now = store.hosts(sid)
                before = counted.get(sid, {})
                for host, nbytes in now.items():
                    fetched[host] = fetched.get(host, 0) + nbytes - before.get(host, 0)
                counted[sid] = now
                link = store.meta(sid)
                sid = link.base if link is not None else ""
            job = {"job": label, "seeded": seeded, "wall": done.wall,
                   "spawn_s": _spread(times.spawn), "turn_gap_s": _spread(times.turn_gaps),
                   "snapshot_bytes": meta.size if meta else 0,
                   "snapshot_base": meta.base if meta else "",
                   "fetched_bytes_per_host": {h: b for h, b in fetched.items() if b},
                   "bytes_moved": (meta.size if meta else 0) + sum(fetched.values())}
            jobs.append(job)
            log(f"reseed: {label} N={n}: wall {done.wall:.2f} s, stored "
                f"{job['snapshot_bytes']} B, moved {job['bytes_moved']} B, first request "
                f"{job['spawn_s'][0]:.2f}-{job['spawn_s'][2]:.2f} s")
        client.close()
    return {"benchmark": "reseed",
            "config": {"n": n, "latency": latency, "files": files, "bytes": size, "view": view,
                       "command": args.seed_command, "hosts": 2, "threads_per_host": per,
                       "edited": str(edited.relative_to(repo))},
            "jobs": jobs, "run_seconds": time.perf_counter() - began}


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    lines = [f"8. seeding again: N={cfg['n']} children over 2 hosts from a repository of "
             f"{cfg['files']} files ({cfg['bytes'] / 1e6:.1f} MB), then again after a one-line "
             f"edit of {cfg['edited']}; latency {cfg['latency']:g} s, "
             f"SWARM_SEED_VIEW={cfg['view']}",
             "  job    | wall s | stored KB (delta?) | fetched KB per host       | moved KB | "
             "first request min / median / max s"]
    for j in out["jobs"]:
        fetched = ", ".join(f"{h}: {b / 1e3:.1f}" for h, b in sorted(
            j["fetched_bytes_per_host"].items())) or "-"
        stored = f"{j['snapshot_bytes'] / 1e3:.1f}" + (" (delta)" if j["snapshot_base"] else "")
        lines.append(f"  {j['job']:<6} | {j['wall']:>6.2f} | {stored:>18} | {fetched:<25} | "
                     f"{j['bytes_moved'] / 1e3:>8.1f} | "
                     "{:.2f} / {:.2f} / {:.2f}".format(*j["spawn_s"]))
    lines.append("  (target: the edited job moves < 1 MB for the 50 MB repository, and its "
                 "children ask the model as early as the empty job's)")
    return lines
