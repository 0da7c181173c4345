"""The agent loop: ``run() -> step() -> query() / execute()``.

One step is one model call and the tool calls it asked for. The session is
saved after the model's message and after every tool result, so a crash loses
at most the call in flight (and a dangling call is repaired at load).

Around it: :mod:`~swarm.agent.observer` (what it reports, its knobs),
:mod:`~swarm.agent.context` (how full the context is, compaction),
:mod:`~swarm.agent.spawning` (plain ``agent`` calls: park on them) and
:mod:`~swarm.agent.background` (background ones: go on, join later).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarm import telemetry
from swarm.agent import compaction, context, spawning
from swarm.agent.agent_types import AgentType, AgentTypes
from swarm.agent.approval import ApprovalGate
from swarm.agent.background import TOOLS as BACKGROUND_TOOLS
from swarm.agent.background import Background, MustWait
from swarm.agent.folder import AgentFolder, TypedTool
from swarm.agent.observer import AgentConfig as AgentConfig
from swarm.agent.observer import Observer as Observer
from swarm.agent.protocols import (
    Environment,
    HintStore,
    Mailbox,
    Model,
    SessionStore,
    Spawner,
)
from swarm.agent.shell import clamp_timeout
from swarm.agent.tools import (
    LEAVE_MEMORY_HINTS,
    LOAD_SKILL,
    RUN_CLI,
    Call,
    agent_schema,
    parse_call,
    tool_name,
)
from swarm.domain import history
from swarm.domain.approval import ApprovalRequest
from swarm.domain.messages import (
    ChatResult,
    Message,
)
from swarm.domain.session import Session
from swarm.errors import (
    Interrupted,
    ModelCallAborted,
    RepeatedCalls,
    ToolError,
    TurnLimitReached,
)
from swarm.text import plural

if TYPE_CHECKING:  # the MCP SDK takes seconds to import: only agents with servers load it
    from swarm.mcp_client.tools import McpTools

log = logging.getLogger(__name__)

INTERRUPTED_BY_USER = "[interrupted by the user before this call finished]"
#: How a message a person sent to the running agent (``swarm say``) enters its conversation.
FROM_A_PERSON = "[message from a person, sent while you work: {text}]"


@dataclass
class Agent:
    """A shell agent: ``Agent(model, env, ...)``, then ``run(task)`` returns the final answer.

    Every collaborator is a constructor argument (the seams of :mod:`swarm.agent.protocols`,
    the hooks ``guard`` and ``before_step``); :func:`swarm.runtime.build.build_agent` wires
    them for the CLI and the workers."""

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
    spawner: Spawner | None = None
    """Offers the ``agent`` tool when set (berserk mode)."""
    mcp: McpTools | None = None
    """The tools of the agent's MCP servers (``mcp__<server>__<tool>``)."""
    types: AgentTypes | None = None
    """The agent types its ``agent`` tool may start (the swarm's)."""
    kind: AgentType | None = None
    """Its own type, whose tools are the only ones it is offered (None: every tool)."""
    guard: Callable[[], None] | None = None
    """Called before every save; raises to stop an agent that lost its session lock."""
    before_step: Callable[[Agent], None] | None = None
    """Called before every model call, and after one was aborted (:class:`ModelCallAborted`);
    raises to stop (cancel, limits) or adds a message."""
    mailbox: Mailbox | None = None
    """Messages people send it while it works (``swarm say``), heard at turn boundaries."""
    _typed: dict[str, TypedTool] = field(default_factory=dict, init=False)
    run_start: int | None = field(default=None, init=False)
    """The session's turn count when :meth:`run` gave the current task."""
    _noticed: set[str] = field(default_factory=set, init=False)
    _offered: list[dict[str, Any]] | None = field(default=None, init=False, repr=False)
    """The tools offered at the last model call."""
    background: Background = field(init=False)
    """Its children started with ``background: true`` (:mod:`swarm.agent.background`)."""

    def __post_init__(self) -> None:
        self.background = Background(self)
        if self.folder is not None:
            self._typed = {t.name: t for t in self.folder.typed_tools()[0]}

    @property
    def messages(self) -> list[Message]:
        return self.session.messages

    @property
    def tools_bytes(self) -> int:
        """The size of the tools offered at the last model call (:func:`context.used_tokens`),
        encoded only when asked: most calls' token counts need no cap."""
        return 0 if self._offered is None else \
            len(json.dumps(self._offered, ensure_ascii=False).encode())

    # -- the loop --------------------------------------------------------------------------

    def run(self, task: str, *, save_task: bool = True) -> str:
        """Add ``task`` as a user message and work until the model answers without tools.

        Raises :class:`TurnLimitReached` after ``max_turns`` model calls and
        :class:`Interrupted` on Ctrl-C; the session is saved either way. ``save_task=False``
        leaves the first save to the model's answer, for a caller that keeps the task
        elsewhere (a child's run is in the ledger, and a takeover starts it again).

        A task too large for the model's context raises :class:`~swarm.errors.TaskTooLarge`
        before anything is added or sent (:func:`compaction.check_task`).
        """
        warning = compaction.check_task(task, self.model.context_length(),
                                        self.config.compact_at)
        if warning:
            self.observer.on_notice(warning)
        # An interrupted step (Ctrl-C during a save, say) may have left calls unanswered.
        self.session.messages = history.repair(self.messages)
        self.refresh_system_prompt()
        self.messages.append({"role": "user", "content": task})
        if save_task:
            self.save()
        self.run_start = self.session.turns
        return self.resume()

    def resume(self, since_turn: int | None = None) -> str:
        """Carry on from the saved history until an answer.

        ``max_turns`` counts model calls from ``since_turn`` (the session's turn count
        when the task was given; default: when :meth:`run` gave it, else now), so a parked
        and resumed agent keeps its count.
        """
        if since_turn is None:
            since_turn = self.session.turns if self.run_start is None else self.run_start
        start = since_turn
        limit = self.config.max_turns
        while True:
            done = self.session.turns - start
            if limit and done >= limit:
                name = self.config.turn_limit_name
                raise TurnLimitReached(
                    f"stopped after {plural(done, 'model call')} ({name} {limit}). "
                    f"The session is saved: run again (a child: agent_id) to continue, or raise "
                    f"{name}."
                )
            answer = self.step()
            # A message since: answer that too; background children still out: wait for
            # them and answer again with their results.
            if answer is not None and not self.hear() and not self.background.before_answer():
                return answer

    def step(self) -> str | None:
        """One model call and its tool calls. Returns the answer when there were no calls."""
        if self.before_step is not None:
            self.before_step(self)
        self.hear()
        self.check_repeats()
        offered = self.tools()
        result = self.query(list(offered.values()))
        self.messages.append(result.message)
        answered_from = len(self.messages)
        self.session.turns += 1
        self.save()
        if not result.tool_calls:
            return result.content
        hints: str | None = None
        calls = [parse_call(raw, offered) for raw in result.tool_calls]
        started = self.background.start(calls)  # answered at once with the children's ids
        if any(c.name == "agent" and not c.error and c.id not in started for c in calls):
            self.background.can_wait = False
            try:
                done = spawning.spawn(self, calls, started)  # parks, unless no child could be sent
            finally:
                self.background.can_wait = True
            for call in calls:
                self.add_result(call, done[call.id])
            context.manage(self, result, None, since=answered_from)
            return None
        for i, call in enumerate(calls):
            try:
                output = started[call.id] if call.id in started else self.execute(call)
            except KeyboardInterrupt:
                raise self.interrupted(calls[i:]) from None
            except MustWait as wait:  # parks after the rest ran, unless they settled since
                self.background.park(wait, calls[i + 1:])
                break
            if result.cut and i == len(calls) - 1:
                # Told with the results (a message of its own could break the alternation
                # of roles some chat templates insist on).
                output += (f"\n\n[swarm: your last answer was {result.cut}: the rest of it "
                           "was dropped. Keep answers shorter; write long output to files.]")
            self.add_result(call, output)
            if call.name == "leave_memory_hints" and not call.error:
                hints = str(call.arguments["hints"])
        context.manage(self, result, hints, since=answered_from)
        return None

    def hear(self) -> bool:
        """Add the messages people sent since the last turn as user messages, and save them
        before the model sees them; True when there were any. Only at a turn boundary:
        never between a tool call and its result. The session's ``said`` moves on in the
        same save, and the mailbox forgets them after it: read again after a crash before
        the save, skipped after one after it."""
        if self.mailbox is None:
            return False
        last = self.messages[-1] if self.messages else {}
        if last.get("role") == "assistant" and last.get("tool_calls"):
            return False
        heard = self.mailbox.unread(self.session.said)
        if not heard:
            return False
        for _, text in heard:
            self.messages.append({"role": "user", "content": FROM_A_PERSON.format(text=text)})
        self.session.said = heard[-1][0]
        self.save()
        self.mailbox.delivered([mid for mid, _ in heard])
        for _, text in heard:
            self.observer.on_notice(f"a message from a person: {text[:200]}")
        return True

    def check_repeats(self) -> None:
        """Stop an agent whose last answers each made the same calls and got the same
        refusal or error: asked again, the model would only ask again."""
        limit = self.config.repeat_limit
        if not limit:
            return
        count, what = history.repeats(self.messages)
        if count >= limit:
            raise RepeatedCalls(
                f"stopped: {plural(count, 'answer')} in a row made the same call and got the "
                f"same refusal (SWARM_REPEAT_LIMIT {limit}): {what}")

    def query(self, tools: list[dict[str, Any]]) -> ChatResult:
        """Ask the model for the next message.

        A call aborted from outside (a cancel, a deadline, a lost lease: the model's stop
        event) leaves the history as it was before it, saved (nothing half-answered), and
        ``before_step`` raises why it stopped."""
        try:
            with telemetry.span("model call", model=self.model.model,
                                agent=self.config.agent_id, messages=len(self.messages)), \
                    self.observer.model_call(self.model):
                result = self.model.chat(self.messages, tools, on_event=self.observer.on_event)
        except KeyboardInterrupt:
            raise self.interrupted([]) from None
        except ModelCallAborted:
            self.save()  # the guard raises first when the lease is lost: nothing is written
            if self.before_step is not None:
                self.before_step(self)
            raise
        self._offered = tools
        for kind, text in result.notices.items():
            if kind not in self._noticed:  # once a run
                self._noticed.add(kind)
                self.observer.on_notice(text)
        if result.cut:
            self.observer.on_notice(f"the model's answer was {result.cut}; the rest of it "
                                    "was dropped")
        usage = self.session.usage
        for key, value in result.usage.as_dict().items():
            usage[key] = usage.get(key, 0) + value
        self.observer.on_model_result(result)
        self.observer.on_usage(context.used_tokens(self, result), self.model.context_length())
        return result

    def execute(self, call: Call) -> str:
        """Run one checked tool call; every failure becomes the text the model sees."""
        if call.error:
            return call.error
        summary = self.summary(call)
        if call.name not in ("load_skill", "leave_memory_hints", *BACKGROUND_TOOLS):
            mcp = self.mcp.tools().get(call.name) if self.mcp is not None else None
            verdict = self.gate.check(ApprovalRequest(
                call.name, call.arguments, summary, agent_id=self.config.agent_id,
                read_only=mcp.read_only if mcp is not None else None,
                destructive=mcp is not None and mcp.destructive))
            if not verdict.allowed:
                return (f"denied: this call was not allowed ({verdict.reason}). "
                        "Do not retry it as it is; find another way or explain what you need.")
        self.observer.on_tool_start(call, summary)
        try:
            with telemetry.span(f"tool {call.name}", call_id=call.id, agent=self.config.agent_id):
                return self.dispatch(call)
        except ToolError as exc:
            return f"error: {exc}"
        except MustWait:
            raise
        except Exception as exc:  # a broken tool must not take the loop (and session) down
            log.exception("tool %s failed", call.name)
            return f"error: {call.name} failed unexpectedly: {type(exc).__name__}: {exc}"

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
        if call.name in BACKGROUND_TOOLS:
            return self.background.call(call)
        if self.mcp is not None and call.name in self.mcp:
            return self.mcp.call(call.name, args)
        return self._typed[call.name].call(args, self.env, timeout=self.config.command_timeout)

    # -- tools and context -----------------------------------------------------------------

    def tools(self) -> dict[str, dict[str, Any]]:
        """The tools offered for the next call, by name."""
        schemas = [RUN_CLI]
        if self.folder is not None and self.folder.skills():
            schemas.append(LOAD_SKILL)
        if self.spawner is not None:
            schemas.append(agent_schema(self.types))
            schemas.extend(self.background.schemas())
        schemas.extend(t.schema() for t in self._typed.values())
        if self.mcp is not None:
            schemas.extend(self.mcp.schemas())
            for notice in self.mcp.notices():
                self.observer.on_notice(notice)
        if context.crisis_index(self.messages) is not None:
            schemas.append(LEAVE_MEMORY_HINTS)
        kind = self.kind
        return {tool_name(s): s for s in schemas if kind is None or kind.allows(tool_name(s))}

    def refresh_system_prompt(self) -> None:
        """Put a fresh system prompt (current hints, environment) at the head of the history."""
        hints = self.hints.load() if self.hints is not None else ""
        system = {"role": "system", "content": self.system_prompt(hints)}
        if self.messages and self.messages[0].get("role") == "system":
            self.messages[0] = system
        else:
            self.messages.insert(0, system)

    # -- bookkeeping -----------------------------------------------------------------------

    def interrupted(self, calls: list[Call], results: dict[str, str] | None = None
                    ) -> Interrupted:
        """Ctrl-C: answer ``calls`` in order (with ``results`` where they ran, else as
        interrupted), so the saved history has no dangling call; returns what to raise."""
        done = results or {}
        for call in calls:
            self.add_result(call, done.get(call.id, INTERRUPTED_BY_USER))
        return Interrupted("interrupted by the user")

    def add_result(self, call: Call, output: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        self.save()
        self.observer.on_tool_result(call, output)

    def save(self) -> None:
        if self.guard is not None:
            self.guard()
        self.session.updated = time.time()
        if self.store is not None:
            self.store.save(self.session)

    @staticmethod
    def summary(call: Call) -> str:
        if call.name == "run_cli":
            return str(call.arguments.get("command", ""))
        if call.name == "agent":
            target = call.arguments.get("agent_id") or "new child"
            return f"agent ({target}): {str(call.arguments.get('message', ''))[:200]}"
        return f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)[:300]})"

