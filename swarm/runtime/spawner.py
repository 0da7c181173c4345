"""The parent's side of a spawn: write one request for the coordinators, then park."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from swarm.domain.spawn import SpawnCall
from swarm.store.ledger import Ledger, derive_id


class RedisSpawner:
    """:class:`swarm.agent.protocols.Spawner` on the ledger and the spawn stream.

    ``ensure_swarm`` is called before the first request: the terminal's root agent
    creates its swarm only when it first goes berserk.
    """

    def __init__(self, ledger: Ledger, agent_id: str, swarm_id: str, run_id: str = "",
                 ensure_swarm: Callable[[], None] | None = None, token: str = "") -> None:
        self.ledger = ledger
        self.agent_id = agent_id
        self.run_id = run_id
        self.token = token
        """The lease of ``run_id`` (a parent in a worker): parking is fenced by it."""
        self.swarm_id = swarm_id
        self.ensure_swarm = ensure_swarm
        self.requests = 0

    def request_id(self, turn: int, calls: list[SpawnCall]) -> str:
        return derive_id("q", self.agent_id, turn, *(c.call_id for c in calls))

    def submit(self, request_id: str, turn: int, calls: list[SpawnCall],
               results: dict[str, str]) -> None:
        if self.ensure_swarm is not None and self.requests == 0:
            self.ensure_swarm()
        self.requests += 1
        self.ledger.park(request_id, self.agent_id, self.swarm_id, turn,
                         [asdict(c) for c in calls], results, parent_run=self.run_id,
                         token=self.token)
