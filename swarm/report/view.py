"""A swarm as read from the ledger at one moment: its agents as a tree, their usage and
outcome, totals and the estimated cost.

Reading costs three pipelined round trips whatever the size of the swarm: the swarm
hash and its agent ids; every agent hash; the session metadata (live token counts and
turns) and run records (task, answer, error) not read before: what a settled run left
never changes, so a :class:`SwarmReader` keeps it.

How a view shows its numbers, and the prices behind a cost, are :mod:`swarm.report.display`.
(Over 400 lines because the reader and the tree it builds change together.)
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from swarm.domain.records import ACTIVE, SETTLED, AgentRecord, usage_since
from swarm.errors import StoreError
from swarm.report.display import (
    Prices,
    first_line,
    fmt_cost,
    fmt_duration,
    fmt_tokens,
    total_cost,
)
from swarm.store.reads import Reads
from swarm.store.sessions import RedisSessionStore
from swarm.text import plural

FAILED = ("failed", "timed_out", "cancelled", "refused")
NO_TYPE = "(no type)"
"""What the costs by type call the agents of no declared type (a type's name has no
parentheses)."""
"""Settled states that are not a success: listed first by every view."""


# -- agents ----------------------------------------------------------------------------------

def _float(value: str | None) -> float:
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


@dataclass
class AgentView:
    """One agent as the views show it."""

    id: str
    parent: str = ""
    kind: str = "child"
    state: str = "?"
    depth: int = 0
    label: str = ""
    host: str = ""
    workspace: str = ""
    session: str = ""
    run: str = ""
    created: float = 0.0
    started: float = 0.0
    settled: float = 0.0
    turns: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    last: str = ""
    task: str = ""
    """The message of its latest run (the root's: the swarm's task)."""
    answer: str = ""
    error: str = ""
    landing: str = ""
    """How its work came home: landed, conflict, kept, no changes, failed ("": not yet)."""
    type: str = ""
    """Its declared agent type ("": none)."""
    level: int = 0
    """Indentation in the tree (its depth below the shown root)."""
    children: list[AgentView] = field(default_factory=list, repr=False)

    base_usage: dict[str, int] = field(default_factory=dict)
    base_turns: int = 0
    """A root in a terminal: its folder's session as the swarm began."""
    frozen: bool = False
    """A settled root in a terminal whose figures for its swarm were kept as it settled
    (its folder's session has gone on since)."""
    said: list[tuple[float, str]] = field(default_factory=list)
    """Messages a person sent it (``swarm say``): (when, text); read for reports."""

    @classmethod
    def from_record(cls, rec: AgentRecord) -> AgentView:
        return cls(
            id=rec.id, parent=rec.parent, kind=rec.kind, state=rec.state or "?",
            depth=rec.depth, label=rec.label, host=rec.host, workspace=rec.workspace,
            session=rec.session, run=rec.run, created=rec.created, started=rec.started,
            settled=rec.settled, turns=rec.turns, usage=rec.usage, last=rec.last,
            landing=rec.landing, answer=rec.answer, error=rec.error,
            base_usage=rec.base_usage, base_turns=rec.base_turns,
            frozen=rec.kept and rec.state in SETTLED, type=rec.type)

    @property
    def session_id(self) -> str:
        """Where its conversation is: a child's session is keyed by its id."""
        return self.session or self.id

    @property
    def tokens(self) -> int:
        return self.usage.get("total_tokens", 0)

    @property
    def is_settled(self) -> bool:
        return self.state in SETTLED

    @property
    def is_failure(self) -> bool:
        return self.state in FAILED

    def start(self) -> float:
        return self.started or self.created

    def end(self, now: float) -> float:
        return self.settled if self.settled and self.is_settled else now

    def elapsed(self, now: float) -> float:
        start = self.start()
        return max(0.0, self.end(now) - start) if start else 0.0

    def doing(self) -> str:
        """Its error, its last command, or what it is waiting for: one short line."""
        if self.is_failure and self.error:
            return "error: " + first_line(self.error, 200)
        if self.last:
            return first_line(self.last, 200)
        if self.state == "parked":
            return "waiting for its children"
        if self.state == "done" and self.answer:
            return "answer: " + first_line(self.answer, 200)
        return ""

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id, "parent": self.parent or None, "kind": self.kind,
            "state": self.state, "depth": self.depth, "label": self.label, "task": self.task,
            "host": self.host, "workspace": self.workspace, "session": self.session_id,
            "run": self.run or None, "created": self.created or None,
            "started": self.started or None, "settled": self.settled or None,
            "elapsed": round(self.elapsed(now), 3), "turns": self.turns, "usage": self.usage,
            "last": self.last, "answer": self.answer, "error": self.error,
            "landing": self.landing or None, "type": self.type or None,
            "children": [c.id for c in self.children]}


