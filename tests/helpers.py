"""Builders shared by the agent tests, children made through the ledger as the agent tool
makes them, and :func:`wait_until` for every test that waits."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis as redis_py

from swarm.agent.approval import ApprovalGate, approve_all
from swarm.agent.folder import AgentFolder
from swarm.agent.loop import Agent, AgentConfig, Observer
from swarm.agent.protocols import Approver, SessionStore
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings
from swarm.domain.spawn import Admission
from swarm.llm.client import LLMClient
from swarm.runtime.build import new_session, prompt_builder
from swarm.store.ledger import Claim, Ledger, derive_id
from swarm.testing.server import ScriptedModelServer

T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str, *, timeout: float = 30.0,
               every: float = 0.02) -> T:
    """Call ``check`` until it returns something true and return that; fail the test,
    naming ``what`` was awaited, after ``timeout`` seconds.

    A wait on a condition, never on a duration: it returns as soon as the condition holds,
    and a slow machine only makes it wait longer, never makes it pass or fail differently.
    ``check`` may itself assert (a process that must stay alive, say) to fail sooner.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(every)


def client_for(server: ScriptedModelServer, **overrides: Any) -> LLMClient:
    settings = Settings(base_url=server.base_url, model=server.models[0], retries=2,
                        backoff_max=0.01, **overrides)
    return LLMClient.from_settings(settings)


class MemoryHints:
    def __init__(self) -> None:
        self.text = ""

    def load(self) -> str:
        return self.text

    def save(self, text: str) -> None:
        self.text = text


def make_agent(
    server: ScriptedModelServer,
    workspace: Path,
    *,
    approver: Approver = approve_all,
    policy: str = "never",
    store: SessionStore | None = None,
    hints: Any = None,
    observer: Observer | None = None,
    **config: Any,
) -> Agent:
    model = client_for(server)
    folder = AgentFolder(workspace)
    return Agent(
        model=model,
        env=LocalEnvironment(workspace),
        gate=ApprovalGate(lambda tool: policy, approver),
        session=new_session(workspace),
        system_prompt=prompt_builder(workspace, folder),
        store=store,
        hints=hints if hints is not None else MemoryHints(),
        folder=folder,
        observer=observer or Observer(),
        config=AgentConfig(**config),
    )


def scripts_run(redis_: Any) -> int:
    """EVALSHA calls that ran a script on the server (INFO commandstats; a first call
    answered NOSCRIPT, then sent again by redis-py, counts once)."""
    stats = redis_.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))


def spawn_children(ledger: Ledger, swarm_id: str, parent_id: str, *agents: str,
                   request: str = "q1", turn: int = 1) -> Claim:
    """New children ``agents`` of ``parent_id``, made the way the ``agent`` tool makes them:
    the parent parks on ``request`` with one call each (``c-AGENT``, message ``do AGENT``)
    under the swarm's recorded limits, and a coordinator claims it (:meth:`Ledger.dispatch`:
    runs past the swarm's ``max_parallel`` are held). Their runs are :func:`child_run`'s."""
    calls = [Admission({"call_id": f"c-{agent}", "message": f"do {agent}"}, agent)
             for agent in agents]
    assert ledger.park(request, parent_id, swarm_id, turn, calls, {},
                       ledger.facts(parent_id, swarm_id, []))
    claim = ledger.dispatch(request)
    assert claim is not None
    return claim


def child_run(parent_id: str, agent: str, turn: int = 1) -> str:
    """The run id of child ``agent`` made by :func:`spawn_children`."""
    return derive_id("r", parent_id, turn, f"c-{agent}")


def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each round trip to Redis from now on was: a command, or a pipeline of n."""
    trips: list[str] = []
    command, execute = redis_py.Redis.execute_command, redis_py.client.Pipeline.execute

    def counted_command(self: redis_py.Redis, *args: Any, **options: Any) -> Any:
        trips.append(str(args[0]))
        return command(self, *args, **options)

    def counted_execute(self: redis_py.client.Pipeline, *args: Any, **options: Any) -> Any:
        if self.command_stack:
            trips.append(f"pipeline of {len(self.command_stack)}")
        return execute(self, *args, **options)

    monkeypatch.setattr(redis_py.Redis, "execute_command", counted_command)
    monkeypatch.setattr(redis_py.client.Pipeline, "execute", counted_execute)
    return trips
