"""A child's agent, built from its claimed run: its workspace, limits, model, approvals,
progress, spawner and the swarm's MCP servers and types, wired by
:func:`swarm.runtime.build.build_agent` as a root's are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.agent.agent_types import AgentType
from swarm.agent.loop import Agent
from swarm.config import Settings
from swarm.domain.session import Session
from swarm.llm.client import LLMClient
from swarm.runtime.build import build_agent
from swarm.runtime.spawner import RedisSpawner, limits_of
from swarm.store.approvals import ApprovalQueue, QueueApprover
from swarm.store.hints import HomeHints, SwarmHints
from swarm.store.ledger import AgentRecord, RunRecord, Start
from swarm.store.mailbox import Mailbox
from swarm.workers.limits import Control
from swarm.workers.progress import ProgressReporter
from swarm.workers.prompts import role_prompt
from swarm.workers.supervisor import Watched
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming, parked
from swarm.workspace.seed import Seeds, upper

if TYPE_CHECKING:
    from swarm.workers.arrival import Arrival
    from swarm.workers.child import ChildRunner


@dataclass
class Claimed:
    """A run this worker claimed, and what it works with."""

    run: RunRecord
    start: Start
    resume: bool
    send: Callable[..., None] | None
    watched: Watched
    settings: Settings
    kind: AgentType | None = None
    """Its declared agent type (None: a copy of its parent)."""

    @property
    def record(self) -> AgentRecord:
        return self.start.record

    @property
    def swarm_id(self) -> str:
        return self.start.record.swarm


def child_agent(runner: ChildRunner, claimed: Claimed, arrival: Arrival, seeds: Seeds,
                session: Session, model: LLMClient, control: Control,
                tree: g.WorkTree | None) -> Agent:
    """The agent of ``claimed`` working in the workspace ``arrival`` makes (``tree``: its
    git work tree, a job's), its limits kept by ``control``; with a preface, it asks the
    model before its files are there, and waits for them at its first tool call."""
    run, record, swarm_id, settings = claimed.run, claimed.record, claimed.swarm_id, \
        claimed.settings
    workspace = arrival.expected

    def seeder() -> str:
        own = arrival.arrive()
        return seeds.take(own.path, swarm_id, base=own.seed, tree_of=tree, own=own)

    def guard() -> None:  # before every save, so before every tool call
        arrival.arrive()
        control.check_lease()

    built: list[Agent] = []

    def land_taken(taken: Session) -> None:
        """Background children's results it took (agent_join): their work lands now."""
        landing = homecoming.bring_home(
            seeds, taken, workspace.path, swarm_id, tree, arrival.arrive(),
            run_check=homecoming.checker(built[0].env, settings.command_timeout),
            check=settings.land_check)
        if landing is not None:
            runner.ledger.landed(swarm_id, dict(landing.children))

    redis_, token = runner.redis, claimed.watched.token
    queue = ApprovalQueue(redis_, swarm_id, run=run.id, lease=token)
    jobs_root = runner.placement.jobs_root(swarm_id) if record.kind == "job" else None
    agent = build_agent(
        settings, workspace.path, model, session, store=runner.sessions,
        hints=SwarmHints(redis_, swarm_id, HomeHints(redis_, settings.home),
                         agent_id=run.agent),
        approver=QueueApprover(queue, settings.approval_timeout, control.cancelled),
        observer=ProgressReporter(runner.supervisor, swarm_id, run.agent, claimed.send,
                                  control),
        spawner=RedisSpawner(runner.ledger, run.agent, swarm_id, run.id, token=token,
                             seeder=seeder,
                             keeper=parked.state, host=runner.host, keep_state=True,
                             limits=limits_of(settings), lander=land_taken,
                             sessions=runner.sessions, background=record.background),
        extra_prompt=role_prompt(record.kind, run.agent, record.depth, workspace.path,
                                 record.type),
        agent_id=run.agent,
        cancel=control.event,
        guard=guard,
        before_step=control.before_step,
        mailbox=Mailbox(redis_, run.agent, sessions=runner.sessions),
        mcp=runner.recorded.mcp_servers(swarm_id),
        types=runner.recorded.agent_types(swarm_id),
        agent_type=claimed.kind,
        # Its repository borrows the objects of the one its seed is in.
        read_only=(workspace.odb / "objects",) if workspace.odb is not None else (),
        die_with_runner=True,
        linked=upper(workspace.view) if workspace.view is not None else None,
        beneath=jobs_root,
        boxed_mcp=True,
        kind=record.kind,
        preface=arrival.preface,
        # Its parent's folder (its .env, whatever seeding left out) stays out of reach
        # even where the box shows what holds it (/opt, SWARM_SANDBOX_SHOW).
        hidden=(Path(record.parent_workspace),)
        if record.parent_workspace and record.parent_host == runner.host else (),
    )
    built.append(agent)
    return agent
