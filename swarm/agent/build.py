"""Wiring: build an :class:`Agent` for a workspace from :class:`Settings`.

The CLI and (later) workers both build agents here, so there is one place that
decides which session, lock, hints and tools an agent gets.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swarm.agent.approval import ApprovalGate, LLMReviewer
from swarm.agent.folder import AgentFolder
from swarm.agent.loop import Agent, AgentConfig, Observer
from swarm.agent.probe import probe_environment
from swarm.agent.prompts import PromptParts, system_prompt
from swarm.agent.protocols import ApprovalRequest, Decision, Session
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings
from swarm.llm.client import LLMClient
from swarm.store import keys
from swarm.store.connection import open_store
from swarm.store.hints import HintsStore
from swarm.store.locks import RedisLock
from swarm.store.sessions import RedisSessionStore


def new_session(workspace: Path) -> Session:
    now = time.time()
    return Session(id=keys.session_id_for(str(workspace)), workspace=str(workspace),
                   messages=[], usage={}, created=now, updated=now)


def prompt_builder(workspace: Path, folder: AgentFolder) -> Callable[[str], str]:
    """A function of the memory hints that gives the whole system prompt.

    The environment probe and the agent folder are read once per agent, not per turn.
    """
    tool_errors = folder.typed_tools()[1]
    parts = PromptParts(
        environment=probe_environment(workspace),
        instructions=folder.instructions(),
        skills=[(s.name, s.summary) for s in folder.skills()],
        tool_errors=tool_errors,
    )

    def build(hints: str) -> str:
        return system_prompt(PromptParts(
            hints=hints, environment=parts.environment, instructions=parts.instructions,
            skills=parts.skills, tool_errors=parts.tool_errors))

    return build


@dataclass
class LocalRun:
    """An agent bound to a workspace, with the store it saves to (see :func:`local_agent`)."""

    agent: Agent
    resumed: bool
    repaired: bool


@contextmanager
def local_agent(
    settings: Settings,
    workspace: Path,
    *,
    approver: Callable[[ApprovalRequest], Decision],
    observer: Observer | None = None,
    new: bool = False,
) -> Iterator[LocalRun]:
    """Open the store, lock the workspace's session, and yield a ready agent.

    The session lock is held until the block exits, so two swarm processes on
    one folder (on one host or two) never interleave.
    """
    workspace = workspace.resolve()
    with open_store(settings) as store:
        sessions = RedisSessionStore(store.redis, ttl=settings.session_ttl)
        session_id = keys.session_id_for(str(workspace))
        lock = RedisLock(store.redis, f"session:{session_id}", ttl=settings.lock_ttl,
                         owner_info={"host": socket.gethostname(), "pid": os.getpid(),
                                     "workspace": str(workspace)})
        with lock:
            loaded = None if new else sessions.load(session_id)
            resumed = loaded is not None and bool(loaded.messages)
            repaired = bool(loaded.repairs) if loaded is not None else False
            session: Session = loaded if loaded is not None else new_session(workspace)
            model = LLMClient.from_settings(settings)
            try:
                model.resolve_model()
                folder = AgentFolder(workspace)
                agent = Agent(
                    model=model,
                    env=LocalEnvironment(workspace, output_cap=settings.output_cap),
                    gate=ApprovalGate(settings.policy_for, approver, LLMReviewer(model),
                                      yes=settings.yes),
                    session=session,
                    system_prompt=prompt_builder(workspace, folder),
                    store=sessions,
                    hints=HintsStore(store.redis, settings.home),
                    folder=folder,
                    observer=observer or Observer(),
                    config=AgentConfig(
                        max_turns=settings.max_turns,
                        command_timeout=settings.command_timeout,
                        command_timeout_max=settings.command_timeout_max,
                        compact_at=settings.compact_at,
                    ),
                )
                yield LocalRun(agent, resumed, repaired)
            finally:
                model.close()
