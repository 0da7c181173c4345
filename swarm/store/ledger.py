"""The child ledger: swarms, agents, runs and spawn requests in Redis.

- a **swarm** is one root job and every agent it spawned;
- an **agent** is a copy of the agent with its own session and workspace;
- a **run** is one ``agent`` call handled by an agent (a new child's first run has the
  child's id; continuing a child by ``agent_id`` is a new run of the same agent);
- a **request** is the set of ``agent`` calls of one model response of a parent.

Ids are derived from (parent, turn, tool_call id), so a request replayed after a crash
maps to the same runs. Writes are idempotent: records are created only when absent, a
run settles once (a Lua script), and a settlement is announced on the settle stream in
the same script.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from redis.typing import EncodableT, FieldT

from swarm.store import keys

SETTLED = ("done", "failed", "cancelled", "timed_out", "refused")
"""Final states of a run (and of an agent's latest run)."""
ACTIVE = ("queued", "running", "parked", "waiting")

_SETTLE = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == false then return -1 end
for _, s in ipairs({'done', 'failed', 'cancelled', 'timed_out', 'refused'}) do
  if state == s then return 0 end
end
if ARGV[11] ~= '' and redis.call('HGET', KEYS[1], 'lease') ~= ARGV[11] then
  return -2  -- fenced: another worker took this run over; its settlement counts
end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'result', ARGV[2], 'settled', ARGV[3],
           'lease', '')
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[2], 'state', ARGV[1], 'settled', ARGV[3], 'usage', ARGV[4])
end
redis.call('SREM', KEYS[3], ARGV[6])
redis.call('ZREM', KEYS[5], ARGV[6])
if ARGV[7] ~= '' then redis.call('HINCRBY', KEYS[6], 'settled', 1) end
if ARGV[5] == '1' then
  redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[9], '*', 'kind', 'settled', 'agent',
             ARGV[8], 'state', ARGV[1], 'ts', ARGV[3], 'error', ARGV[10])
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[12], '*', 'run', ARGV[6])
return 1
"""

_CLAIM_FN = """
local function claim()
  local state = redis.call('HGET', KEYS[1], 'state')
  local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0') or 0
  local now = tonumber(ARGV[2])
  if state == ARGV[4] or (state == 'running' and lease < now) then
    local until_ = now + tonumber(ARGV[3])
    redis.call('HSET', KEYS[1], 'state', 'running', 'lease', ARGV[1],
               'lease_until', tostring(until_))
    redis.call('HINCRBY', KEYS[1], 'attempts', 1)
    redis.call('HSET', KEYS[2], 'state', 'running', 'host', ARGV[5])
    if redis.call('HEXISTS', KEYS[2], 'started') == 0 then
      redis.call('HSET', KEYS[2], 'started', ARGV[2])
    end
    redis.call('ZADD', KEYS[3], until_, ARGV[6])
    if state == 'parked' then redis.call('SADD', KEYS[4], ARGV[6]) end
    return 1
  end
  return 0
end
"""

# The claim, and in the same round trip what the worker reads next: the agent's record,
# its session, whether it was cancelled while queued, what the swarm has spent.
_START = _CLAIM_FN + """
if redis.call('HEXISTS', KEYS[2], 'swarm') == 0 then return {-1} end
if claim() == 0 then return {0} end
return {1, redis.call('HGETALL', KEYS[2]), redis.call('HMGET', KEYS[5], 'meta', 'messages'),
        redis.call('EXISTS', KEYS[6]), redis.call('HGET', KEYS[7], 'tokens') or ''}
"""

_RENEW = """
if redis.call('HGET', KEYS[1], 'lease') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'lease_until', ARGV[2])
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
  return 1
end
return 0
"""


def derive_id(prefix: str, *parts: object) -> str:
    """A short stable id from ``parts``: the same inputs always give the same id."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()
    return f"{prefix}{digest[:15]}"


def new_swarm_id() -> str:
    return "s" + secrets.token_hex(6)


@dataclass
class Run:
    """One run of an agent for one ``agent`` call."""

    id: str
    agent: str
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


@dataclass
class Start:
    """What :meth:`Ledger.start` found: whether the run was claimed and, if so, its agent's
    record, its session's raw fields (None when it has none), whether the agent was
    cancelled while it waited, and the tokens its swarm had spent."""

    claimed: bool
    agent: dict[str, str] = field(default_factory=dict)
    session_meta: str | None = None
    session_messages: str | None = None
    cancelled: bool = False
    spent: int = 0


@dataclass
class NewRun:
    """A run about to be enqueued, with what its task message shows (Flower) and carries."""

    run: Run
    new_agent: bool = True
    depth: int | str = "?"
    label: str = ""
    traceparent: str = ""

    @classmethod
    def of(cls, run: Run, record: dict[str, str]) -> NewRun:
        """A run already in the ledger, with its agent's ``record``."""
        return cls(run, new_agent=False, depth=record.get("depth", "?"),
                   label=record.get("label", ""), traceparent=run.traceparent)


