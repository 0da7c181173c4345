"""What the views read of the ledger and the sessions (``swarm status``/``report``/``logs``,
the HTTP API): typed records in batches, each method one round trip whatever the number
of records (a pipeline), so a view of a swarm costs the same few round trips at any size.

Records are parsed by their one parser (:meth:`AgentRecord.from_hash`,
:meth:`RunRecord.from_hash`, :meth:`SessionMeta.parse`); a damaged run or session
meta reads as absent, as a view shows what it can.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import redis

from swarm.domain.records import AgentRecord, RunRecord
from swarm.errors import StoreError
from swarm.store import keys
from swarm.store.sessions import SessionMeta

Entry = tuple[str, dict[str, str]]
#: The fields of a run a view shows: its task, its outcome, its state.
RUN_VIEW_FIELDS = ("message", "result", "state")


@dataclass(frozen=True)
class SwarmHead:
    """A swarm's hash (``info``), its agents' ids by creation, its refused ``agent`` calls."""

    info: dict[str, str]
    agent_ids: list[str]
    refused: int


def _run(run_id: str, row: dict[str, str]) -> RunRecord | None:
    try:
        return RunRecord.from_hash(run_id, row)
    except ValueError:  # damaged JSON in a field
        return None


def _meta(session_id: str, raw: str | None) -> SessionMeta | None:
    try:
        return SessionMeta.parse(session_id, raw) if raw else None
    except StoreError:
        return None


class Reads:
    """Batched typed reads of swarms, agents, runs and sessions."""

    def __init__(self, redis_: redis.Redis) -> None:
        self.redis = redis_

    def swarm_ids(self, start: int = 0, stop: int = -1) -> list[str]:
        """Swarm ids newest first, ``start`` to ``stop`` (inclusive) of the index."""
        return cast("list[str]", self.redis.zrevrange(keys.swarms_index(), start, stop))

    def latest_swarm(self) -> str | None:
        ids = self.swarm_ids(0, 0)
        return ids[0] if ids else None

    def swarm_head(self, swarm_id: str) -> SwarmHead | None:
        """The swarm's hash, agent ids and refused calls; None if it is not in the ledger."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.swarm(swarm_id))
            pipe.zrange(keys.swarm_agents(swarm_id), 0, -1)
            pipe.hget(keys.swarm_counters(swarm_id), "refused")
            info, ids, refused = pipe.execute()
        if not info:
            return None
        try:
            count = int(refused or 0)
        except ValueError:
            count = 0
        return SwarmHead(info, ids, count)

    def swarm_fields(self, swarm_ids: list[str], names: list[str]) -> list[dict[str, str]]:
        """The fields ``names`` of each swarm's hash, in order (those it lacks left out;
        {} for a swarm not in the ledger)."""
        if not swarm_ids:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for sid in swarm_ids:
                pipe.hmget(keys.swarm(sid), names)
            rows = pipe.execute()
        return [{k: v for k, v in zip(names, row, strict=True) if v is not None}
                for row in rows]

    def agents(self, agent_ids: list[str]) -> list[AgentRecord]:
        """The records of ``agent_ids`` in order, those absent left out."""
        if not agent_ids:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for aid in agent_ids:
                pipe.hgetall(keys.agent(aid))
            rows = pipe.execute()
        return [rec for rec in map(AgentRecord.from_hash, rows) if rec is not None]

    def agent_ids_like(self, prefix: str) -> list[str]:
        """Ids of the agents whose id starts with ``prefix``, sorted (a scan of the keys)."""
        head = keys.agent("")
        return sorted({str(k).removeprefix(head) for k in self.redis.scan_iter(
            match=keys.agent(prefix) + "*", count=1000)})

    def details(self, session_ids: list[str], run_ids: list[str],
                run_fields: Iterable[str] = RUN_VIEW_FIELDS
                ) -> tuple[list[SessionMeta | None], list[RunRecord | None]]:
        """The meta of each session and the ``run_fields`` of each run (the rest of the
        record left at its defaults), in order, None where absent or damaged."""
        if not session_ids and not run_ids:
            return [], []
        names = list(run_fields)
        with self.redis.pipeline(transaction=False) as pipe:
            for sid in session_ids:
                pipe.hget(keys.session(sid), "meta")
            for rid in run_ids:
                pipe.hmget(keys.run(rid), names)
            replies = pipe.execute()
        metas = [_meta(sid, raw) for sid, raw in zip(session_ids, replies, strict=False)]
        runs = [_run(rid, {k: v for k, v in zip(names, row, strict=True) if v is not None})
                for rid, row in zip(run_ids, replies[len(session_ids):], strict=True)]
        return metas, runs

    def run(self, run_id: str, fields: Iterable[str] = RUN_VIEW_FIELDS) -> RunRecord | None:
        """The ``fields`` of one run (:meth:`details`)."""
        return self.details([], [run_id], fields)[1][0]

    def jobs(self, swarm_ids: list[str], run_ids: list[str]) -> list[tuple[str | None, int]]:
        """For each swarm, the state of the run ``run_ids`` names beside it (None: there
        is no such run: not a job) and its number of agents."""
        with self.redis.pipeline(transaction=False) as pipe:
            for sid, rid in zip(swarm_ids, run_ids, strict=True):
                pipe.hget(keys.run(rid), "state")
                pipe.zcard(keys.swarm_agents(sid))
            replies: list[Any] = pipe.execute() if swarm_ids else []
        return [(replies[2 * n], int(replies[2 * n + 1] or 0)) for n in range(len(swarm_ids))]

    def events(self, swarm_id: str) -> list[Entry]:
        """Every event of the swarm's stream, oldest first."""
        return cast("list[Entry]", self.redis.xrange(keys.events(swarm_id)))

    def last_event(self, swarm_id: str) -> str:
        """The id of the swarm's latest event ("": none)."""
        got = cast("list[Entry]", self.redis.xrevrange(keys.events(swarm_id), count=1))
        return got[0][0] if got else ""
