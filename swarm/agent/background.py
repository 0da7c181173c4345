"""Background children, the parent's side: ``agent(..., background: true)`` answers at once
with the child's id, and the parent goes on (holding its slot); ``agent_status`` peeks,
``agent_join`` takes their results (parking until all, or any, settle), ``agent_cancel``
drops them. Each background child's result reaches the parent once: through a join, or,
when the parent answers while some still run, in a message after its answer (it parks
until they settle, then answers again).

The swarm's side (one request per answer's background calls, the wait a parent parks on,
who answered it) is the ledger's (:mod:`swarm.store.ledger`); the spawner carries it out
(:class:`Children`).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from swarm import telemetry
from swarm.agent.agent_types import BACKGROUND
from swarm.agent.tools import Call, function_schema
from swarm.domain.session import Session
from swarm.domain.spawn import SpawnCall
from swarm.errors import Parked

if TYPE_CHECKING:
    from swarm.agent.loop import Agent

_IDS = {"type": "array", "items": {"type": "string"},
        "description": "agent ids of your background children (default: all of them)"}

AGENT_STATUS = function_schema(
    "agent_status",
    "Peek at children you started with `background: true`: each one's state, last action, "
    "turns and tokens, and whether you took its result already. Returns at once.",
    {"ids": _IDS}, [])

AGENT_JOIN = function_schema(
    "agent_join",
    "Take the results of children you started with `background: true`: those settled are "
    "returned at once; otherwise you wait until all of them (or, with `any: true`, the "
    "first) settle. Results come in call order (all) or in the order they settled (any), "
    "with `still_running` naming the rest; each child's result is given once. Their "
    "changes land in your workspace as results of plain agent calls do.",
    {"ids": _IDS, "any": {"type": "boolean",
                          "description": "return as soon as one of them settled"}}, [])

AGENT_CANCEL = function_schema(
    "agent_cancel",
    "Cancel children you started with `background: true` (and their own children) whose "
    "results you no longer want: they stop, and their results are never given to you.",
    {"ids": _IDS}, [])

SCHEMAS = (AGENT_STATUS, AGENT_JOIN, AGENT_CANCEL)
TOOLS = BACKGROUND  # offered with ``agent`` (a type that lists it gets them too)
#: The tool call id that stands for the parent's final answer in a wait.
ANSWER = ""


@runtime_checkable
class Children(Protocol):
    """The spawner's side of background children (:class:`swarm.runtime.spawner.RedisSpawner`)."""

    def start(self, turn: int, calls: list[SpawnCall]) -> dict[str, str]:
        """Send ``calls`` as one background request; each call's result, by call id (its
        child's id, or why it was refused)."""
        ...

    def status(self, ids: list[str]) -> str:
        """The state of the given background children (all when ``ids`` is empty)."""
        ...

    def outstanding(self, ids: list[str]) -> tuple[dict[str, str], list[str]]:
        """The runs not delivered yet of the given children (all when empty), agent id ->
        run id, and a note for each id that is not one (unknown, or delivered)."""
        ...

    def wait(self, wait_id: str, turn: int, runs: dict[str, str], any_: bool,
             call_id: str, results: dict[str, str]) -> bool:
        """Park on ``runs`` (True), or False when they settled already."""
        ...

    def take(self, runs: dict[str, str], any_: bool, tag: str, session: Session,
             call_id: str, notes: list[str]) -> str:
        """Deliver the results of the settled ones of ``runs`` not delivered yet into
        ``session`` (the answer of ``call_id``, "" for a message after the final answer),
        saved with their marks at once; the text added, "" when none had settled."""
        ...

    def cancel(self, runs: dict[str, str]) -> str:
        """Cancel the children of ``runs``; their results are never delivered."""
        ...

    def land(self, session: Session) -> None:
        """Land the work of the results just added to ``session`` in the workspace."""
        ...


class MustWait(Exception):
    """An ``agent_join`` whose results have not settled: the parent parks on them."""

    def __init__(self, call: Call, runs: dict[str, str], any_: bool, notes: list[str]) -> None:
        super().__init__(call.id)
        self.call, self.runs, self.any, self.notes = call, runs, any_, notes


