"""The parent's side of a spawn: seed the calls, admit them (every limit and check that
can be decided as the call is made), then park on one request for the coordinators."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict

from swarm.config import Settings
from swarm.domain.spawn import Limits, SpawnCall, admit
from swarm.errors import WorkspaceError
from swarm.store.connection import Outage, ride
from swarm.store.ledger import Ledger, derive_id

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
                 outage: Outage | None = None, limits: Limits | None = None) -> None:
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
        if (not wanted and not self.keep_state) or self.seeder is None:
            return calls, {}
        try:
            self.snapshot = self.seeder()
            self.state = self.keeper(self.snapshot) \
                if self.keep_state and self.keeper is not None else self.snapshot
        except WorkspaceError as exc:
            refused = {c.call_id: f"error: the child was not started: {exc}" for c in wanted}
            return [c for c in calls if c.call_id not in refused], refused
        return [dataclasses.replace(c, seed=self.snapshot) if c in wanted else c
                for c in calls], {}

    def submit(self, request_id: str, turn: int, calls: list[SpawnCall],
               results: dict[str, str]) -> None:
        self._ensure()
        self.requests += 1
        ride(self.outage, lambda: self.park(request_id, turn, calls, results))

    def park(self, request_id: str, turn: int, calls: list[SpawnCall],
             results: dict[str, str]) -> bool:
        """Admit each call on what the ledger holds now (one read), then park on the
        request with its runs, refused ones settled (one script)."""
        facts = self.ledger.facts(self.agent_id, self.swarm_id,
                                  [c.agent_id for c in calls if c.agent_id], self.limits)
        admitted = [admit(asdict(c), facts, derive_id("a", self.agent_id, turn, c.call_id))
                    for c in calls]
        return self.ledger.park(request_id, self.agent_id, self.swarm_id, turn, admitted,
                                results, facts, parent_run=self.run_id, token=self.token,
                                workspace_state=self.state, host=self.host)

    def _ensure(self) -> None:
        if self.ensure_swarm is not None and not self._ensured:
            self.ensure_swarm()
        self._ensured = True
