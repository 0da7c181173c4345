"""What the loop reports as it works (:class:`Observer`) and an agent's knobs
(:class:`AgentConfig`)."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from swarm.agent.protocols import Model
from swarm.agent.tools import Call
from swarm.domain.messages import ChatResult, StreamEvent

log = logging.getLogger(__name__)


class Observer:
    """What the loop reports as it works. Override what you display; the rest is a no-op."""

    def model_call(self, model: Model) -> AbstractContextManager[None]:
        """Wraps one call of ``model``, from the request until the answer is whole or the
        call failed (a view may show that it waits); :meth:`on_event` sees the pieces."""
        return nullcontext()

    def on_event(self, event: StreamEvent) -> None:
        """A piece of the answer as it streams (thinking, text, a tool name)."""

    def on_model_result(self, result: ChatResult) -> None:
        """A whole model message has arrived."""

    def on_tool_start(self, call: Call, summary: str) -> None:
        """A tool call is about to run (after approval); raising an
        :class:`~swarm.errors.AgentStopped` stops the agent before it runs."""

    def on_tool_result(self, call: Call, result: str) -> None:
        """A tool call finished (or was refused); ``result`` is what the model sees."""

    def on_usage(self, used_tokens: int, context_length: int) -> None:
        """How full the context is after a model call."""

    def on_notice(self, text: str) -> None:
        """Something the user should know (compaction, a repaired session, ...)."""

    def on_retry(self, text: str) -> None:
        """A model call (or lookup) failed and is tried again; ``text`` says why and when.
        A terminal shows it in place (see :class:`swarm.cli.render.TerminalView`)."""
        log.warning("%s", text)


@dataclass
class AgentConfig:
    """Knobs of one agent; the CLI and workers fill these from :class:`swarm.config.Settings`."""

    max_turns: int = 0
    turn_limit_name: str = "--max-turns"
    """The setting ``max_turns`` came from, for the message that stops the agent."""
    repeat_limit: int = 0
    """Stop after this many answers in a row made the same calls and got the same refusal
    (``SWARM_REPEAT_LIMIT``); 0: never."""
    command_timeout: int = 300
    command_timeout_max: int = 3600
    compact_at: float = 0.75
    agent_id: str = ""

