"""The same job three ways: the swarm, one ``swarm run`` process per child, one sequential agent.

Every way is a real ``swarm run`` command line (``python -m swarm run --yes``) started from
this process, on the embedded default (each with its own ``SWARM_HOME``, so its own Valkey
server), against the scripted model in this process (``--latency`` s per answer):

- **swarm**: one ``swarm run`` whose root fans out to N children; it starts its server, a
  coordinator and one worker (``SWARM_MAX_PARALLEL`` threads) and stops them at the end;
- **process per child** (EVA's berserk recipe): ``bash`` starts N ``swarm run`` processes in
  the background and ``wait``s; each does one child's work alone; plus one of them alone;
- **sequential**: one ``swarm run`` doing the N x T command turns in one conversation.

Per way: wall time; CPU seconds of the whole process tree (``wait4`` of the top process:
its own and every descendant it waited for); memory as the sum over processes of each
one's peak RSS (VmHWM, sampled from /proc every 0.1 s, the measure quoted for EVA), and the
peak of the tree's summed PSS (shared pages counted once). The model server is not counted.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    JobScript,
    ProcessRun,
    fmt_s,
    log,
    model_env,
    model_server,
    new_tag,
    run_process,
)

TIMEOUT = 300.0


def swarm_argv() -> list[str]:
    return [sys.executable, "-m", "swarm", "run", "--yes"]


def base_env(model: Any) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(model_env(model))
    return env


def summary(run: ProcessRun, ideal: float, n: int) -> dict[str, Any]:
    return {"wall": run.wall, "ideal": ideal, "ratio": run.wall / ideal,
            "cpu_s": run.cpu, "cpu_user": run.cpu_user, "cpu_sys": run.cpu_sys,
            "summed_peak_rss_mib": run.summed_peak_mib,
            "summed_peak_rss_mib_python_valkey": sum(
                v["peak_mib_sum"] for k, v in run.by_name.items()
                if k in ("python", "valkey-server")),
            "peak_total_rss_mib": run.peak_total_rss_mib,
            "peak_total_pss_mib": run.peak_total_pss_mib,
            "max_single_rss_mib": run.maxrss_mib, "processes": run.processes,
            "peak_concurrent_processes": run.peak_procs, "returncode": run.returncode,
            "by_process_name": run.by_name, "children": n}


def timeline(script: JobScript, stamps: list[Any], got: ProcessRun) -> dict[str, float]:
    """Where a cold `swarm run` spends the time beyond the model's: seconds from start to the
    root's first request, from its fan-out answer to the first child's request (starting the
    coordinator and worker, then spawning), the children's part, and from the root's final
    answer to the process's exit (stopping them)."""
    chats = [s for s in stamps if s.kind == "chat"]
    root = {s.turn: s for s in chats if s.task.startswith(f"{script.tag}ROOT")}
    firsts = [s.arrived for s in chats if script.child_index(s.task) is not None and s.turn == 0]
    if 0 not in root or 1 not in root or not firsts:
        return {}
    return {"start_to_root_request": root[0].arrived - got.started,
            "fanout_to_first_child": min(firsts) - root[0].sent,
            "fanout_to_last_child": max(firsts) - root[0].sent,
            "children_part": root[1].arrived - root[0].sent,
            "final_answer_to_exit": got.ended - root[1].sent}


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, turns, latency = args.processes_n, args.turns, args.latency
    began = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="swarm-bench-procs-"))
    ways: dict[str, Any] = {}
    try:
        with model_server(latency) as model:
            env = base_env(model)

            # one child alone, then N children as N processes started by the shell
            for label, count in (("one process (1 child alone)", 1),
                                 (f"process per child (x{n})", n)):
                script = JobScript(new_tag(), count, turns)
                model.responder = script
                root = base / script.tag
                root.mkdir()
                task = shlex.quote(f"{script.tag}CHILD-") + "$i" + shlex.quote(
                    ": do part ") + "$i" + shlex.quote(f" in {turns} steps")
                loop = (f"for i in $(seq 0 {count - 1}); do mkdir -p {root}/w$i; "
                        f"SWARM_HOME={root}/h$i {shlex.join(swarm_argv())} -C {root}/w$i "
                        f"{task} > {root}/out$i 2>&1 & done; wait")
                got = run_process(["bash", "-c", loop], env, TIMEOUT)
                answered = sum(script.child_answer(i) in (root / f"out{i}").read_text()
                               for i in range(count))
                if answered != count:
                    first_bad = next(i for i in range(count)
                                     if script.child_answer(i) not in
                                     (root / f"out{i}").read_text())
                    raise RuntimeError(f"{label}: {count - answered} of {count} processes did "
                                       f"not answer; e.g.:\n"
                                       f"{(root / f'out{first_bad}').read_text()[-2000:]}")
                ways[label] = summary(got, (turns + 1) * latency, count)
                log(f"processes: {label}: {got.wall:.2f} s, {got.summed_peak_mib:.0f} MiB, "
                    f"{got.cpu:.1f} CPU s")

            # the swarm: one `swarm run` with its own embedded server, coordinator and worker
            script = JobScript(new_tag(), n, turns)
            model.responder = script
            home, ws = base / "swarm-home", base / "swarm-ws"
            ws.mkdir()
            out = base / "swarm.out"
            with out.open("wb") as stdout:
                got = run_process([*swarm_argv(), "-C", str(ws), script.root_task],
                                  {**env, "SWARM_HOME": str(home),
                                   "SWARM_MAX_PARALLEL": str(max(64, n)),
                                   "SWARM_MAX_CHILDREN": str(max(200, n))},
                                  TIMEOUT, stdout=stdout)
            if script.root_answer not in out.read_text(errors="replace"):
                raise RuntimeError(f"swarm: no answer:\n{out.read_text()[-3000:]}")
            way = summary(got, (turns + 3) * latency, n)
            way["timeline"] = timeline(script, model.take_stamps(), got)
            ways[f"swarm (1 swarm run, x{n} children)"] = way
            log(f"processes: swarm: {got.wall:.2f} s, {got.summed_peak_mib:.0f} MiB, "
                f"{got.cpu:.1f} CPU s")

            if not args.no_sequential:
                script = JobScript(new_tag(), n, turns)
                model.responder = script
                home, ws = base / "seq-home", base / "seq-ws"
                ws.mkdir()
                out = base / "seq.out"
                with out.open("wb") as stdout:
                    got = run_process([*swarm_argv(), "-C", str(ws), script.sequential_task],
                                      {**env, "SWARM_HOME": str(home)},
                                      TIMEOUT + n * turns * latency * 2, stdout=stdout)
                if f"all {n} parts done" not in out.read_text(errors="replace"):
                    raise RuntimeError(f"sequential: no answer:\n{out.read_text()[-3000:]}")
                ways[f"sequential (1 agent, {n}x{turns} turns)"] = summary(
                    got, (n * turns + 1) * latency, n)
                log(f"processes: sequential: {got.wall:.2f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"benchmark": "processes",
            "config": {"n": n, "turns": turns, "latency": latency,
                       "command": "python -m swarm run --yes (embedded default)",
                       "memory": "sum of each process's peak RSS (VmHWM) over the tree; "
                                 "peak summed PSS", "cpu": "wait4 of the top process"},
            "ways": ways, "run_seconds": time.perf_counter() - began}


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    lines = [f"3. the same job three ways: N={cfg['n']} children x T={cfg['turns']} command "
             f"turns, model latency {cfg['latency']:g} s, each way a real `swarm run` "
             "(embedded default)",
             "  way                                 | wall s | ideal | wall/ideal | CPU s | "
             "sum of peak RSS MiB (swarm+valkey only) | peak PSS MiB | processes"]
    for label, w in out["ways"].items():
        lines.append(f"  {label:<36} | {w['wall']:>6.2f} | {w['ideal']:>5.4g} | "
                     f"{w['ratio']:>10.2f} | {w['cpu_s']:>5.1f} | "
                     f"{w['summed_peak_rss_mib']:>23.0f} "
                     f"({w['summed_peak_rss_mib_python_valkey']:>6.0f}) | "
                     f"{w['peak_total_pss_mib']:>12.0f} | "
                     f"{w['processes']:>4}")
    ways = out["ways"]
    per = next((w for k, w in ways.items() if k.startswith("process per child")), None)
    sw = next((w for k, w in ways.items() if k.startswith("swarm")), None)
    if per and sw:
        lines.append(f"  process-per-child / swarm: wall x{per['wall'] / sw['wall']:.2f}, "
                     f"memory x{per['summed_peak_rss_mib'] / sw['summed_peak_rss_mib']:.1f} "
                     f"(PSS x{per['peak_total_pss_mib'] / max(sw['peak_total_pss_mib'], 1):.1f})"
                     f", CPU x{per['cpu_s'] / sw['cpu_s']:.1f}")
    if sw and sw.get("timeline"):
        t = sw["timeline"]
        lines.append(f"  swarm run, cold: start -> root's 1st request "
                     f"{t['start_to_root_request']:.2f} s; fan-out -> 1st child "
                     f"{t['fanout_to_first_child']:.2f} s (starts "
                     f"coordinator + worker), -> last child {t['fanout_to_last_child']:.2f} s; "
                     f"final answer -> exit {t['final_answer_to_exit']:.2f} s")
    lines.append("  (EVA's own figures for this recipe: 50 processes 14.6 s wall vs 2.7 s for "
                 "one, 2.2 GiB summed peak, 22.7 CPU s. Summed peak RSS includes short-lived "
                 "processes such as the environment probe's `node/java --version`, and counts "
                 "shared pages per process; PSS is what the tree held at its peak.)")
    seq = next((w for k, w in ways.items() if k.startswith("sequential")), None)
    if seq and sw:
        lines.append(f"  sequential / swarm: wall x{seq['wall'] / sw['wall']:.1f} "
                     f"({fmt_s(seq['wall'])} s vs {fmt_s(sw['wall'])} s)")
    return lines
