"""Cold start: the real ``swarm`` command, from process start to exit, as a user runs it.

Each job is one ``swarm run --yes --new -C WORKSPACE 'fan out N: `echo hi`'`` process
(the console script next to this Python, else ``python -m swarm``), started from this
process against the scripted model in this process (``--latency`` s per answer, stamps on
every request). The scripted model's own "fan out N" form makes the root call ``agent`` N
times; each child runs the command and answers; the root sums up: 2 root calls + 2 child
calls, so the ideal wall time is 4 x latency whatever N.

- **cold**: the embedded default: nothing runs before the command (its Valkey server,
  coordinator and worker are its own, and stopped before the next job starts); the jobs
  of a row share one ``SWARM_HOME``, as a user's runs do, so the first job of a row
  is a first run ever there (its worst case is in the JSON);
- **warm deployment**: ``SWARM_REDIS_URL`` points at a coordinator and a worker that
  already run (a warm-up job first).

Phases, from the model server's stamps and this process's clock (one ``perf_counter``):

- process start -> first model request: ``Popen`` -> the root's first chat request arrived;
- ``agent`` call -> child's first model request: the root's fan-out answer written -> the
  first child's first request arrived (the last child's too, for N > 1);
- final answer -> process exit: the root's last answer written -> ``waitpid`` returned;
- wall: ``Popen`` -> exit; and how long the job's local processes outlived it (its
  ``SWARM_HOME``'s server is the last to stop).

Medians of ``--cold-repeats`` jobs per row; every job's figure is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Cluster, WorkerSpec, log, model_env, model_server, results_dir
from bench.spawn import Stamp, TimedModelServer, machine_info
from swarm.store.connection import connect
from swarm.store.server import EmbeddedServer

TIMEOUT = 180.0
COMMAND = "echo hi"
#: The figures of 2026-12-03 (issue 19), measured from the shell with stderr time-stamped:
#: (cold embedded default, deployment already running). The agent-call row then measured
#: "agent call shown -> spawn request dispatched".
ISSUE = {
    "start_to_first_request": ("0.8-1.0", "~0.9"),
    "agent_to_child": ("2.4-2.7*", "~0.55*"),
    "final_to_exit": ("~1.5", "~0.15"),
    "wall_1": ("8.6-9.1", "5.1-5.6"),
    "wall_50": ("12.4", ""),
    "wall_200": ("14.1", ""),
}
TARGETS = {
    "start_to_first_request": "<= 0.30",
    "agent_to_child": "ready at 1st answer; warm <= 0.05",
    "final_to_exit": "<= 0.20",
    "wall_1": "<= 5.0",
    "wall_50": "<= 5.5",
    "wall_200": "<= 6.0",
}
LABELS = {
    "start_to_first_request": "process start -> first model request",
    "agent_to_child": "`agent` call -> child's first model request",
    "final_to_exit": "final answer -> process exit",
    "wall_1": "one-child fan-out, wall",
    "wall_50": "50 children, wall",
    "wall_200": "200 children, wall",
}


def swarm_command() -> list[str]:
    """The installed ``swarm`` console script of this Python, else ``python -m swarm``."""
    script = Path(sys.executable).with_name("swarm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "swarm"]


def base_env(model: TimedModelServer, home: Path, n: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(model_env(model))
    env.update(SWARM_HOME=str(home), SWARM_MAX_PARALLEL=str(max(64, n)),
               SWARM_MAX_CHILDREN=str(max(200, n)))
    return env


def server_gone(home: Path, timeout: float = 20.0) -> float | None:
    """Seconds until the embedded server of ``home`` stopped (None: still running)."""
    began = time.perf_counter()
    server = EmbeddedServer(home)
    while time.perf_counter() - began < timeout:
        if not server.info_path.exists():
            return time.perf_counter() - began
        time.sleep(0.02)
    return None


def one_job(model: TimedModelServer, n: int, home: Path, *, latency: float,
            workers: int | None = None, url: str = "", src: Path | None = None
            ) -> dict[str, Any]:
    """One ``swarm run`` process; its phases in seconds. ``src``: run the swarm of that
    source tree (first on ``PYTHONPATH``; its local processes inherit it) instead."""
    workspace = Path(tempfile.mkdtemp(prefix="ws-", dir=home.parent))
    env = base_env(model, home, n)
    if url:
        env["SWARM_REDIS_URL"] = url
    if src is not None:
        env["PYTHONPATH"] = str(src)
    argv = [*swarm_command(), "run", "--yes", "--new", "-C", str(workspace),
            f"fan out {n}: `{COMMAND}`"]
    if workers is not None:
        argv += ["--workers", str(workers)]
    model.latency = latency
    model.take_stamps()
    loadavg = os.getloadavg()[0]
    with open(workspace.parent / f"{workspace.name}.out", "w+") as out, \
            open(workspace.parent / f"{workspace.name}.err", "w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        ended = time.perf_counter()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    stamps = model.take_stamps()
    lingered = None if url else server_gone(home)
    if code != 0 or f"{n} child" not in stdout:
        raise RuntimeError(f"cold: N={n} job failed (exit {code}):\n{stdout[-1500:]}\n"
                           f"{stderr[-3000:]}")
    return {"n": n, **phases(stamps, started, ended), "wall": ended - started,
            "ideal": 4 * latency, "lingered": lingered, "loadavg_before": loadavg}


def phases(stamps: list[Stamp], started: float, ended: float) -> dict[str, float]:
    chats = [s for s in stamps if s.kind == "chat"]
    root = {s.turn: s for s in chats if "fan out" in s.task}
    firsts = [s.arrived for s in chats if s.task.startswith("child ") and s.turn == 0]
    if 0 not in root or 1 not in root or not firsts:
        raise RuntimeError(f"cold: incomplete stamps ({len(chats)} chat requests)")
    return {"start_to_first_request": root[0].arrived - started,
            "agent_to_child": min(firsts) - root[0].sent,
            "agent_to_last_child": max(firsts) - root[0].sent,
            "final_to_exit": ended - root[1].sent}


def medians(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("start_to_first_request", "agent_to_child", "agent_to_last_child",
            "final_to_exit", "wall", "lingered")
    out: dict[str, Any] = {}
    for key in keys:
        values = [j[key] for j in jobs if j.get(key) is not None]
        out[key] = statistics.median(values) if values else None
        out[f"{key}_range"] = [min(values), max(values)] if values else None
    out["jobs"] = jobs
    return out


def cold_rows(model: TimedModelServer, base: Path, n: int, repeats: int, latency: float,
              workers: int | None, ab: Path | None = None
              ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``repeats`` cold jobs of N children (with ``ab``, alternated with as many of the
    swarm in that source tree): (this swarm's row, the other's or None)."""
    jobs: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    for r in range(repeats):
        for src, into, who in ((ab, other, "A/B base"), (None, jobs, "")):
            if who and src is None:
                continue
            # One SWARM_HOME per row, as a user's: nothing of it runs between the jobs
            # (each waits for the last one's server to stop), what it keeps on disk stays.
            home = base / f"cold-{n}{'-ab' if who else ''}" / "home"
            home.mkdir(parents=True, exist_ok=True)
            job = one_job(model, n, home, latency=latency, workers=workers, src=src)
            into.append(job)
            gone = job["lingered"]
            log(f"cold{' ' + who if who else ''}: N={n} job {r + 1}/{repeats}: wall "
                f"{job['wall']:.2f} s, start {job['start_to_first_request']:.3f}, "
                f"agent->child {job['agent_to_child']:.3f}, answer->exit "
                f"{job['final_to_exit']:.3f}, local processes gone "
                f"{'-' if gone is None else round(gone, 2)} s after")
    row = {"n": n, "workers": workers, **medians(jobs)}
    return row, ({"n": n, "workers": workers, **medians(other)} if ab else None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    latency = args.latency
    base = Path(tempfile.mkdtemp(prefix="swarm-bench-cold-"))
    rows: dict[str, Any] = {}
    try:
        with model_server(latency) as model:
            for n in sorted({1, *args.cold_sizes}):
                row, other = cold_rows(model, base, n, args.cold_repeats, latency,
                                       args.cold_workers if n > 1 else None, args.cold_ab)
                rows[f"cold_{n}"] = row
                if other is not None:
                    rows[f"ab_base_cold_{n}"] = other
            with Cluster([WorkerSpec(64)]) as cluster:
                client = connect(cluster.url)
                machine = machine_info(client)
                client.close()
                one_job(model, 1, cluster.home, latency=latency, url=cluster.url)  # warm-up
                jobs = []
                for r in range(args.cold_repeats):
                    job = one_job(model, 1, cluster.home, latency=latency, url=cluster.url)
                    jobs.append(job)
                    log(f"cold: warm deployment job {r + 1}/{args.cold_repeats}: wall "
                        f"{job['wall']:.2f} s, start {job['start_to_first_request']:.3f}, "
                        f"agent->child {job['agent_to_child']:.3f}, answer->exit "
                        f"{job['final_to_exit']:.3f}")
                rows["warm_1"] = {"n": 1, **medians(jobs)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"benchmark": "cold", "machine": machine,
            "config": {"latency": latency, "repeats": args.cold_repeats,
                       "sizes": sorted({1, *args.cold_sizes}),
                       "workers_for_n_over_1": args.cold_workers,
                       "command": " ".join(swarm_command())
                       + " run --yes --new -C WS 'fan out N: `echo hi`'",
                       "max_parallel": "max(64, N)", "ideal": "4 x latency",
                       "ab_base": str(args.cold_ab) if args.cold_ab else "",
                       "units": "seconds"},
            "rows": rows, "issue_2026_12_03": ISSUE,
            "run_seconds": time.perf_counter() - began}


def figures(out: dict[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    """(cold, warm) medians of each row of the table."""
    rows = out["rows"]
    cold, warm = rows.get("cold_1", {}), rows.get("warm_1", {})
    table = {key: (cold.get(key), warm.get(key)) for key in
             ("start_to_first_request", "agent_to_child", "final_to_exit")}
    table["wall_1"] = (cold.get("wall"), warm.get("wall"))
    for n in (50, 200):
        table[f"wall_{n}"] = (rows.get(f"cold_{n}", {}).get("wall"), None)
    return table


def baseline(path: Path | None = None) -> dict[str, Any] | None:
    """The figures measured before the cold-start work (``cold-before.json``), if kept."""
    path = path or results_dir() / "cold-before.json"
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    lat = cfg["latency"]
    before = baseline()
    old = figures(before) if before else {}

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    head = (f"7. cold start: the real `swarm run --yes --new`, model latency {lat:g} s, ideal "
            f"{4 * lat:g} s (root, child x2, root); median of {cfg['repeats']} jobs, seconds; "
            f"N > 1 with --workers {cfg['workers_for_n_over_1']}, max_parallel max(64, N)")
    cols = "  phase                                        | 12-03 cold | "
    if before:
        cols += f"before {before.get('source', {}).get('commit', '?'):>7} | "
    cols += "now cold | 12-03 warm | "
    if before:
        cols += "before | "
    cols += "now warm | target"
    lines = [head, cols]
    now = figures(out)
    for key, label in LABELS.items():
        issue_cold, issue_warm = ISSUE[key]
        line = f"  {label:<44} | {issue_cold:>10} | "
        if before:
            line += f"{f(old[key][0]):>14} | "
        line += f"{f(now[key][0]):>8} | {issue_warm:>10} | "
        if before:
            line += f"{f(old[key][1]):>6} | "
        line += f"{f(now[key][1]):>8} | {TARGETS[key]}"
        lines.append(line)
    lines.append("  (* 12-03: `agent` call shown -> spawn request dispatched; 'warm' = a "
                 "deployment already running, SWARM_REDIS_URL)")
    for name, row in out["rows"].items():
        if name.startswith("cold_") and row.get("n", 1) > 1:
            lines.append(f"  N={row['n']}: wall {f(row['wall'])} s (range "
                         f"{'-'.join(f(x) for x in row['wall_range'] or [])}), agent -> last "
                         f"child {f(row['agent_to_last_child'])} s")
    cold = out["rows"].get("cold_1", {})
    lines.append(f"  cold N=1: the local processes outlived the command by "
                 f"{f(cold.get('lingered'))} s (median)")
    if cfg.get("ab_base"):
        lines.append(f"  A/B in this run, jobs alternated with the swarm of {cfg['ab_base']} "
                     "(base -> now, medians):")
        for name, row in out["rows"].items():
            if not name.startswith("ab_base_"):
                continue
            now_row = out["rows"][name[len("ab_base_"):]]
            lines.append(
                f"    cold N={row['n']}: start {f(row['start_to_first_request'])} -> "
                f"{f(now_row['start_to_first_request'])}, agent -> child "
                f"{f(row['agent_to_child'])} -> {f(now_row['agent_to_child'])}, answer -> exit "
                f"{f(row['final_to_exit'])} -> {f(now_row['final_to_exit'])}, wall "
                f"{f(row['wall'])} -> {f(now_row['wall'])} (x{now_row['wall'] / row['wall']:.2f})")
    return lines
