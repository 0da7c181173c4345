"""``python -m bench``: every benchmark of the swarm, tables on stdout, JSON in bench/results/.

Parts (``--only NAME[,NAME]``):

- ``spawn``     spawn overhead and fan-in against a bare Celery round trip (bench.spawn)
- ``scaling``   N children x T turns at a fixed model latency: wall against the ideal
- ``processes`` the same job as one ``swarm run`` process per child (EVA's berserk recipe)
                and as one sequential agent, beside the swarm: wall, peak memory, CPU
- ``memory``    resident memory per concurrent child in a worker (threads pool)
- ``workers``   the same N on 1, 2 and 4 worker processes, and on two "hosts"
- ``redis``     Redis commands and bytes per child and turn, memory per 1,000 children, TTLs
- ``mcp``       N children on one worker sharing one MCP server, beside one server per child
- ``cold``      the real ``swarm run`` command from process start to exit: cold on the
                embedded default and on a running deployment, phase by phase (bench.cold)
- ``seed``      children seeded with a ~50 MB repository over two "hosts", against empty
                children: added wall, bytes fetched per host, Redis peak memory
- ``reseed``    two fan-outs from that repository, the second after a one-file edit:
                bytes stored and fetched each time, each child's first model request
                (bench.reseed; sized by the ``seed`` options)
- ``land``      N children's edits of that repository landed in a dirty working tree:
                seconds in all and per child (bench.land)
- ``page``      the page of ``swarm serve`` in headless Chromium watching an N-agent swarm
                (default 500) live, then opening it settled: per-event cost, time to
                render (bench.page; needs /usr/bin/chromium and playwright)
- ``join``      a fan-out of ten where one child takes 10x longer: time to the parent's
                next model call with ``agent_join(any)`` against waiting for all (bench.join)

``--smoke`` runs a tiny size of each (about a minute; results go to ``*-smoke.json``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import RESULTS, busy_seconds, configure, log, results_dir, write_result

PARTS = ("spawn", "scaling", "processes", "memory", "workers", "redis", "mcp", "cold", "seed",
         "reseed", "land", "page", "join")
MODULES = {"workers": "across", "redis": "redis_cost"}


def ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmarks of swarm: real embedded Redis, coordinator and Celery workers; "
                    "the model is a scripted OpenAI-compatible server in this process with a "
                    "fixed latency per answer. Prints tables, writes bench/results/*.json and "
                    "a plot (bench/results/scaling.png, when matplotlib is installed: "
                    "pip install -e '.[bench]'). The full set takes about 10 minutes on 2 cores.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="parts: " + ", ".join(PARTS))
    p.add_argument("--smoke", action="store_true",
                   help="a tiny size of each part (about a minute), written to *-smoke.json")
    p.add_argument("--only", default="",
                   help="comma-separated parts to run (default: all): " + ",".join(PARTS))
    p.add_argument("--latency", type=float, default=1.0,
                   help="seconds per model answer for scaling, processes, workers (default 1)")
    p.add_argument("--turns", type=int, default=3,
                   help="command turns per child, T (default 3); each child makes T+1 calls")
    g = p.add_argument_group("spawn")
    g.add_argument("--spawn-sizes", type=ints, default=[1, 10, 100])
    g.add_argument("--spawn-repeats", type=int, default=5)
    g = p.add_argument_group("scaling")
    g.add_argument("--sizes", type=ints, default=[1, 10, 50, 200, 500],
                   help="numbers of children (default 1,10,50,200,500)")
    g.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    g.add_argument("--concurrency", type=int, default=256,
                   help="threads per worker process (default 256)")
    g.add_argument("--max-parallel", type=int, default=0,
                   help="SWARM_MAX_PARALLEL for the jobs (default max(64, N))")
    g.add_argument("--repeats", type=int, default=3,
                   help="jobs per N up to --repeat-max; the one of median wall is reported, "
                   "with the range (default 3)")
    g.add_argument("--repeat-max", type=int, default=200,
                   help="larger N run once (default 200)")
    g.add_argument("--warm-up", type=int, default=3, metavar="N",
                   help="children of the warm-up job before the measured ones (default 3); as "
                   "wide as the widest N, the boxes' network slots and cgroups, which a "
                   "worker keeps for a minute after a wide job, are made before the "
                   "measured jobs instead of in the first of them")
    g.add_argument("--model-processes", type=int, default=-1, metavar="K",
                   help="the scripted model in K processes of its own on one port "
                   "(SO_REUSEPORT), so a wide job measures the swarm and not this process; "
                   "0: in this process, beside the root (default: a quarter of the cores, "
                   "1 to 4)")
    g = p.add_argument_group("processes")
    g.add_argument("--processes-n", type=int, default=50,
                   help="children of the process-per-child comparison (default 50)")
    g.add_argument("--no-sequential", action="store_true",
                   help="skip the sequential agent (it takes N x T x latency seconds)")
    g = p.add_argument_group("memory")
    g.add_argument("--memory-sizes", type=ints, default=[100, 500])
    g = p.add_argument_group("workers")
    g.add_argument("--workers-n", type=int, default=200,
                   help="children for the across-workers runs (default 200)")
    g.add_argument("--workers-configs", default="1,2,4,hosts",
                   help="worker process counts to compare, and 'hosts' (default 1,2,4,hosts)")
    g = p.add_argument_group("redis")
    g.add_argument("--redis-n", type=int, default=200,
                   help="children of the Redis cost runs (default 200)")
    g.add_argument("--redis-trace", type=int, default=10, metavar="N",
                   help="then one job of N children (T = --turns, at --latency) under MONITOR: "
                   "where a child's commands go, by command and kind of key (0: off; "
                   "default 10)")
    g = p.add_argument_group("mcp")
    g.add_argument("--mcp-n", type=int, default=64,
                   help="children sharing one MCP server, and servers started one per child "
                   "(default 64)")
    g.add_argument("--mcp-turns", type=int, default=1,
                   help="MCP calls per child (default 1)")
    g = p.add_argument_group("cold")
    g.add_argument("--cold-repeats", type=int, default=5,
                   help="`swarm run` processes per row; medians are reported (default 5)")
    g.add_argument("--cold-sizes", type=ints, default=[1, 50, 200],
                   help="children of the cold jobs (default 1,50,200)")
    g.add_argument("--cold-workers", type=int, default=4,
                   help="--workers of the cold jobs with more than one child (default 4)")
    g.add_argument("--cold-ab", type=Path, default=None, metavar="SRC",
                   help="alternate every cold job with one of the swarm in source tree SRC "
                        "(e.g. `git worktree add /tmp/base HEAD~1`): an A/B in one run")
    g = p.add_argument_group("seed (and reseed)")
    g.add_argument("--seed-n", type=int, default=200,
                   help="children of the seeding jobs (default 200)")
    g.add_argument("--seed-files", type=int, default=5000,
                   help="files of the synthetic repository (default 5000)")
    g.add_argument("--seed-mb", type=float, default=50.0,
                   help="megabytes of the synthetic repository (default 50)")
    g.add_argument("--seed-repeats", type=int, default=2,
                   help="seeded and empty jobs, alternated (default 2 of each)")
    g.add_argument("--seed-command", default="ls | wc -l",
                   help="each child's one command (default: ls | wc -l; a coding agent's "
                        "would be like: git status --porcelain && date > mine.txt)")
    g.add_argument("--seed-view", choices=("auto", "checkout"), default="auto",
                   help="the workers' SWARM_SEED_VIEW (default auto: copy-on-write views "
                        "where they may mount)")
    g = p.add_argument_group("land")
    g.add_argument("--land-n", type=int, default=200,
                   help="children whose work lands (default 200)")
    g.add_argument("--land-files", type=int, default=5000,
                   help="files of the synthetic repository (default 5000)")
    g.add_argument("--land-mb", type=float, default=50.0,
                   help="megabytes of the synthetic repository (default 50)")
    g.add_argument("--land-repeats", type=int, default=3,
                   help="landings measured, each on a fresh dirty tree (default 3)")
    g = p.add_argument_group("page")
    g.add_argument("--page-n", type=int, default=500,
                   help="children of the swarm the page watches (default 500)")
    g.add_argument("--page-turns", type=int, default=2,
                   help="commands per child of that swarm (default 2)")
    g = p.add_argument_group("join")
    g.add_argument("--join-n", type=int, default=10,
                   help="children of the fan-out, one of them 10x slower (default 10)")
    g.add_argument("--join-delay", type=float, default=1.0,
                   help="seconds the fast children's model answers take (default 1)")
    g.add_argument("--join-repeats", type=int, default=3,
                   help="jobs of each way; the median is reported (default 3)")
    p.add_argument("--sandbox", choices=["auto", "bwrap", "none"], default="auto",
                   help="SWARM_SANDBOX of the workers (default auto, as a deployment runs; "
                        "none to compare with a swarm that had no sandbox)")
    p.add_argument("--no-seed", action="store_true",
                   help="children start in empty folders (seed: false) instead of from the "
                        "root's workspace, to compare with a swarm that had no seeding")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--results", type=Path, default=None,
                   help="directory for the JSON and PNG (default bench/results/)")
    return p


SMOKE = {"spawn_sizes": [1, 2], "spawn_repeats": 1, "sizes": [1, 4], "repeats": 2,
         "repeat_max": 1, "latency": 0.05,
         "turns": 2, "workers": 1, "concurrency": 16, "processes_n": 3, "memory_sizes": [5],
         "workers_n": 4, "workers_configs": "1,hosts", "redis_n": 4, "redis_trace": 2, "mcp_n": 3,
         "cold_repeats": 1, "cold_sizes": [1, 3], "cold_workers": 1, "seed_n": 4,
         "seed_files": 50, "seed_mb": 0.5, "seed_repeats": 1, "seed_view": "auto",
         "seed_command": "ls | wc -l", "land_n": 4, "land_files": 50, "land_mb": 0.5,
         "land_repeats": 1, "page_n": 3, "page_turns": 1, "join_n": 3, "join_delay": 0.1,
         "join_repeats": 1}


def display(path: Path) -> str:
    try:
        return str(path.relative_to(RESULTS.parent))
    except ValueError:
        return str(path)


def own_seconds() -> float:
    """CPU seconds of this process and every process it started and reaped."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def source_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=RESULTS.parent.parent, capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "modified": git("status", "--short", "swarm").splitlines()}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    only = [x.strip() for x in args.only.split(",") if x.strip()] or list(PARTS)
    unknown = [x for x in only if x not in PARTS]
    if unknown:
        parser().error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    configure(seed=not args.no_seed, sandbox=args.sandbox)
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        results_dir(args.results.resolve())
    began = time.perf_counter()
    results: dict[str, Any] = {}
    tables: list[str] = []
    failed = []
    for name in [p for p in PARTS if p in only]:
        started = time.perf_counter()
        busy, own = busy_seconds(), own_seconds()
        log(f"== {name} ...")
        try:
            module = importlib.import_module(f"bench.{MODULES.get(name, name)}")
            out = module.run(args)
            out["seconds"] = time.perf_counter() - started
            out["smoke"] = args.smoke
            out["source"] = source_state()
            out["load"] = {"machine_busy_cpu_s": busy_seconds() - busy,
                           "bench_cpu_s": own_seconds() - own,
                           "loadavg_after": os.getloadavg()}
            path = write_result(name, args.smoke, out)
            lines = module.report(out)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        results[name] = out
        load = out["load"]
        other = max(0.0, load["machine_busy_cpu_s"] - load["bench_cpu_s"])
        lines.append(f"  ({name}: {out['seconds']:.0f} s; {display(path)}; "
                     f"CPU {load['bench_cpu_s']:.0f} s by the bench, ~{other:.0f} s by other "
                     "processes on the machine)")
        print("\n" + "\n".join(lines), flush=True)
        tables.extend(["", *lines])
    if not args.no_plot and set(results) & {"scaling", "spawn", "processes", "workers"}:
        from bench.plot import plot

        drawn = plot(results, args.smoke)
        print(f"\nplot: {drawn}" if drawn else "\nplot: skipped (matplotlib not installed: "
              "pip install -e '.[bench]')", flush=True)
    total = time.perf_counter() - began
    print(f"\npython -m bench{' --smoke' if args.smoke else ''}: {total:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
