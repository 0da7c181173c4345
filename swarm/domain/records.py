"""The ledger's records of a run and of an agent, typed (stored as Redis hashes).

The states and transitions between them are drawn in :mod:`swarm.store.ledger`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SETTLED = ("done", "failed", "cancelled", "timed_out", "refused")
"""Final states of a run (and of an agent's latest run)."""
ACTIVE = ("queued", "waiting", "running", "parked")
"""States of a run that has not settled."""


def usage_of(raw: object) -> dict[str, int]:
    """Token counts from their JSON (a session's or a record's); {} for anything else."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw else {}
        except ValueError:
            return {}
    if not isinstance(raw, dict):
        return {}
    return {str(k): _int(str(v)) for k, v in raw.items()}


def usage_since(now: dict[str, int], base: dict[str, int]) -> dict[str, int]:
    """What ``now`` added to ``base`` (counts that only grow; never below zero)."""
    return {k: max(0, v - base.get(k, 0)) for k, v in now.items()}


def _int(value: str | None, default: int = 0) -> int:
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        return default


def _float(value: str | None) -> float:
    try:
        return float(value) if value else 0.0
    except ValueError:
        return 0.0


@dataclass
class RunRecord:
    """One run of an agent for one ``agent`` call (a new child's first run, or a
    continuation by ``agent_id``); a job's root has one run too."""

    id: str
    agent: str
    """"" for a call refused before it got an agent."""
    request: str
    call_id: str
    message: str
    state: str
    output_schema: dict[str, Any] | None = None
    result: dict[str, Any] = field(default_factory=dict)
    start_turn: int = 0
    start_index: int = -1
    """Length of the agent's history when this run's message was added; -1 before that."""
    attempts: int = 0
    traceparent: str = ""
    """The W3C trace context of the parent's ``agent`` call (OpenTelemetry), or ""."""
    swarm: str = ""
    """The swarm of the run's agent ("" in records written before runs carried it)."""
    rebase: str = ""
    """A continuation's: the snapshot of its parent's workspace as the parent called it
    again, which its workspace is brought up to before it runs ("": none)."""
    settled: float = 0.0
    delivered: str = ""
    """A background run's: what took its result to its parent (a wait, a call id, or
    ``cancelled``); "" while it is still to deliver."""

    @classmethod
    def from_hash(cls, run_id: str, row: dict[str, str]) -> RunRecord | None:
        if not row:
            return None
        return cls(
            id=run_id, agent=row.get("agent", ""), request=row.get("request", ""),
            call_id=row.get("call_id", ""), message=row.get("message", ""),
            state=row.get("state", ""),
            output_schema=json.loads(row["output_schema"]) if row.get("output_schema") else None,
            result=json.loads(row["result"]) if row.get("result") else {},
            start_turn=_int(row.get("start_turn")),
            start_index=_int(row.get("start_index"), -1),
            attempts=_int(row.get("attempts")),
            traceparent=row.get("traceparent", ""),
            swarm=row.get("swarm", ""), rebase=row.get("rebase", ""),
            settled=_float(row.get("settled")), delivered=row.get("delivered", ""))

    def to_hash(self, now: float) -> dict[str, str | float]:
        """The fields written when the run is created."""
        fields: dict[str, str | float] = {
            "agent": self.agent, "request": self.request, "call_id": self.call_id,
            "message": self.message, "state": self.state, "created": now,
            "output_schema": json.dumps(self.output_schema) if self.output_schema else "",
            "result": json.dumps(self.result) if self.result else ""}
        if self.traceparent:
            fields["traceparent"] = self.traceparent
        if self.swarm:
            fields["swarm"] = self.swarm
        if self.rebase:
            fields["rebase"] = self.rebase
        return fields


@dataclass
class AgentRecord:
    """One agent of a swarm: the root (``kind`` root in a terminal, job on the workers)
    or a child; its ``state`` follows its latest run."""

    id: str
    swarm: str
    parent: str = ""
    depth: int = 0
    kind: str = "child"
    state: str = ""
    run: str = ""
    """Its latest run."""
    workspace: str = ""
    label: str = ""
    host: str = ""
    session: str = ""
    created: float = 0.0
    started: float = 0.0
    settled: float = 0.0
    parent_workspace: str = ""
    parent_host: str | None = None
    """The parent's workspace and host ride along, so the worker places the child's
    workspace without reading the parent (None in records written before they did)."""
    last: str = ""
    turns: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    seed: str = ""
    """The snapshot its workspace started from ("": an empty folder)."""
    ws_host: str = ""
    """The host its workspace is on ("" in records from before workspaces travelled)."""
    ws_state: str = ""
    """The snapshot of its workspace as it last parked or settled: a resume or a
    continuation on another host restores it from this."""
    landing: str = ""
    """How its work came home (:mod:`swarm.workspace.homecoming`): landed, conflict, kept,
    no changes, failed ("" until its parent took it)."""
    answer: str = ""
    error: str = ""
    """A root in a terminal: its answer in this swarm, or why it ended (children keep
    theirs in their run's result)."""
    base_usage: dict[str, int] = field(default_factory=dict)
    base_turns: int = 0
    """A root in a terminal: its folder's session as this swarm began (the session goes
    on with later runs; the swarm's figures are what it added)."""
    session_created: float = 0.0
    session_turns: int = 0
    """A root in a terminal: which conversation of its folder was this swarm's, and its
    turns when the root last stopped (``swarm attach`` resumes only that one)."""
    type: str = ""
    """Its declared agent type ("": a copy of its parent; a root has none)."""
    kept: bool = False
    """A root in a terminal whose figures, answer and error for this swarm were kept as
    the swarm settled (:class:`RootEnd`)."""
    background: bool | None = None
    """Whether it started children in the background (None: not known, a root's or an
    older record's: its background list says)."""

    @classmethod
    def from_hash(cls, row: dict[str, str]) -> AgentRecord | None:
        if not row or not row.get("id"):
            return None
        return cls(
            id=row["id"], swarm=row.get("swarm", ""), parent=row.get("parent", ""),
            depth=_int(row.get("depth")), kind=row.get("kind", "child"),
            state=row.get("state", ""), run=row.get("run", ""),
            workspace=row.get("workspace", ""), label=row.get("label", ""),
            host=row.get("host", ""), session=row.get("session", ""),
            created=_float(row.get("created")), started=_float(row.get("started")),
            settled=_float(row.get("settled")),
            parent_workspace=row.get("parent_workspace", ""),
            parent_host=row.get("parent_host"), last=row.get("last", ""),
            turns=_int(row.get("turns")), usage=usage_of(row.get("usage")),
            seed=row.get("seed", ""), ws_host=row.get("ws_host", ""),
            ws_state=row.get("ws_state", ""), landing=row.get("landing", ""),
            answer=row.get("answer", ""), error=row.get("error", ""),
            base_usage=usage_of(row.get("base_usage")), base_turns=_int(row.get("base_turns")),
            session_created=_float(row.get("session_created")),
            session_turns=_int(row.get("session_turns")), kept=row.get("kept") == "1",
            type=row.get("type", ""), background={"0": False, "1": True}.get(
                row.get("background", "")))

    @property
    def session_id(self) -> str:
        return self.session or self.id


@dataclass(frozen=True)
class RootEnd:
    """What a root in a terminal did in its swarm, kept in its agent record as the swarm
    settles or the root leaves: the folder's session goes on with later runs, the
    swarm's record does not."""

    usage: dict[str, int]
    turns: int
    session_turns: int
    answer: str = ""
    error: str = ""

    def fields(self) -> dict[str, str]:
        return {"usage": json.dumps(self.usage), "turns": str(self.turns),
                "session_turns": str(self.session_turns), "answer": self.answer,
                "error": self.error[:2000], "kept": "1"}


@dataclass(frozen=True)
class RootStart:
    """A root's folder session as its swarm began: the swarm's figures are what the
    session adds to these, and ``swarm attach`` resumes only that conversation."""

    usage: dict[str, int]
    turns: int
    session_created: float

    def fields(self) -> dict[str, str]:
        return {"base_usage": json.dumps(self.usage), "base_turns": str(self.turns),
                "session_created": repr(self.session_created)}


REQUEST_STATES = ("new", "dispatching", "dispatched", "answered", "joined")
"""A request's states, in order (drawn in :mod:`swarm.store.ledger`): admitted and parked
on (``new``), claimed by a coordinator (``dispatching``), its tasks sent (``dispatched``),
its results in the parent's session (``answered``), its parent woken (``joined``)."""


@dataclass
class RequestRecord:
    """The ``agent`` calls of one model response of a parent, admitted as it parked: each
    call has its run (``runs``: call id -> run id), refused ones settled already."""

    id: str
    parent: str
    swarm: str
    turn: int
    state: str = "new"
    calls: list[dict[str, Any]] = field(default_factory=list)
    results: dict[str, str] = field(default_factory=dict)
    """What the parent's other calls of that response returned (answered in call order)."""
    runs: dict[str, str] = field(default_factory=dict)
    count: int = 0
    settled: int = 0
    refused: int = 0
    max_parallel: int = 0
    """The swarm's in-flight limit, fixed with the swarm: the coordinator's claim holds
    runs over it without reading the swarm."""
    created: float = 0.0
    kind: str = ""
    """"": the parent parked on it; ``background``: its calls ran while the parent went
    on; ``wait``: the parent parked on background runs (``runs``: agent id -> run id),
    until ``any`` or all of them settled, to answer its call ``call`` ("": its final
    answer) with their results."""
    any: bool = False
    call: str = ""

    @classmethod
    def from_hash(cls, row: dict[str, str]) -> RequestRecord | None:
        if not row or not row.get("id"):
            return None
        return cls(
            id=row["id"], parent=row.get("parent", ""), swarm=row.get("swarm", ""),
            turn=_int(row.get("turn")), state=row.get("state", ""),
            calls=json.loads(row["calls"]) if row.get("calls") else [],
            results=json.loads(row["results"]) if row.get("results") else {},
            runs=json.loads(row["runs"]) if row.get("runs") else {},
            count=_int(row.get("count")), settled=_int(row.get("settled")),
            refused=_int(row.get("refused")), max_parallel=_int(row.get("max_parallel")),
            created=_float(row.get("created")), kind=row.get("kind", ""),
            any=row.get("any") == "1", call=row.get("call", ""))

    @property
    def complete(self) -> bool:
        """Every run of the request has settled."""
        return self.settled >= self.count
