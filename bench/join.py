"""Background calls: a fan-out of N children (default 10) where one takes 10x longer than
the others (the scripted model's delays), on a real local swarm (embedded Redis, a
coordinator, a worker). Measured: seconds from the root's fan-out answer until its next
model call that carries a child's result, two ways:

- ``all``: plain ``agent`` calls; the parent parks until every child settled (the slowest);
- ``any``: ``agent(background: true)`` calls, then ``agent_join(any: true)``; the parent
  gets the first result while the slow child still runs (one more model call in between:
  the one that reads the ids and joins; it counts).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from bench.common import log, median
from swarm.cli import main
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, Slow, ToolCall


def one(url: str, home: Path, model: ScriptedModelServer, mode: str, n: int, delay: float,
        tag: str) -> float:
    """Seconds from the fan-out answer to the next model call with a child's result."""
    marks: dict[str, float] = {}
    lock = threading.Lock()

    def fan_out(request: dict[str, Any]) -> Reply:
        marks["fan_out"] = time.perf_counter()
        return Reply(tool_calls=[ToolCall("agent", {
            "message": f"JOINKID-{tag}-{'slow' if i == 0 else 'fast'} {i}",
            **({"background": True} if mode == "any" else {})}, id=f"c{i}") for i in range(n)])

    def carry_on(request: dict[str, Any]) -> Reply:
        results = [t for t in tool_results(request) if '"answer"' in t]
        last = request["messages"][-1]
        if results or (last["role"] == "user" and '"answer"' in str(last["content"])):
            with lock:
                marks.setdefault("result", time.perf_counter())
            return Reply(content="done")
        return Reply(tool_calls=[ToolCall("agent_join", {"any": True}, id="j")])

    model.responder = ByTask({
        f"JOINROOT-{tag}": [fan_out, carry_on],
        f"JOINKID-{tag}-slow": [Slow(delay * 10, Reply(content="slow child done"))],
        f"JOINKID-{tag}-fast": [Slow(delay, Reply(content="fast child done"))],
    })
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
               SWARM_SANDBOX="none", SWARM_RETRIES="1")
    with tempfile.TemporaryDirectory(prefix="bench-join-") as folder:
        result = CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C", folder,
                                           f"JOINROOT-{tag}"], env=env, catch_exceptions=False)
    if result.exit_code != 0 or "result" not in marks:
        raise RuntimeError(f"the {mode} job failed: {result.output[-2000:]}")
    return marks["result"] - marks["fan_out"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, delay = args.join_n, args.join_delay
    walls: dict[str, list[float]] = {"all": [], "any": []}
    with tempfile.TemporaryDirectory(prefix="bench-join-home-") as tmp, \
            local_swarm(Path(tmp), env={"SWARM_SANDBOX": "none"}) as url, \
            ScriptedModelServer() as model:
        for k in range(args.join_repeats):
            for mode in ("all", "any"):
                took = one(url, Path(tmp), model, mode, n, delay, f"{mode}{k}")
                walls[mode].append(took)
                log(f"join: {mode}: {took:.2f} s to the next model call with a result")
    return {"config": {"n": n, "delay": delay, "slow_delay": delay * 10,
                       "repeats": args.join_repeats},
            "walls": walls, "median_all": median(walls["all"]),
            "median_any": median(walls["any"])}


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    return [f"9. background join: {cfg['n']} children, one answering in {cfg['slow_delay']:.1f} s "
            f"and the rest in {cfg['delay']:.1f} s; seconds from the parent's fan-out to its "
            "next model call with a child's result (median of "
            f"{cfg['repeats']})",
            f"  wait for all (plain agent calls):            {out['median_all']:.2f} s",
            f"  agent(background) + agent_join(any: true):   {out['median_any']:.2f} s"]