def _h(redis_: redis.Redis, key: str) -> dict[str, str]:
    return cast("dict[str, str]", redis_.hgetall(key))


class Ledger:
    """Reads and writes the ledger; every method is one or a few round trips."""

    def __init__(self, redis_: redis.Redis, ttl: int = keys.LEDGER_TTL) -> None:
        self.redis = redis_
        self.ttl = ttl
        self._settle = redis_.register_script(_SETTLE)
        self._start = redis_.register_script(_START)
        self._renew = redis_.register_script(_RENEW)

    # -- swarms ------------------------------------------------------------------------------

    def create_swarm(self, swarm_id: str, root_id: str, workspace: str, task: str,
                     settings: dict[str, Any], host: str, session_id: str,
                     kind: str = "root", state: str = "running") -> None:
        """Create a swarm and its root agent (idempotent). ``kind`` is ``root`` for a root
        in a terminal, ``job`` for a root that runs as a task (HTTP jobs, schedules)."""
        now = time.time()
        with self.redis.pipeline() as pipe:
            pipe.hsetnx(keys.swarm(swarm_id), "id", swarm_id)
            pipe.hset(keys.swarm(swarm_id), mapping={
                "root": root_id, "workspace": workspace, "task": task[:500],
                "settings": json.dumps(settings), "created": now, "state": "running"})
            pipe.zadd(keys.swarms_index(), {swarm_id: now}, nx=True)
            pipe.hset(keys.agent(root_id), mapping={
                "id": root_id, "swarm": swarm_id, "parent": "", "depth": 0, "kind": kind,
                "state": state, "workspace": workspace, "label": label_of(task),
                "created": now, "started": now, "host": host, "session": session_id})
            pipe.zadd(keys.swarm_agents(swarm_id), {root_id: now}, nx=True)
            for key in (keys.swarm(swarm_id), keys.agent(root_id), keys.swarm_agents(swarm_id)):
                pipe.expire(key, self.ttl)
            pipe.execute()

    def swarm(self, swarm_id: str) -> dict[str, str]:
        return _h(self.redis, keys.swarm(swarm_id))

    def swarm_settings(self, swarm_id: str) -> dict[str, Any]:
        raw = self.redis.hget(keys.swarm(swarm_id), "settings")
        return cast("dict[str, Any]", json.loads(cast(str, raw))) if raw else {}

    def finish_swarm(self, swarm_id: str, state: str) -> None:
        self.redis.hset(keys.swarm(swarm_id), mapping={"state": state, "settled": time.time()})

    def latest_swarm(self) -> str | None:
        ids = cast("list[str]", self.redis.zrevrange(keys.swarms_index(), 0, 0))
        return ids[0] if ids else None

    def agents(self, swarm_id: str) -> list[dict[str, str]]:
        ids = cast("list[str]", self.redis.zrange(keys.swarm_agents(swarm_id), 0, -1))
        return [row for row in self.agents_by_id(ids) if row]

    # -- agents and runs ---------------------------------------------------------------------

    def agent(self, agent_id: str) -> dict[str, str]:
        return _h(self.redis, keys.agent(agent_id))

    def update_agent(self, agent_id: str, **fields: Any) -> None:
        self.redis.hset(keys.agent(agent_id), mapping={
            k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in fields.items()})

    def add_run(self, run: Run, state: str = "queued") -> bool:
        """Create a run record; False if it already exists."""
        key = keys.run(run.id)
        if not self.redis.hsetnx(key, "id", run.id):
            return False
        with self.redis.pipeline() as pipe:
            if run.agent:
                pipe.hset(keys.agent(run.agent), mapping={"run": run.id, "state": state})
            pipe.hset(key, mapping={**self._run_fields(run, time.time()), "state": state})
            pipe.expire(key, self.ttl)
            pipe.execute()
        return True

    def add_children(self, swarm_id: str, parent: dict[str, str],
                     new: list[NewRun]) -> None:
        """Write the agents (new children, or continued ones) and runs of one request in
        one transaction, with a ``queued`` event each. Records are created only when absent
        (``HSETNX``), so a replay writes nothing twice; the caller checks the runs do not
        exist yet (:meth:`existing_runs`)."""
        now = time.time()
        created = 0
        with self.redis.pipeline() as pipe:
            for item in new:
                run, akey = item.run, keys.agent(item.run.agent)
                if item.new_agent:
                    created += 1
                    pipe.hsetnx(akey, "id", run.agent)
                    # The parent's workspace and host ride along: the child's worker
                    # needs them to place its workspace, without reading the parent.
                    pipe.hset(akey, mapping={
                        "swarm": swarm_id, "parent": parent["id"], "depth": item.depth,
                        "kind": "child", "workspace": "", "label": item.label,
                        "created": now, "host": "",
                        "parent_workspace": parent.get("workspace", ""),
                        "parent_host": parent.get("host", "")})
                    pipe.expire(akey, self.ttl)
                    pipe.zadd(keys.swarm_agents(swarm_id), {run.agent: now}, nx=True)
                pipe.hset(akey, mapping={"run": run.id, "state": "queued"})
                run.swarm = swarm_id
                rkey = keys.run(run.id)
                pipe.hsetnx(rkey, "id", run.id)
                pipe.hset(rkey, mapping=self._run_fields(run, now, item.traceparent))
                pipe.expire(rkey, self.ttl)
                self.event_to(pipe, swarm_id, "queued", run.agent, parent=parent["id"],
                              depth=item.depth)
            if created:
                pipe.hincrby(keys.swarm_counters(swarm_id), "children", created)
                pipe.expire(keys.swarm_counters(swarm_id), self.ttl)
            pipe.execute()

    @staticmethod
    def _run_fields(run: Run, now: float, traceparent: str = "") -> dict[FieldT, EncodableT]:
        fields: dict[FieldT, EncodableT] = {
            "agent": run.agent, "request": run.request, "call_id": run.call_id,
            "message": run.message, "state": run.state, "created": now,
            "output_schema": json.dumps(run.output_schema) if run.output_schema else "",
            "result": json.dumps(run.result) if run.result else ""}
        if traceparent:
            fields["traceparent"] = traceparent
        if run.swarm:
            fields["swarm"] = run.swarm
        return fields

    def existing_runs(self, run_ids: list[str]) -> set[str]:
        """Which of ``run_ids`` have a record (one round trip)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for run_id in run_ids:
                pipe.exists(keys.run(run_id))
            found = pipe.execute()
        return {rid for rid, n in zip(run_ids, found, strict=True) if n}

    def agents_by_id(self, agent_ids: list[str]) -> list[dict[str, str]]:
        """The records of ``agent_ids`` in order ({} where absent), in one round trip."""
        with self.redis.pipeline(transaction=False) as pipe:
            for aid in agent_ids:
                pipe.hgetall(keys.agent(aid))
            return [cast("dict[str, str]", row) for row in pipe.execute()]

    def run(self, run_id: str) -> Run | None:
        return self._run(run_id, _h(self.redis, keys.run(run_id)))

    @staticmethod
    def _run(run_id: str, row: dict[str, str]) -> Run | None:
        if not row:
            return None
        return Run(
            id=run_id, agent=row.get("agent", ""), request=row.get("request", ""),
            call_id=row.get("call_id", ""), message=row.get("message", ""),
            state=row.get("state", ""),
            output_schema=json.loads(row["output_schema"]) if row.get("output_schema") else None,
            result=json.loads(row["result"]) if row.get("result") else {},
            start_turn=int(row.get("start_turn") or 0),
            start_index=int(row.get("start_index") or -1),
            attempts=int(row.get("attempts") or 0),
            traceparent=row.get("traceparent", ""),
            swarm=row.get("swarm", ""),
        )

    def runs(self, run_ids: Iterable[str]) -> list[Run | None]:
        """The runs of ``run_ids`` in order (None where absent), in one round trip."""
        ids = list(run_ids)
        with self.redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hgetall(keys.run(rid))
            rows = pipe.execute()
        return [self._run(rid, cast("dict[str, str]", row))
                for rid, row in zip(ids, rows, strict=True)]

    def set_run(self, run_id: str, **fields: str | int | float) -> None:
        self.redis.hset(keys.run(run_id), mapping=dict(fields.items()))

    def start(self, run: Run, swarm_id: str, token: str, lease: float, host: str,
              from_state: str = "queued") -> Start | None:
        """Claim the run from ``from_state`` (or from an expired lease) into ``running`` (a
        resumed parent counts as in flight again) and read what its worker needs next, in
        one round trip; None (and nothing claimed) when its agent has no record of its
        swarm."""
        reply = self._start(
            keys=[keys.run(run.id), keys.agent(run.agent), keys.leases(),
                  keys.swarm_inflight(swarm_id), keys.session(run.agent),
                  keys.cancel(run.agent), keys.swarm_counters(swarm_id)],
            args=[token, time.time(), lease, from_state, host, run.id])
        if reply[0] == -1:
            return None
        if reply[0] == 0:
            return Start(False)
        _, flat, (meta, messages), cancelled, tokens = reply
        return Start(True, dict(zip(flat[::2], flat[1::2], strict=True)), meta, messages,
                     bool(cancelled), int(tokens or 0))

    def renew(self, run_id: str, token: str, lease: float, *, client: Any = None,
              until: float | None = None) -> bool:
        """Push the run's lease to ``until`` (default: now + ``lease``) if ``token`` still
        holds it. With ``client`` a pipeline, the answer comes from its ``execute()``."""
        until = time.time() + lease if until is None else until
        return bool(self._renew(keys=[keys.run(run_id), keys.leases()],
                                args=[token, until, run_id], client=client))

    def expired_leases(self, now: float | None = None, limit: int = 100) -> list[str]:
        """Runs whose worker stopped renewing their lease (it died or hangs)."""
        return cast("list[str]", self.redis.zrangebyscore(
            keys.leases(), "-inf", now or time.time(), start=0, num=limit))

    def settle(self, run: Run, swarm_id: str, state: str, result: dict[str, Any],
               usage: dict[str, int], token: str = "") -> bool:
        """Record a run's outcome once and announce it (on the settle stream, and as a
        ``settled`` progress event, before anyone can be woken by it); False if it had
        settled already, or if ``token`` is given and no longer holds the run's lease
        (a worker that lost its lease never overwrites its successor's result)."""
        assert state in SETTLED, state
        done = self._settle(
            keys=[keys.run(run.id), keys.agent(run.agent), keys.swarm_inflight(swarm_id),
                  keys.settle_stream(), keys.leases(), keys.request(run.request),
                  keys.events(swarm_id)],
            args=[state, json.dumps(result, ensure_ascii=False), f"{time.time():.3f}",
                  json.dumps(usage), "1" if run.agent else "0", run.id, run.request, run.agent,
                  keys.EVENTS_MAXLEN, str(result.get("error", ""))[:500], token,
                  keys.STREAM_MAXLEN])
        return bool(done == 1)

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, parent_id: str, swarm_id: str, turn: int,
                    calls: list[dict[str, Any]], results: dict[str, str],
                    parent_run: str = "") -> None:
        """Record a spawn request, park the parent, and put the request on the spawn
        stream (once)."""
        key = keys.request(request_id)
        if not self.redis.hsetnx(key, "id", request_id):
            return
        with self.redis.pipeline() as pipe:
            pipe.hset(keys.agent(parent_id), "state", "parked")
            if parent_run:
                pipe.hset(keys.run(parent_run), mapping={"state": "parked", "lease": ""})
                pipe.zrem(keys.leases(), parent_run)
                # A parked parent holds no slot: its children must be able to run.
                pipe.srem(keys.swarm_inflight(swarm_id), parent_run)
            pipe.hset(key, mapping={
                "parent": parent_id, "swarm": swarm_id, "turn": turn, "created": time.time(),
                "calls": json.dumps(calls, ensure_ascii=False),
                "results": json.dumps(results, ensure_ascii=False), "state": "new"})
            pipe.expire(key, self.ttl)
            pipe.xadd(keys.spawn_stream(), {"request": request_id},
                      maxlen=keys.STREAM_MAXLEN, approximate=True)
            pipe.execute()

    def request(self, request_id: str) -> dict[str, Any]:
        row = _h(self.redis, keys.request(request_id))
        if not row:
            return {}
        out: dict[str, Any] = dict(row)
        for name in ("calls", "results", "runs"):
            out[name] = json.loads(row[name]) if row.get(name) else ([] if name == "calls" else {})
        return out

    def request_head(self, request_id: str) -> dict[str, str]:
        """The small fields of a request (swarm, state, settled, count), without its calls
        and results: what a settlement needs to know whether the request is complete."""
        names = ["swarm", "state", "settled", "count"]
        row = self.redis.hmget(keys.request(request_id), names)
        return {k: cast(str, v) for k, v in zip(names, row, strict=True) if v is not None}

    def set_request(self, request_id: str, **fields: Any) -> None:
        self.redis.hset(keys.request(request_id), mapping={
            k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in fields.items()})

    # -- events ------------------------------------------------------------------------------

    def event(self, swarm_id: str, kind: str, agent_id: str, **data: Any) -> None:
        """Append a progress event to the swarm's stream (capped)."""
        self.event_to(self.redis, swarm_id, kind, agent_id, **data)

    @staticmethod
    def event_to(client: Any, swarm_id: str, kind: str, agent_id: str,
                 ts: float | None = None, **data: Any) -> None:
        """:meth:`event` on ``client`` (a Redis client or a pipeline), at time ``ts``."""
        fields = {"kind": kind, "agent": agent_id,
                  "ts": f"{time.time() if ts is None else ts:.3f}"}
        fields.update({k: str(v)[:500] for k, v in data.items()})
        client.xadd(keys.events(swarm_id), fields, maxlen=keys.EVENTS_MAXLEN, approximate=True)


def label_of(text: str, words: int = 8) -> str:
    """The first words of a task, for lists and Flower."""
    parts = text.split()
    label = " ".join(parts[:words])
    return label + (" ..." if len(parts) > words else "")
