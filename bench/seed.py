"""Seeding: children that start from their parent's files, on two "hosts".

A synthetic git repository (``--seed-files`` files of random text, ``--seed-mb`` MB in all,
committed and packed as a clone is, plus one uncommitted file per job so every seeded job
makes a new snapshot) is the root's workspace. N children fan out over two worker "hosts"
(UTS namespaces: their own host name and ``SWARM_HOME``, so each fetches the snapshot into
its own cache, as a second machine would) and each runs one command. Jobs alternate: seeded (the
default) and ``seed: false`` (empty folders), ``--seed-repeats`` of each.

Reported: wall of each kind (median), the difference (what seeding adds), the root's
snapshot (files, bytes of the bundle), the bytes each host fetched for it (the target is
once per host), and Redis ``used_memory`` at its peak during a seeded job over the
memory before it (sampled every 20 ms).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Cluster,
    JobScript,
    WorkerSpec,
    analyse,
    busy_seconds,
    log,
    median,
    model_server,
    new_tag,
    run_root,
)
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.snapshots import SnapshotStore


def make_repo(path: Path, files: int, megabytes: float) -> tuple[int, int]:
    """A committed repository of ``files`` files of random text (``megabytes`` in all),
    in folders of 100, packed as a clone is; returns (files, bytes)."""
    per = max(1, int(megabytes * 1_000_000 / files))
    path.mkdir(parents=True)
    total = 0
    for i in range(files):
        folder = path / f"d{i // 100:03d}"
        folder.mkdir(exist_ok=True)
        text = os.urandom(per // 2 + 1).hex()[:per]
        (folder / f"f{i:05d}.txt").write_text(text)
        total += len(text)
    subprocess.run("git init -q && git add -A && git -c user.name=b -c user.email=b@b "
                   "commit -qm synthetic && git repack -adq", shell=True, cwd=path, check=True)
    return files, total


class PeakMemory:
    """Redis ``used_memory`` sampled every 20 ms in a thread; ``peak`` over ``before``."""

    def __init__(self, url: str) -> None:
        self.client = connect(url)
        self.before = int(self.client.info("memory")["used_memory"])
        self.peak = self.before
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, int(self.client.info("memory")["used_memory"]))

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        self.client.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, latency = args.seed_n, args.latency
    began = time.perf_counter()
    per = math.ceil((n + 16) / 2)
    specs = [WorkerSpec(per, uts_host="seed-host-a"), WorkerSpec(per, uts_host="seed-host-b")]
    jobs: list[dict[str, Any]] = []
    view = getattr(args, "seed_view", "auto")
    os.environ["SWARM_SEED_VIEW"] = view  # the workers' (started by the cluster)
    with model_server(latency) as model, Cluster(specs) as cluster:
        repo = cluster.home / "repo"
        files, size = make_repo(repo, args.seed_files, args.seed_mb)
        log(f"seed: repository of {files} files, {size / 1e6:.1f} MB")
        client = connect(cluster.url)
        ledger, store = Ledger(client), SnapshotStore(client)
        # As wide as the jobs: the first wide job on a worker makes the network slots its
        # boxes borrow (~7 ms of CPU each: slirp4netns, unshare, ip, nsenter), kept for a
        # minute; left to the first job measured, they were 1.5 CPU s of "seeding".
        warm = JobScript(new_tag(), n, 1, command="true", seed=False)
        run_root(cluster, model, warm, max_parallel=max(64, n), workspace=repo, timeout=900)
        for k in range(args.seed_repeats):
            for seeded in (True, False):
                (repo / "uncommitted.txt").write_text(f"job {k} {seeded}\n")
                script = JobScript(new_tag(), n, 1, command=args.seed_command, seed=seeded)
                busy = busy_seconds()
                with PeakMemory(cluster.url) as memory:
                    done = run_root(cluster, model, script, max_parallel=max(64, n),
                                    workspace=repo, timeout=900)
                busy = busy_seconds() - busy
                times = analyse(script, done)
                swarm_id = ledger.latest_swarm() or ""
                children = [a for a in ledger.agents(swarm_id) if a.kind == "child"]
                seed = next((a.seed for a in children if a.seed), "")
                meta = store.meta(seed) if seed else None
                hosts = {h: b for h, b in store.hosts(seed).items()} if seed else {}
                per_host: dict[str, int] = {}
                for a in children:
                    per_host[a.host] = per_host.get(a.host, 0) + 1
                views = sum(1 for a in children if a.workspace and (
                    Path(a.workspace).parent / ".views" / a.id).is_dir())
                job = {"seeded": seeded, "wall": done.wall, "machine_cpu_s": busy,
                       "children_per_host": per_host,
                       "children_in_views": views,
                       # Where the time goes: fan-out answer -> each child's first request,
                       # its command's turn, and its last answer -> the root's next request.
                       "spawn_s": _spread(times.spawn), "turn_gap_s": _spread(times.turn_gaps),
                       "fanin_s": times.fanin,
                       "snapshot_bytes": meta.size if meta else 0,
                       "snapshot_files": meta.files if meta else 0,
                       "fetched_bytes_per_host": hosts,
                       "redis_used_memory_before": memory.before,
                       "redis_used_memory_peak": memory.peak}
                jobs.append(job)
                log(f"seed: {'seeded' if seeded else 'empty '} N={n}: wall {done.wall:.2f} s, "
                    f"fetched per host {hosts}, Redis peak +"
                    f"{(memory.peak - memory.before) / 1e6:.1f} MB")
        client.close()
    seeded_walls = [j["wall"] for j in jobs if j["seeded"]]
    empty_walls = [j["wall"] for j in jobs if not j["seeded"]]
    return {"benchmark": "seed",
            "config": {"n": n, "latency": latency, "files": files, "bytes": size, "view": view,
                       "command": args.seed_command,
                       "repeats": args.seed_repeats, "hosts": 2, "threads_per_host": per},
            "jobs": jobs, "wall_seeded_median": median(seeded_walls),
            "wall_empty_median": median(empty_walls),
            "added_seconds": (median(seeded_walls) or 0) - (median(empty_walls) or 0),
            "run_seconds": time.perf_counter() - began}


def _spread(values: list[float]) -> list[float]:
    """Min, median and max of ``values``."""
    return [min(values), median(values) or 0.0, max(values)] if values else [0.0, 0.0, 0.0]


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    lines = [f"7. seeding: N={cfg['n']} children over 2 hosts, a repository of {cfg['files']} "
             f"files ({cfg['bytes'] / 1e6:.1f} MB), one command each "
             f"({cfg.get('command', 'ls | wc -l')}), latency "
             f"{cfg['latency']:g} s, SWARM_SEED_VIEW={cfg.get('view', 'auto')}",
             "  job     | wall s | snapshot MB | fetched MB per host      | Redis peak +MB | "
             "children per host"]
    for j in out["jobs"]:
        fetched = ", ".join(f"{h}: {b / 1e6:.1f}" for h, b in sorted(
            j["fetched_bytes_per_host"].items())) or "-"
        lines.append(f"  {'seeded' if j['seeded'] else 'empty':<7} | {j['wall']:>6.2f} | "
                     f"{j['snapshot_bytes'] / 1e6:>11.1f} | {fetched:<24} | "
                     f"{(j['redis_used_memory_peak'] - j['redis_used_memory_before']) / 1e6:>14.1f}"
                     f" | {j['children_per_host']}"
                     + (f", {j['children_in_views']} in views" if j.get("children_in_views")
                        else ""))
        if "spawn_s" in j:
            lines.append("          | fan-out -> child's first request {:.2f} / {:.2f} / {:.2f} s, "
                         "command turn {:.2f} / {:.2f} / {:.2f} s (min / median / max), "
                         "last answer -> root {:.2f} s".format(
                             *j["spawn_s"], *j["turn_gap_s"], j["fanin_s"])
                         + (f"; the whole machine's CPU {j['machine_cpu_s']:.1f} s"
                            if "machine_cpu_s" in j else ""))
    lines.append(f"  median wall: seeded {out['wall_seeded_median']:.2f} s, empty "
                 f"{out['wall_empty_median']:.2f} s: seeding adds {out['added_seconds']:.2f} s "
                 "(target < 1 s; the snapshot moved once per host)")
    return lines
