"""Builders shared by the agent tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.agent.approval import ApprovalGate, approve_all
from swarm.agent.folder import AgentFolder
from swarm.agent.loop import Agent, AgentConfig, Observer
from swarm.agent.protocols import SessionStore
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings
from swarm.domain.approval import ApprovalRequest, Decision
from swarm.llm.client import LLMClient
from swarm.runtime.build import new_session, prompt_builder
from swarm.testing.server import ScriptedModelServer


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
    approver: Callable[[ApprovalRequest], Decision] = approve_all,
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