class Background:
    """An agent's background children; offered when its spawner has :class:`Children`."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.can_wait = True
        """False while the answer also starts children the plain way (it parks on them)."""

    @property
    def children(self) -> Children | None:
        spawner = self.agent.spawner
        return spawner if isinstance(spawner, Children) else None

    def schemas(self) -> list[dict[str, Any]]:
        return list(SCHEMAS) if self.children is not None else []

    def start(self, calls: list[Call]) -> dict[str, str]:
        """Send the answer's ``agent`` calls with ``background: true`` as one request;
        their results (each child's id), by call id."""
        children = self.children
        wanted = [c for c in calls if c.name == "agent" and not c.error
                  and c.arguments.get("background") is True]
        if children is None or not wanted:
            return {}
        spawns = []
        for call in wanted:
            args = call.arguments
            with telemetry.span("tool agent", call_id=call.id, agent=self.agent.config.agent_id):
                trace = telemetry.traceparent()
            spawns.append(SpawnCall(call.id, str(args["message"]), str(args.get("agent_id", "")),
                                    args.get("output_schema"), trace,
                                    empty=args.get("seed") is False,
                                    type=str(args.get("type") or ""), background=True))
            self.agent.observer.on_tool_start(call, self.agent.summary(call))
        return children.start(self.agent.session.turns, spawns)

    def call(self, call: Call) -> str:
        """Run ``agent_status`` or ``agent_cancel``; ``agent_join`` raises
        :class:`MustWait`: the loop runs the answer's other calls, then :meth:`park` takes
        the results now if they settled, else parks on them."""
        children = self.children
        assert children is not None
        ids = [str(i) for i in call.arguments.get("ids") or []]
        if call.name == "agent_status":
            return children.status(ids)
        runs, notes = children.outstanding(ids)
        if call.name == "agent_cancel":
            return "\n".join([*notes, children.cancel(runs) if runs else
                              "no background child of yours to cancel"])
        any_ = call.arguments.get("any") is True
        if not runs:
            return "\n".join(notes or ["you have no background children whose results you "
                                       "have not taken"])
        if not self.can_wait:
            return ("error: agent_join cannot be called in an answer that also starts "
                    "children without background (you wait for those); call it in an answer "
                    "of its own")
        raise MustWait(call, runs, any_, notes)  # taken now if settled, else waited for

    def park(self, wait: MustWait, rest: list[Call]) -> None:
        """Run the answer's calls after the join (their results wait with it), then park
        until the join's children settle; if they settled meanwhile, answer the join (and
        the rest) now instead."""
        agent, children = self.agent, self.children
        assert children is not None
        results: dict[str, str] = {}
        for call in rest:
            try:
                results[call.id] = agent.execute(call)
            except MustWait:
                results[call.id] = "error: one agent_join may wait per answer; call it again"
        wait_id = self._wait_id(wait.call.id)
        if self._parked(wait_id, wait.runs, wait.any, wait.call.id, results):
            raise Parked(wait_id)
        if agent.guard is not None:
            agent.guard()
        text = children.take(wait.runs, wait.any, wait_id, agent.session, wait.call.id,
                             wait.notes)
        agent.observer.on_tool_result(wait.call, text)
        for call in rest:
            agent.add_result(call, results[call.id])
        self._land()

    def before_answer(self) -> bool:
        """The agent answered: with background children still to deliver, park until they
        settle (no orphan), or take their results now if they did; True when results were
        added (it answers again)."""
        children = self.children
        if children is None:
            return False
        runs, _ = children.outstanding([])
        if not runs:
            return False
        wait_id = self._wait_id(ANSWER)
        if self._parked(wait_id, runs, False, ANSWER, {}):
            raise Parked(wait_id)
        if self.agent.guard is not None:
            self.agent.guard()
        if not children.take(runs, False, wait_id, self.agent.session, ANSWER, []):
            self.agent.save()  # unparked: nothing was left to take
            return False
        self._land()
        return True

    def _wait_id(self, call_id: str) -> str:
        """Stable for the answer it parks (a replay after a crash finds the same wait)."""
        agent = self.agent
        parts = (f"{agent.session.id}:{agent.config.agent_id}:{agent.session.turns}:"
                 f"{call_id or 'answer'}")
        return "w" + hashlib.sha256(parts.encode()).hexdigest()[:15]

    def _parked(self, wait_id: str, runs: dict[str, str], any_: bool, call_id: str,
                results: dict[str, str]) -> bool:
        """Save the session parked on ``wait_id`` before the wait exists (the coordinator
        must never find it unparked), then wait; unparked again when nothing to wait for."""
        agent, children = self.agent, self.children
        assert children is not None
        agent.session.parked = wait_id
        agent.save()
        if children.wait(wait_id, agent.session.turns, runs, any_, call_id, results):
            return True
        agent.session.parked = ""
        return False

    def _land(self) -> None:
        children = self.children
        assert children is not None
        children.land(self.agent.session)
        self.agent.save()
