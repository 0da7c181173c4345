"""Jobs: a root agent that runs as a task on the workers instead of in a terminal.

``swarm serve`` (HTTP) and schedules submit jobs. A job's root works in the given
workspace on a worker, parks and resumes like any child, and asks approvals through
the swarm's queue; the swarm's state follows the root's run.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

from celery import Celery

from swarm.agent import agent_types
from swarm.agent.agent_types import AgentTypes
from swarm.broker import names
from swarm.mcp_client import config as mcp_config
from swarm.mcp_client.config import McpConfig
from swarm.store.ledger import Ledger, RunRecord, new_swarm_id

log = logging.getLogger(__name__)


def job_run_id(swarm_id: str) -> str:
    return f"r{swarm_id}"


def submit_job(ledger: Ledger, app: Celery, task: str, workspace: Path,
               settings: dict[str, Any], source: str = "api", owner: str = "",
               jobs_root: Path | None = None, *, mcp: McpConfig | None = None,
               types: AgentTypes | None = None, home: Path | None = None) -> str:
    """Record a job's swarm and root, and enqueue the root; returns the swarm id. ``owner``:
    the id of the API token that submits it; ``jobs_root``: the folder ``workspace`` was
    checked to lie beneath (the worker opens it from there, following no symbolic link).

    The job's MCP servers are fixed now, with the swarm: ``mcp``, else those of ``home``'s
    ``mcp.json`` and of the workspace's files as they are at submission. The workers never
    read them from the workspace, which the job's commands write. Its agent ``types`` alike
    (:class:`~swarm.errors.ConfigError` for a type file that is wrong: nothing is
    queued)."""
    if types is None:
        types = agent_types.load(workspace, home)
    if mcp is None:
        mcp = mcp_config.load(workspace, home)
    for problem in mcp.problems:
        log.warning("job for %s: %s", workspace, problem)
    swarm_id = new_swarm_id()
    run = RunRecord(id=job_run_id(swarm_id), agent=swarm_id, request="", call_id="",
                    message=task, state="queued", swarm=swarm_id)
    ledger.create_swarm(swarm_id, swarm_id, str(workspace), task, settings,
                        socket.gethostname(), swarm_id, kind="job", state="queued", job=run,
                        source=source, owner=owner,
                        jobs_root=str(jobs_root) if jobs_root is not None else "",
                        mcp=mcp.to_json(), types=types.to_json())
    app.send_task(names.RUN, args=[run.id], task_id=run.id,
                  shadow=f"job {swarm_id}: {' '.join(task.split()[:8])}"[:200],
                  argsrepr=repr((run.id,)), kwargsrepr="{}", ignore_result=True,
                  root_id=run.id)
    return swarm_id


def job_state_name(root_state: str) -> str:
    """A job's state (queued, running, done, failed, cancelled) from its root run's."""
    return {"queued": "queued", "done": "done", "cancelled": "cancelled",
            "timed_out": "failed", "failed": "failed", "refused": "failed"}.get(
        root_state, "running")


def job_state(ledger: Ledger, swarm_id: str) -> dict[str, Any]:
    """A job as the API shows it: state, answer, usage and its agents."""
    info = ledger.swarm(swarm_id)
    if not info:
        return {}
    run = ledger.run(job_run_id(swarm_id))
    root_state = run.state if run is not None else info.get("state", "")
    state = job_state_name(root_state)
    agents = ledger.agents(swarm_id)
    result: dict[str, Any] = run.result if run is not None else {}
    if run is None:  # a `swarm run` root's swarm: its answer or error is kept with it
        root = next((a for a in agents if a.id == info.get("root", swarm_id)), None)
        result = {"answer": root.answer if root is not None and root.answer else None,
                  "error": (root.error if root is not None else "") or info.get("error") or None}
    usage: dict[str, int] = {}
    for agent in agents:
        for k, v in agent.usage.items():
            usage[k] = usage.get(k, 0) + v
    return {"id": swarm_id, "state": state, "answer": result.get("answer"),
            "error": result.get("error"), "usage": usage,
            "agents": [{"id": a.id, "parent": a.parent, "depth": a.depth, "state": a.state,
                        "label": a.label, "landing": a.landing or None, "type": a.type or None}
                       for a in agents]}