def build_tree(agents: Iterable[AgentView]) -> list[AgentView]:
    """The agents depth first, children under their parents in creation order; sets
    ``children`` and ``level``. An agent whose parent is missing becomes a root."""
    ordered = sorted(agents, key=lambda a: (a.created, a.id))
    by_id = {a.id: a for a in ordered}
    roots: list[AgentView] = []
    for agent in ordered:
        agent.children = []
    for agent in ordered:
        parent = by_id.get(agent.parent) if agent.parent != agent.id else None
        (parent.children if parent is not None else roots).append(agent)
    out: list[AgentView] = []
    seen: set[str] = set()
    stack = [(root, 0) for root in reversed(roots)]
    while stack:
        agent, level = stack.pop()
        if agent.id in seen:
            continue
        seen.add(agent.id)
        agent.level = level
        out.append(agent)
        stack.extend((child, level + 1) for child in reversed(agent.children))
    return out


@dataclass
class Row:
    """A line of a view: an agent, or (``agent`` None) a note on agents left out."""

    agent: AgentView | None
    level: int
    note: str = ""


def _counts(agents: Iterable[AgentView]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for agent in agents:
        counts[agent.state] = counts.get(agent.state, 0) + 1
    return counts


def count_text(counts: Mapping[str, int]) -> str:
    """``12 running, 30 done, 2 failed``: working states first, then failures, then the rest."""
    order = {s: i for i, s in enumerate(("running", "parked", "queued", "waiting", *FAILED,
                                         "done"))}
    items = sorted(counts.items(), key=lambda kv: (order.get(kv[0], 99), kv[0]))
    return ", ".join(f"{n} {s}" for s, n in items)


def visible_rows(tree: list[AgentView], limit: int) -> list[Row]:
    """At most ``limit`` rows of the tree: everything when it fits, else the roots, the
    failures and the agents at work (with their ancestors), queued ones when they fit
    too, and a note per parent for the children left out."""
    limit = max(limit, 2)
    if len(tree) <= limit:
        return [Row(a, a.level) for a in tree]
    by_id = {a.id: a for a in tree}

    def with_ancestors(chosen: Iterable[AgentView]) -> set[str]:
        keep: set[str] = set()
        for agent in chosen:
            node: AgentView | None = agent
            while node is not None and node.id not in keep:
                keep.add(node.id)
                node = by_id.get(node.parent)
        return keep

    roots = [a for a in tree if a.level == 0]
    core = [*roots, *(a for a in tree if a.is_failure or a.state in ("running", "parked"))]
    rows = _rows(tree, with_ancestors(core))
    wider = _rows(tree, with_ancestors([*core, *(a for a in tree if a.state in ACTIVE)]))
    if len(wider) <= limit:
        rows = wider
    if len(rows) > limit:
        hidden = sum(1 for r in rows[limit - 1:] if r.agent is not None)
        rows = [*rows[:limit - 1],
                Row(None, 0, f"... {plural(hidden, 'more agent')} not shown; `swarm status` "
                             "lists every agent")]
    return rows


def _rows(tree: list[AgentView], keep: set[str]) -> list[Row]:
    rows: list[Row] = []
    for agent in tree:
        if agent.id not in keep:
            continue
        rows.append(Row(agent, agent.level))
        hidden = [c for c in agent.children if c.id not in keep]
        if hidden:
            rows.append(Row(None, agent.level + 1,
                            f"... {len(hidden)} more: {count_text(_counts(_subtree(hidden)))}"))
    return rows


def _subtree(agents: list[AgentView]) -> list[AgentView]:
    out: list[AgentView] = []
    stack = list(agents)
    while stack:
        agent = stack.pop()
        out.append(agent)
        stack.extend(agent.children)
    return out


# -- the swarm -------------------------------------------------------------------------------

@dataclass
class SwarmView:
    """A view of a swarm as the ledger had it at ``taken``: its hash (``info``) and its
    agents in tree order."""

    swarm_id: str
    info: dict[str, str]
    agents: list[AgentView]
    taken: float
    refused: int = 0
    """``agent`` calls refused (a limit, a bad call): they have no agent in the tree."""

    @property
    def state(self) -> str:
        return self.info.get("state", "?")

    @property
    def settled(self) -> bool:
        """The root has finished (the swarm is no longer ``running``)."""
        return self.state != "running"

    def counts(self) -> dict[str, int]:
        return _counts(self.agents)

    def failures(self) -> list[AgentView]:
        return [a for a in self.agents if a.is_failure]

    @functools.cached_property
    def _models(self) -> dict[str, str]:
        return recorded_models(self.info)  # read once a view, not once an agent

    def model_of(self, agent: AgentView) -> str:
        """The model ``agent`` used (:func:`recorded_models`)."""
        return self._models.get(agent.type, self._models[""])

    def cost(self, prices: Prices, agents: list[AgentView] | None = None) -> float | None:
        """Estimated dollars of ``agents`` (all by default), each at its model's price."""
        return total_cost([prices.cost(a.usage, self.model_of(a))
                           for a in (self.agents if agents is None else agents)])

    def usage(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for agent in self.agents:
            for name, value in agent.usage.items():
                total[name] = total.get(name, 0) + value
        return total

    def by_type(self) -> dict[str, tuple[int, dict[str, int]]]:
        """Agents and their summed usage per declared type (:data:`NO_TYPE` for the rest),
        the types by tokens, most first; {} when no agent has a type."""
        if not any(a.type for a in self.agents):
            return {}
        found: dict[str, tuple[int, dict[str, int]]] = {}
        for agent in self.agents:
            count, usage = found.get(agent.type or NO_TYPE, (0, {}))
            for name, value in agent.usage.items():
                usage[name] = usage.get(name, 0) + value
            found[agent.type or NO_TYPE] = (count + 1, usage)
        return dict(sorted(found.items(),
                           key=lambda kv: (-kv[1][1].get("total_tokens", 0), kv[0])))

    def of_type(self, name: str) -> list[AgentView]:
        """The agents of type ``name`` (:data:`NO_TYPE`: those of none)."""
        return [a for a in self.agents if (a.type or NO_TYPE) == name]

    def type_lines(self, prices: Prices) -> list[str]:
        """``  leaf: 12 agents, 48.1k tokens, ~$0.0072``: one line per type, when any."""
        lines = []
        for name, (count, usage) in self.by_type().items():
            cost = self.cost(prices, self.of_type(name))
            lines.append(f"  {name}: {plural(count, 'agent')}, "
                         f"{fmt_tokens(usage.get('total_tokens', 0))} tokens"
                         + (f", ~{fmt_cost(cost)}" if cost is not None else ""))
        return lines

    def created(self) -> float:
        return _float(self.info.get("created")) or min(
            (a.created for a in self.agents if a.created), default=self.taken)

    def end(self) -> float:
        """When it settled, else now."""
        return _float(self.info.get("settled")) if self.settled and self.info.get(
            "settled") else self.taken

    def wall(self) -> float:
        return max(0.0, self.end() - self.created())

    def summary(self, prices: Prices) -> str:
        """``swarm s1 running · 51 agents: 12 running, 37 done, 2 failed · 1.2M tokens · ...``"""
        usage = self.usage()
        parts = [f"swarm {self.swarm_id} {self.state}",
                 f"{plural(len(self.agents), 'agent')}: {count_text(self.counts())}"]
        if self.refused:
            parts.append(f"{plural(self.refused, 'agent call')} refused")
        parts.append(f"{fmt_tokens(usage.get('total_tokens', 0))} tokens")
        cost = self.cost(prices)
        if cost is not None:
            parts.append(f"~{fmt_cost(cost)}")
        parts.append(f"{fmt_duration(self.wall())} wall")
        return " · ".join(parts)

    def to_json(self, prices: Prices) -> dict[str, Any]:
        info: dict[str, Any] = {k: v for k, v in self.info.items() if k != "settings"}
        try:
            info["settings"] = json.loads(self.info.get("settings") or "{}")
        except ValueError:
            info["settings"] = {}
        for name in ("created", "settled"):
            if name in info:
                info[name] = _float(info[name])
        info.setdefault("id", self.swarm_id)
        try:  # the type's names and descriptions (its instructions stay in the record)
            types = json.loads(self.info.get("types") or "{}")
            info["types"] = {n: t.get("description", "") for n, t in types.items()}
        except (ValueError, AttributeError):
            info["types"] = {}
        usage = self.usage()
        return {
            "swarm": info,
            "totals": {"agents": len(self.agents), "states": self.counts(),
                       "refused": self.refused, "usage": usage,
                       "wall": round(self.wall(), 3), "cost": self.cost(prices),
                       "types": {name: {"agents": count, "usage": used,
                                        "cost": self.cost(prices, self.of_type(name))}
                                 for name, (count, used) in self.by_type().items()}},
            "agents": [{**a.to_json(self.taken), "model": self.model_of(a),
                        "cost": prices.cost(a.usage, self.model_of(a))}
                       for a in self.agents],
        }


def recorded_models(info: dict[str, str]) -> dict[str, str]:
    """The model of each agent type declared in the swarm whose record is ``info``, and
    under "" the swarm's own ("" when not recorded): what each agent's cost is priced by."""
    found = []
    for name in ("types", "settings"):
        try:
            value = json.loads(info.get(name) or "{}")
        except ValueError:
            value = {}
        found.append(value if isinstance(value, dict) else {})
    default = str(found[1].get("model") or "")
    models = {name: str(kind.get("model") or default) for name, kind in found[0].items()
              if isinstance(kind, dict)}
    models[""] = default
    return models


def model_of(info: dict[str, str], agent_type: str) -> str:
    """The model an agent of ``agent_type`` ("": none) used in the swarm ``info``."""
    models = recorded_models(info)
    return models.get(agent_type, models[""])


class SwarmReader:
    """Reads views of swarms; remembers the settled runs it has read."""

    def __init__(self, redis_: redis.Redis) -> None:
        self.redis = redis_
        self.reads = Reads(redis_)
        self._messages: dict[str, str] = {}
        """run id -> its message (the task; never changes)."""
        self._outcomes: dict[str, tuple[str, str]] = {}
        """run id -> (answer, error) of settled runs (they never change)."""
        self._final: dict[str, tuple[dict[str, int], int]] = {}
        """run id -> (usage, turns) of its agent once that run settled."""

    def latest(self) -> str | None:
        return self.reads.latest_swarm()

    def load(self, swarm_id: str, *, root_answer: bool = False) -> SwarmView | None:
        """The swarm now; None if it is not in the ledger. ``root_answer`` also reads the
        root's final answer from its session (a larger read, for reports)."""
        head = self.reads.swarm_head(swarm_id)
        if head is None:
            return None
        agents = [AgentView.from_record(r) for r in self.reads.agents(head.agent_ids)]
        self._details(agents, swarm_info=head.info)
        tree = build_tree(agents)
        if root_answer:
            self._messages_to(swarm_id, tree)
            for agent in tree:
                if agent.kind == "root" and agent.is_settled and not agent.frozen:
                    agent.answer = self._last_answer(agent.session_id)  # before it was kept
        return SwarmView(swarm_id, head.info, tree, time.time(), head.refused)

    def _details(self, agents: list[AgentView], swarm_info: dict[str, str]) -> None:
        for agent in agents:
            if agent.is_settled and agent.run in self._final:
                agent.usage, agent.turns = self._final[agent.run]
        metas = [a for a in agents if not (a.frozen or (a.is_settled and a.run in self._final))]
        runs = [a for a in agents if a.run and (
            a.run not in self._messages or (a.is_settled and a.run not in self._outcomes))]
        got_metas, got_runs = self.reads.details([a.session_id for a in metas],
                                                 [a.run for a in runs])
        for agent, meta in zip(metas, got_metas, strict=True):
            if meta is not None:
                usage, turns = meta.usage, meta.turns
                if agent.kind == "root":  # its folder's session: what this swarm added
                    usage = usage_since(usage, agent.base_usage)
                    turns = max(0, turns - agent.base_turns)
                if not agent.usage or not agent.is_settled:
                    agent.usage = usage or agent.usage
                agent.turns = max(agent.turns, turns)
            if agent.is_settled and agent.run:
                self._final[agent.run] = (agent.usage, agent.turns)
        for agent, run in zip(runs, got_runs, strict=True):
            self._messages[agent.run] = run.message if run is not None else ""
            if run is not None and run.state in SETTLED:
                self._outcomes[agent.run] = _outcome(run.result)
        for agent in agents:
            agent.task = (swarm_info.get("task", "") if agent.kind == "root"
                          else self._messages.get(agent.run, ""))
            if agent.is_settled:
                answer, error = self._outcomes.get(agent.run, ("", ""))
                agent.answer, agent.error = agent.answer or answer, error or agent.error

    def _messages_to(self, swarm_id: str, agents: list[AgentView]) -> None:
        """The messages people sent its agents (``swarm say``), from the swarm's events."""
        by_id = {a.id: a for a in agents}
        for _, fields in self.reads.events(swarm_id):
            agent = by_id.get(fields.get("agent", ""))
            if fields.get("kind") == "message" and agent is not None:
                agent.said.append((_float(fields.get("ts")), fields.get("text", "")))

    def _last_answer(self, session_id: str) -> str:
        try:
            session = RedisSessionStore(self.redis, index=False).load(session_id)
        except StoreError:
            return ""
        for message in reversed(session.messages if session is not None else []):
            if isinstance(message, dict) and message.get("role") == "assistant" and not (
                    message.get("tool_calls")):
                return content_text(message.get("content"))
        return ""


def _outcome(result: dict[str, Any]) -> tuple[str, str]:
    """(answer, error) of a run's result."""
    if not isinstance(result, dict):
        return "", ""
    answer = result.get("answer")
    if answer is None and "output" in result:
        answer = json.dumps(result["output"], ensure_ascii=False)
    return str(answer or ""), str(result.get("error") or "")


def content_text(content: object) -> str:
    """A message's content as text (a list of parts is joined)."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p)
                       for p in content)
    return "" if content is None else str(content)
