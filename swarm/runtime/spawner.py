"""The parent's side of a spawn: seed the calls, admit them (every limit and check that
can be decided as the call is made), then park on one request for the coordinators."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from swarm import faults
from swarm.config import Settings
from swarm.domain.messages import Message
from swarm.domain.session import Session
from swarm.domain.spawn import BACKGROUND_SETTLED, Limits, SpawnCall, admit
from swarm.errors import WorkspaceError
from swarm.store.connection import Outage, ride
from swarm.store.ledger import (
    SETTLED,
    Ledger,
    RunRecord,
    derive_id,
    joined_text,
    result_text,
)
from swarm.store.sessions import RedisSessionStore

#: Takes the snapshot of the parent's workspace its new children start from; returns its
#: id, or raises :class:`WorkspaceError` (over a cap, say) with the reason.
Seeder = Callable[[], str]
#: Given that snapshot, stores the parent's workspace exactly as it parks (git index,
#: ``HEAD``, its children's branches); returns the id to restore it from.
Keeper = Callable[[str], str]


def limits_of(settings: Settings) -> Limits:
    return Limits(max_depth=settings.max_depth, max_children=settings.max_children,
                  max_parallel=settings.max_parallel, token_budget=settings.token_budget)


class RedisSpawner:
    """:class:`swarm.agent.protocols.Spawner` on the ledger and the spawn stream.

    ``ensure_swarm`` is called before the first request: the terminal's root agent
    creates its swarm only when it first goes berserk. ``seeder`` snapshots the parent's
    workspace (None: children start empty). With ``outage`` (a root in a terminal), parking
    rides out a Redis restart (a request is written once: a park again writes nothing).
    """

    def __init__(self, ledger: Ledger, agent_id: str, swarm_id: str, run_id: str = "",
                 ensure_swarm: Callable[[], None] | None = None, token: str = "",
                 seeder: Seeder | None = None, host: str = "",
                 keep_state: bool = False, keeper: Keeper | None = None,
                 outage: Outage | None = None, limits: Limits | None = None,
                 lander: Callable[[Session], None] | None = None,
                 sessions: RedisSessionStore | None = None,
                 background: bool | None = None) -> None:
        self.ledger = ledger
        self.agent_id = agent_id
        self.run_id = run_id
        self.token = token
        """The lease of ``run_id`` (a parent in a worker): parking is fenced by it."""
        self.swarm_id = swarm_id
        self.ensure_swarm = ensure_swarm
        self.seeder = seeder
        self.host = host
        self.keep_state = keep_state
        """Snapshot the workspace at every park, children seeded or not (a parent in a
        worker: it may be resumed on another host, which restores it from this, stored by
        ``keeper`` when given)."""
        self.keeper = keeper
        self.outage = outage
        self.limits = limits
        """The parent's limits, for those its swarm did not record."""
        self.sessions = sessions
        """Where the parent's session is saved (its TTL, whether it is listed): a take
        writes it."""
        self.lander = lander
        """Lands the work of background children's results just taken (agent_join)."""
        self.background = background
        """Whether the parent started background children (its record says, read with
        its claim; None: not known): without, its final answer reads no list of them."""
        self.requests = 0
        self._ensured = False
        self.snapshot = ""
        """The snapshot taken for the latest request ("" when none was)."""
        self.state = ""
        """What the parent can be restored from as it parks for that request."""

    def request_id(self, turn: int, calls: list[SpawnCall]) -> str:
        return derive_id("q", self.agent_id, turn, *(c.call_id for c in calls))

    def prepare(self, calls: list[SpawnCall]) -> tuple[list[SpawnCall], dict[str, str]]:
        """New children that do not ask to start empty, and continued ones, get the
        snapshot of the parent's workspace, taken once for the request (a continued child's
        workspace is brought up to it); if it cannot be taken, those calls are answered
        with the reason instead."""
        self._ensure()  # the swarm's record (and its counters) come first
        wanted = [c for c in calls if not c.empty]
        self.snapshot = self.state = ""
        keep = self.keep_state and not all(c.background for c in calls)  # it parks
        if (not wanted and not keep) or self.seeder is None:
            return calls, {}
        try:
            self.snapshot = self.seeder()
            self.state = self.keeper(self.snapshot) \
                if keep and self.keeper is not None else self.snapshot
        except WorkspaceError as exc:
            refused = {c.call_id: f"error: the child was not started: {exc}" for c in wanted}
            return [c for c in calls if c.call_id not in refused], refused
        return [dataclasses.replace(c, seed=self.snapshot) if c in wanted else c
                for c in calls], {}

    def submit(self, request_id: str, turn: int, calls: list[SpawnCall],
               results: dict[str, str]) -> None:
        self._ensure()
        self.requests += 1
        faults.point("spawner-before-park")  # the parent is saved parked; no request yet
        ride(self.outage, lambda: self.park(request_id, turn, calls, results))

    def park(self, request_id: str, turn: int, calls: list[SpawnCall],
             results: dict[str, str], background: bool = False) -> bool:
        """Admit each call on what the ledger holds now (one read), then park on the
        request with its runs, refused ones settled (one script); ``background``: the
        same request, but the parent goes on."""
        facts = self.ledger.facts(self.agent_id, self.swarm_id,
                                  [c.agent_id for c in calls if c.agent_id], self.limits)
        admitted = [admit(asdict(c), facts, derive_id("a", self.agent_id, turn, c.call_id))
                    for c in calls]
        return self.ledger.park(request_id, self.agent_id, self.swarm_id, turn, admitted,
                                results, facts, parent_run=self.run_id, token=self.token,
                                workspace_state="" if background else self.state,
                                host=self.host, background=background)

    # -- background children (swarm.agent.background.Children) ----------------------------

    def start(self, turn: int, calls: list[SpawnCall]) -> dict[str, str]:
        """Send ``calls`` as one background request (admitted and dispatched as any);
        each call's result: its child's id, or why it was refused."""
        spawns, results = self.prepare(calls)
        if spawns:
            self._ensure()
            self.requests += 1
            request_id = derive_id("q", self.agent_id, turn, "background",
                                   *(c.call_id for c in spawns))
            self.background = True  # before: a park whose answer was lost may have written
            ride(self.outage, lambda: self.park(request_id, turn, spawns, {}, background=True))
            runs = self.ledger.runs(derive_id("r", self.agent_id, turn, c.call_id)
                                    for c in spawns)
            for call, run in zip(spawns, runs, strict=True):
                if run is None or run.state == "refused":
                    results[call.call_id] = result_text(run, call.call_id)
                else:
                    results[call.call_id] = json.dumps({
                        "agent_id": run.agent, "run_id": run.id, "state": "started",
                        "background": "it runs while you go on; agent_join takes its result, "
                                      "agent_status shows how it does"}, indent=1)
        return results

    def background_runs(self) -> list[RunRecord]:
        """The runs of the parent's background children, oldest first (none read when its
        record said it started none)."""
        if self.background is False:
            return []
        return self.ledger.background_runs(self.agent_id)

    def status(self, ids: list[str]) -> str:
        """Each background child's (all, or ``ids``) state, last action, turns, tokens."""
        runs = [r for r in self.background_runs() if not ids or r.agent in ids]
        if not runs:
            return "no background children" + (f" among {', '.join(ids)}" if ids else "")
        agents = self.ledger.agents_by_id([r.agent for r in runs])
        tokens = self.ledger.tokens_of([r.agent for r in runs])
        rows = []
        for run, agent, used in zip(runs, agents, tokens, strict=True):
            latest = agent is not None and agent.run == run.id  # its state: waiting, say
            row: dict[str, Any] = {"agent_id": run.agent,
                                   "state": agent.state if latest and agent else run.state}
            if agent is not None:
                row.update(type=agent.type or None, turns=agent.turns, last=agent.last or None)
            row.update(tokens=used, result="taken" if run.delivered else (
                "ready: agent_join takes it" if run.state in SETTLED else None))
            rows.append({k: v for k, v in row.items() if v is not None})
        return json.dumps(rows, ensure_ascii=False, indent=1)

    def outstanding(self, ids: list[str]) -> tuple[dict[str, str], list[str]]:
        """The runs of background children whose results were not taken (agent id -> run
        id; all, or ``ids``), and a note for each of ``ids`` that is not one."""
        runs = self.background_runs()
        pending = {r.agent: r.id for r in runs if not r.delivered}
        if not ids:
            return pending, []
        mine = {r.agent for r in runs}
        notes = [f"{i}: its result was given to you already" if i in mine else
                 f"{i}: not a child you started in the background"
                 for i in ids if i not in pending]
        return {i: pending[i] for i in ids if i in pending}, notes

    def wait(self, wait_id: str, turn: int, runs: dict[str, str], any_: bool,
             call_id: str, results: dict[str, str]) -> bool:
        """Park on ``runs`` (True; the workspace kept as a park keeps it), or False when
        they settled already."""
        done = [r for r in self.ledger.runs(runs.values()) if r is not None and
                r.state in SETTLED]
        if done and (any_ or len(done) == len(runs)):
            return False  # no snapshot to take: the script would not park
        state = ""
        if self.keep_state and self.seeder is not None and self.keeper is not None:
            try:
                state = self.keeper(self.seeder())
            except WorkspaceError:
                state = ""  # resumed on this host, it needs none
        return bool(ride(self.outage, lambda: self.ledger.wait(
            wait_id, self.agent_id, self.swarm_id, turn, runs, any_, call_id, results,
            parent_run=self.run_id, token=self.token, workspace_state=state, host=self.host)))

    def take(self, runs: dict[str, str], any_: bool, tag: str, session: Session,
             call_id: str, notes: list[str]) -> str:
        """Deliver the results of the settled ``runs`` not delivered yet (in call order;
        with ``any_``, as they settled) into ``session``: the answer of ``call_id`` ("": a
        message after its final answer), written with the marks in one transaction.
        Returns the text added, "" when none had settled (nothing written)."""
        cap = int(self.ledger.swarm_settings(self.swarm_id).get("output_cap") or 0)
        store = self.sessions or RedisSessionStore(self.ledger.redis, index=False)

        def message(taken: list[RunRecord]) -> Message:
            if any_:
                taken.sort(key=lambda r: r.settled)
            got = {r.agent for r in taken}
            text = "\n".join([*notes, joined_text(taken, [a for a in runs if a not in got],
                                                   cap)])
            return {"role": "tool", "tool_call_id": call_id, "content": text} if call_id \
                else {"role": "user", "content": BACKGROUND_SETTLED + text}

        if store.fence is not None:
            store.fence()
        taken = ride(self.outage, lambda: self.ledger.take(
            session, list(runs.values()), tag, message, store.ttl, store.index))
        if not taken:
            return ""
        return str(session.messages[-1]["content"])

    def cancel(self, runs: dict[str, str]) -> str:
        """Cancel the children of ``runs`` (and their subtrees); their results are never
        delivered."""
        for agent in runs:
            self.ledger.cancel(agent, "cancelled by its parent (agent_cancel)")
        self.ledger.deliver(list(runs.values()), "cancelled", unsettled=True)
        return f"cancelled: {', '.join(runs)}; their results will not be given to you"

    def land(self, session: Session) -> None:
        if self.lander is not None:
            self.lander(session)

    def _ensure(self) -> None:
        if self.ensure_swarm is not None and not self._ensured:
            self.ensure_swarm()
        self._ensured = True
