"""The agent loop: ``run() -> step() -> query() / execute()``.

One step is one model call and the tool calls it asked for. The session is
saved after the model's message and after every tool result, so a crash loses
at most the call in flight (and a dangling call is repaired at load).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarm.agent import compaction
from swarm.agent.approval import ApprovalGate
from swarm.agent.folder import AgentFolder, TypedTool
from swarm.agent.protocols import (
    ApprovalRequest,
    Environment,
    HintStore,
    Model,
    Session,
    SessionStore,
)
from swarm.agent.shell import clamp_timeout
from swarm.agent.tools import LEAVE_MEMORY_HINTS, LOAD_SKILL, RUN_CLI, Call, parse_call, tool_name
from swarm.errors import Interrupted, ToolError, TurnLimitReached
from swarm.llm.types import ChatResult, Message, StreamEvent, Usage

INTERRUPTED_BY_USER = "[interrupted by the user before this call finished]"
#: Past this share of the context, compaction happens even without hints.
FORCE_AT = 0.92


class Observer:
    """What the loop reports as it works. Override what you display; the rest is a no-op."""

    def on_event(self, event: StreamEvent) -> None:
        """A piece of the answer as it streams (thinking, text, a tool name)."""

    def on_model_result(self, result: ChatResult) -> None:
        """A whole model message has arrived."""

    def on_tool_start(self, call: Call, summary: str) -> None:
        """A tool call is about to run (after approval)."""

    def on_tool_result(self, call: Call, result: str) -> None:
        """A tool call finished (or was refused); ``result`` is what the model sees."""

    def on_usage(self, used_tokens: int, context_length: int) -> None:
        """How full the context is after a model call."""

    def on_notice(self, text: str) -> None:
        """Something the user should know (compaction, a repaired session, ...)."""


@dataclass
class AgentConfig:
    """Knobs of one agent; the CLI and workers fill these from :class:`swarm.config.Settings`."""

    max_turns: int = 0
    command_timeout: int = 300
    command_timeout_max: int = 3600
    compact_at: float = 0.75
    agent_id: str = ""


@dataclass
class Agent:
    """A shell agent: ``Agent(model, env, ...)``, then ``run(task)`` returns the final answer."""

    model: Model
    env: Environment
    gate: ApprovalGate
    session: Session
    system_prompt: Callable[[str], str]
    """Builds the system prompt around the given memory hints."""
    store: SessionStore | None = None
    hints: HintStore | None = None
    folder: AgentFolder | None = None
    observer: Observer = field(default_factory=Observer)
    config: AgentConfig = field(default_factory=AgentConfig)
    _typed: dict[str, TypedTool] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.folder is not None:
            self._typed = {t.name: t for t in self.folder.typed_tools()[0]}

    @property
    def messages(self) -> list[Message]:
        return self.session.messages

    # -- the loop --------------------------------------------------------------------------

    def run(self, task: str) -> str:
        """Add ``task`` as a user message and work until the model answers without tools.

        Raises :class:`TurnLimitReached` after ``max_turns`` model calls and
        :class:`Interrupted` on Ctrl-C; the session is saved either way.
        """
        self.refresh_system_prompt()
        self.messages.append({"role": "user", "content": task})
        self.save()
        return self.resume()

    def resume(self) -> str:
        """Carry on from the saved history (its last message must not be a final answer)."""
        turns = 0
        while True:
            if self.config.max_turns and turns >= self.config.max_turns:
                raise TurnLimitReached(
                    f"stopped after {turns} model calls (--max-turns {self.config.max_turns}). "
                    "The session is saved: run again to continue, or raise --max-turns."
                )
            answer = self.step()
            turns += 1
            if answer is not None:
                return answer

    def step(self) -> str | None:
        """One model call and its tool calls. Returns the answer when there were no calls."""
        offered = self.tools()
        result = self.query(list(offered.values()))
        self.messages.append(result.message)
        self.session.turns += 1
        self.save()
        if not result.tool_calls:
            return result.content
        hints: str | None = None
        calls = [parse_call(raw, offered) for raw in result.tool_calls]
        for i, call in enumerate(calls):
            try:
                output = self.execute(call)
            except KeyboardInterrupt:
                for rest in calls[i:]:
                    self.add_result(rest, INTERRUPTED_BY_USER)
                raise Interrupted("interrupted by the user") from None
            self.add_result(call, output)
            if call.name == "leave_memory_hints" and not call.error:
                hints = str(call.arguments["hints"])
        self.manage_context(result, hints)
        return None

    def query(self, tools: list[dict[str, Any]]) -> ChatResult:
        """Ask the model for the next message."""
        try:
            result = self.model.chat(self.messages, tools, on_event=self.observer.on_event)
        except KeyboardInterrupt:
            raise Interrupted("interrupted by the user") from None
        usage = self.session.usage
        for key, value in result.usage.as_dict().items():
            usage[key] = usage.get(key, 0) + value
        self.observer.on_model_result(result)
        return result

    def execute(self, call: Call) -> str:
        """Run one checked tool call; every failure becomes the text the model sees."""
        if call.error:
            return call.error
        summary = self.summary(call)
        if call.name not in ("load_skill", "leave_memory_hints"):
            verdict = self.gate.check(ApprovalRequest(
                call.name, call.arguments, summary, agent_id=self.config.agent_id))
            if not verdict.allowed:
                return (f"denied: the user did not allow this call ({verdict.reason}). "
                        "Do not retry it as it is; find another way or explain what you need.")
        self.observer.on_tool_start(call, summary)
        try:
            return self.dispatch(call)
        except ToolError as exc:
            return f"error: {exc}"

    def dispatch(self, call: Call) -> str:
        args = call.arguments
        if call.name == "run_cli":
            timeout = clamp_timeout(args.get("timeout"), self.config.command_timeout,
                                    self.config.command_timeout_max)
            return self.env.execute(str(args["command"]), timeout).for_model()
        if call.name == "load_skill":
            if self.folder is None:
                raise ToolError("no agent folder: there are no skills to load")
            return self.folder.load_skill(str(args["name"]))
        if call.name == "leave_memory_hints":
            if self.hints is not None:
                self.hints.save(str(args["hints"]))
            return "Memory hints saved. The conversation is being compacted now."
        return self._typed[call.name].call(args, self.env.workspace)

    # -- tools and context -----------------------------------------------------------------

    def tools(self) -> dict[str, dict[str, Any]]:
        """The tools offered for the next call, by name."""
        schemas = [RUN_CLI]
        if self.folder is not None and self.folder.skills():
            schemas.append(LOAD_SKILL)
        schemas.extend(t.schema() for t in self._typed.values())
        if self.crisis_index() is not None:
            schemas.append(LEAVE_MEMORY_HINTS)
        return {tool_name(s): s for s in schemas}

    def crisis_index(self) -> int | None:
        """Where the emergency instruction stands, when the context is in crisis."""
        for i in range(len(self.messages) - 1, -1, -1):
            msg = self.messages[i]
            if msg.get("role") == "user" and msg.get("content") == compaction.EMERGENCY:
                return i
        return None

    def manage_context(self, result: ChatResult, hints: str | None) -> None:
        """Start the emergency at ``compact_at``; compact once hints are left (or, past
        :data:`FORCE_AT`, with the hints there are)."""
        context = self.model.context_length()
        used = result.usage.total_tokens or compaction.estimate_tokens(self.messages)
        self.observer.on_usage(used, context)
        crisis = self.crisis_index()
        fraction = compaction.used_fraction(used, context)
        if crisis is not None and (hints is not None or fraction >= FORCE_AT):
            self.compact(crisis, hints)
        elif crisis is None and fraction >= self.config.compact_at:
            self.messages.append({"role": "user", "content": compaction.EMERGENCY})
            self.save()
            self.observer.on_notice(
                f"context {fraction:.0%} full: asked the model to save its memory and compact")

    def compact(self, crisis: int, hints: str | None) -> None:
        if hints is None:
            hints = self.hints.load() if self.hints is not None else ""
        before = len(self.messages)
        budget = int(self.model.context_length() * 0.25)
        self.session.messages = compaction.rebuild(
            self.system_prompt(hints), self.messages, crisis, budget)
        self.save()
        self.observer.on_notice(
            f"compacted the conversation: {before} messages -> {len(self.messages)}")

    def refresh_system_prompt(self) -> None:
        """Put a fresh system prompt (current hints, environment) at the head of the history."""
        hints = self.hints.load() if self.hints is not None else ""
        system = {"role": "system", "content": self.system_prompt(hints)}
        if self.messages and self.messages[0].get("role") == "system":
            self.messages[0] = system
        else:
            self.messages.insert(0, system)

    # -- bookkeeping -----------------------------------------------------------------------

    def add_result(self, call: Call, output: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        self.save()
        self.observer.on_tool_result(call, output)

    def save(self) -> None:
        self.session.updated = time.time()
        if self.store is not None:
            self.store.save(self.session)

    @staticmethod
    def summary(call: Call) -> str:
        if call.name == "run_cli":
            return str(call.arguments.get("command", ""))
        return f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)[:300]})"


def usage_of(session: Session) -> Usage:
    return Usage.from_dict(session.usage)
