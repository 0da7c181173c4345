"""N children on one worker using one MCP server, beside one server per child.

The server is the SDK-built notes server of the tests (``tests/mcp_notes_server.py``, stdio),
configured in ``SWARM_HOME/mcp.json`` of the root, so the children inherit it.

- shared: a cluster with ONE worker process of N + 16 threads; a warm-up job without MCP;
  the worker's RSS at rest; a job of N children with a shell command per turn (the
  baseline); then the same job whose children call ``mcp__notes__add_note`` instead.
  Counted afterwards: the notes server processes under the worker (started by the first
  child that needs one, shared by the rest) and their RSS, the worker's RSS, the job's wall,
  and how long after the fan-out the children made their first model call, beside the
  baseline's (a child asks for its tools first, so it waits for the server to start).
- start: in this process, one server started cold through :class:`McpTools` (process, MCP
  initialize, tools/list), 5 times: median seconds, and its RSS.
- per child: N servers started at once, as N children that each had their own would start
  them (separate processes, one per configuration): seconds until all listed their tools,
  summed RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    Cluster,
    JobScript,
    WorkerSpec,
    analyse,
    log,
    model_server,
    new_tag,
    rss_kb,
    run_root,
    tree,
)
from swarm.mcp_client import bridge
from swarm.mcp_client import pool as mcp_pool
from swarm.mcp_client.config import McpConfig, ServerSpec
from swarm.mcp_client.tools import McpTools
from swarm.testing.scripts import task_of, turn_of
from swarm.testing.server import Reply, ToolCall

NOTES = Path(__file__).resolve().parent.parent / "tests" / "mcp_notes_server.py"


@dataclass
class McpScript(JobScript):
    """A :class:`JobScript` whose children call the notes server instead of a command."""

    def __call__(self, request: dict[str, Any]) -> Reply:
        i = self.child_index(task_of(request))
        turn = turn_of(request)
        if i is not None and turn < self.turns:
            return Reply(tool_calls=[ToolCall("mcp__notes__add_note", {"text": f"{i}.{turn}"})])
        return super().__call__(request)


def notes_spec(name: str = "notes") -> ServerSpec:
    return ServerSpec(name, "stdio", command=sys.executable, args=(str(NOTES),))


def servers_under(pid: int) -> list[int]:
    out = []
    for p in tree(pid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        # The server itself, not the bubblewrap processes of its box (a worker's servers
        # run in one), whose command lines hold its command too.
        if str(NOTES).encode() in cmdline and \
                not cmdline.split(b"\0")[0].endswith(b"bwrap"):
            out.append(p)
    return out


def shared(n: int, turns: int, latency: float) -> dict[str, Any]:
    with model_server(latency) as model, Cluster([WorkerSpec(n + 16)]) as cluster:
        worker = cluster.worker_pids[0]
        run_root(cluster, model, JobScript(new_tag(), 3, 1), max_parallel=64)
        rest = []
        for _ in range(5):
            rest.append(rss_kb(worker))
            time.sleep(0.1)
        plain = JobScript(new_tag(), n, turns)
        base = analyse(plain, run_root(cluster, model, plain, max_parallel=max(64, n)))
        (cluster.home / "mcp.json").write_text(json.dumps(
            {"mcpServers": {"notes": notes_spec().to_json()}}))
        script = McpScript(new_tag(), n, turns)
        run = run_root(cluster, model, script, max_parallel=max(64, n))
        mcp_pool.shutdown()  # the root's own server (in this process)
        times = analyse(script, run)
        servers = servers_under(worker)
        server_rss = sum(rss_kb(p) for p in servers)
        boxed = [boxed_process(p) for p in servers]
        after = rss_kb(worker)
    spawn, plain_spawn = sorted(times.spawn), sorted(base.spawn)
    return {"n": n, "turns": turns, "mcp_calls": n * turns, "job_wall": run.wall,
            "server_processes_on_worker": len(servers), "server_rss_mib": server_rss / 1024,
            "servers_in_a_box": sum(boxed),
            "worker_rss_rest_mib": min(rest) / 1024, "worker_rss_after_mib": after / 1024,
            "first_request_after_fanout_s": spread(spawn),
            "without_mcp_first_request_after_fanout_s": spread(plain_spawn)}


def boxed_process(pid: int) -> bool:
    """Whether process ``pid`` runs in a box (``no_new_privs`` and a seccomp filter)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status


