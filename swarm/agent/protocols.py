"""The seams of the agent: small protocols passed into its constructor.

``Agent(model, env, gate, session, ...)`` depends only on these (its gate on an
:class:`Approver`), so a worker, a test or the CLI can supply its own implementations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from swarm.domain.approval import Answer, ApprovalRequest
from swarm.domain.messages import ChatResult, Message, OnEvent
from swarm.domain.session import Session
from swarm.domain.spawn import SpawnCall


class Model(Protocol):
    """An OpenAI-compatible chat model."""

    model: str

    def context_length(self) -> int:
        """The model's context window in tokens."""
        ...

    def chat(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
        *,
        on_event: OnEvent | None = None,
        temperature: float | None = None,
        stream: bool | None = None,
    ) -> ChatResult:
        """One completion; raises :class:`swarm.errors.ModelError` after its retries."""
        ...


@dataclass(frozen=True)
class CommandResult:
    """What a shell command left behind."""

    output: str
    """stdout and stderr interleaved, capped, UTF-8 (bad bytes replaced)."""
    exit_code: int | None
    """None when the command was killed (timeout or interrupt)."""
    timed_out: bool = False
    cut_chars: int = 0
    """How many characters of output the cap removed."""
    cancelled: bool = False
    """The command was killed because the agent was cancelled (``output`` says so)."""

    def for_model(self) -> str:
        """The text the model sees as the tool result."""
        if self.cancelled:
            return self.output
        body = self.output.rstrip("\n")
        sep = "\n" if body else ""
        if self.timed_out:
            return f"{body}{sep}[timed out: the command and its children were killed]"
        return f"{body}{sep}[exit code: {self.exit_code}]"


class Environment(Protocol):
    """Where commands run: a workspace on some host."""

    workspace: Path

    def execute(self, command: str, timeout: int, *,
                output_cap: int | None = None) -> CommandResult:
        """Run ``command`` with ``bash -c`` in the workspace; never raises for the command's own
        failure. Ctrl-C (KeyboardInterrupt) kills the command's process group and re-raises.
        ``output_cap``: characters of output kept, instead of the environment's own cap."""
        ...

    def close(self) -> None:
        """End what the commands ran in (their box, and what is left in it)."""
        ...


class Approver(Protocol):
    """Decides on an approval request; a terminal asks a person, a worker asks a queue.

    The answer says why when it denies (no one answered in time, say): the model is told."""

    def __call__(self, request: ApprovalRequest, /) -> Answer: ...


class SessionStore(Protocol):
    """Where sessions live (Redis in production)."""

    def load(self, session_id: str) -> Session | None: ...

    def save(self, session: Session) -> None:
        """Replace the stored session whole (idempotent)."""
        ...

    def delete(self, session_id: str) -> bool: ...

    def list(self) -> Sequence[Session]:
        """Every stored session, most recently updated first."""
        ...


class Mailbox(Protocol):
    """Messages people send to the running agent (``swarm say``), read at turn boundaries."""

    def unread(self, after: str) -> list[tuple[str, str]]:
        """(id, text) of the messages after id ``after`` ("": every one), oldest first."""
        ...

    def delivered(self, ids: list[str]) -> None:
        """Forget these messages: the saved conversation holds them now."""
        ...


class HintStore(Protocol):
    """Memory hints an agent leaves for its future self (``hints.md`` and Redis)."""

    def load(self) -> str: ...

    def save(self, text: str) -> None: ...


class Spawner(Protocol):
    """Hands ``agent`` calls to the swarm (a Redis stream read by the coordinators)."""

    def request_id(self, turn: int, calls: list[SpawnCall]) -> str:
        """The id the request for ``calls`` made at model call ``turn`` will have (stable)."""
        ...

    def prepare(self, calls: list[SpawnCall]) -> tuple[list[SpawnCall], dict[str, str]]:
        """Seed the calls (snapshot the parent's workspace once for them): the calls to
        send, and the results of those that cannot be sent (e.g. a snapshot over its
        cap), by call id."""
        ...

    def submit(self, request_id: str, turn: int, calls: list[SpawnCall],
               results: dict[str, str]) -> None:
        """Write the spawn request; ``results`` holds the results of the response's other
        calls, by call id. Called after the parent saved itself as parked."""
        ...