def spread(xs: list[float]) -> dict[str, float]:
    return {"min": xs[0], "median": statistics.median(xs), "max": xs[-1]} if xs else {}


def cold_start(tmp: Path, repeats: int = 5) -> dict[str, Any]:
    took, rss = [], 0
    for i in range(repeats):
        config = McpConfig((notes_spec(),), cwd=tmp / f"start{i}")
        (tmp / f"start{i}").mkdir()
        began = time.perf_counter()
        tools = McpTools(config, log_dir=tmp).tools()
        took.append(time.perf_counter() - began)
        assert tools, "the notes server did not start"
        rss = max(rss, sum(rss_kb(p) for p in servers_under(os.getpid())))
        mcp_pool.shutdown()
    return {"seconds_median": statistics.median(took), "seconds_all": took,
            "server_rss_mib": rss / 1024}


def per_child(tmp: Path, n: int) -> dict[str, Any]:
    """N servers at once, one configuration (folder) each: N children with their own."""
    dirs = [tmp / f"child{i}" for i in range(n)]
    for d in dirs:
        d.mkdir()
    began = time.perf_counter()

    async def start_all() -> list[Any]:
        return await asyncio.gather(*(mcp_pool.pool().connect(notes_spec(), d, tmp, 300.0)
                                      for d in dirs), return_exceptions=True)

    started = bridge.call(start_all(), timeout=600)
    wall = time.perf_counter() - began
    failed = [s for s in started if isinstance(s, BaseException)]
    rss = sum(rss_kb(p) for p in servers_under(os.getpid()))
    count = len(servers_under(os.getpid()))
    mcp_pool.shutdown()
    return {"n": n, "seconds_all_ready": wall, "processes": count, "failed": len(failed),
            "summed_rss_mib": rss / 1024}


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    n = args.mcp_n
    with tempfile.TemporaryDirectory(prefix="swarm-bench-mcp-") as raw:
        tmp = Path(raw)
        start = cold_start(tmp)
        log(f"mcp: one server starts in {start['seconds_median']:.2f} s, "
            f"{start['server_rss_mib']:.0f} MiB")
        row = shared(n, args.mcp_turns, 0.1)
        log(f"mcp: N={n} children, {row['server_processes_on_worker']} server process(es) on "
            f"the worker, {row['server_rss_mib']:.0f} MiB; job {row['job_wall']:.1f} s")
        naive = per_child(tmp, n)
        log(f"mcp: {n} servers (one per child): {naive['seconds_all_ready']:.1f} s, "
            f"{naive['summed_rss_mib']:.0f} MiB")
    return {"benchmark": "mcp",
            "config": {"n": n, "turns": args.mcp_turns, "server": "tests/mcp_notes_server.py "
                       "(stdio, the SDK's MCPServer)", "latency": 0.1},
            "start": start, "shared": row, "per_child": naive,
            "run_seconds": time.perf_counter() - began}


def report(out: dict[str, Any]) -> list[str]:
    s, start, naive = out["shared"], out["start"], out["per_child"]
    first, plain = s["first_request_after_fanout_s"], s["without_mcp_first_request_after_fanout_s"]
    return [
        f"7. MCP: {s['n']} children on one worker using one stdio server "
        f"(tests/mcp_notes_server.py), {s['turns']} MCP call(s) each",
        f"  one server, cold: {start['seconds_median']:.2f} s to start and list its tools "
        f"(median of {len(start['seconds_all'])}), {start['server_rss_mib']:.0f} MiB RSS",
        f"  shared:    {s['server_processes_on_worker']} server process(es) on the worker"
        f" ({s.get('servers_in_a_box', 0)} in a box), "
        f"{s['server_rss_mib']:.0f} MiB; worker {s['worker_rss_rest_mib']:.0f} -> "
        f"{s['worker_rss_after_mib']:.0f} MiB; job {s['job_wall']:.2f} s; children's first "
        f"model call {first.get('min', 0):.2f} / {first.get('median', 0):.2f} / "
        f"{first.get('max', 0):.2f} s after the fan-out (min / median / max; the same job "
        f"with a shell command instead: {plain.get('min', 0):.2f} / "
        f"{plain.get('median', 0):.2f} / {plain.get('max', 0):.2f} s)",
        f"  one per child: {naive['processes']} processes, {naive['summed_rss_mib']:.0f} MiB "
        f"summed, {naive['seconds_all_ready']:.1f} s until all listed their tools"
        + (f" ({naive['failed']} failed)" if naive["failed"] else ""),
    ]
