"""The ledger: every state of a swarm's runs, and every transition between them.

- a **swarm** is one root job and every agent it spawned;
- an **agent** is a copy of the agent with its own session and workspace
  (:class:`~swarm.domain.records.AgentRecord`; its ``state`` follows its latest run);
- a **run** is one ``agent`` call handled by an agent
  (:class:`~swarm.domain.records.RunRecord`; a new child's first run, or a continuation
  by ``agent_id``; a job's root has one too);
- a **request** is the set of ``agent`` calls of one model response of a parent.

A run's life, and who moves it (each arrow is one method here, one Lua script or one
MULTI/EXEC transaction)::

      parent: park (its calls admitted: limits, checks, cancel, continuations)
             ┌────────────────┬──────────────────────────┐
             ▼                ▼                          │
          refused          queued ── coordinator: dispatch (claim; slots free?) ──┐
                              │ ◄──────── release ──── waiting ◄──── no ──────────┘
               worker: start  │  (a lease; reap re-sends a run whose lease ran out,
                              ▼   and the next start takes it over)
                           running ── renew ──┐
                         park │  │ ◄──────────┘
                              ▼  │ settle (fenced by the lease token; once)
                           parked│
                              │  ▼
     coordinator: join ───────┘ done | failed | cancelled | timed_out | refused
     (every child of its request settled: their results go into the parent's session;
      wake: a root in a terminal is woken, a parent in a worker gets a resume task,
      whose start claims the run from parked)

A request's life (:class:`~swarm.domain.records.RequestRecord`), beside its runs'::

      parent: park ──► new ── coordinator: dispatch ──► dispatching ── dispatched ──►
      dispatched ── join ──► answered (a parent in a worker) ── resumed ──► joined
                        └──► joined (a root in a terminal: woken in the join)

A background request (``agent(..., background: true)``) lives the same life up to
``dispatched``, but its parent never parked on it and it is never joined: its runs go on
the parent's background list, and each result reaches the parent once, when it asks. A
**wait** (a request of kind ``wait``) is what a parent parks on for them::

      parent: agent_join (or a final answer while some run) ── wait ──┬─► (all, or any,
              settled already: nothing written, the parent takes them: deliver)
                                                                      └─► waiting ──
      coordinator (a background run settled, the wait is met): answer_wait ──►
      answered (a parent in a worker) ── resumed ──► joined
      └──► joined (a root in a terminal: woken in the answer)

``deliver`` and ``answer_wait`` mark each run ``delivered`` as its result goes into the
parent's session: once, ever (``agent_cancel`` marks them so, undelivered).

``park`` writes the request with every call's run in one script (a refused call's run
settled ``refused``, counted in the request's ``settled``); ``dispatch`` claims it and puts
its runs in flight or holds them; a replay of a ``dispatching`` request (its coordinator
died sending) returns the runs still queued in flight and moves none.

``cancel`` flags an agent's subtree (workers stop it; a held run leaves the waiting list
and settles in one script).

Where each workspace is (:mod:`swarm.workspace.seed`): a new child's record names the
snapshot it starts from (``seed``, from its parent's ``agent`` call, written by
``park``), and ``park`` records the parent's workspace snapshot and host (``ws_state``,
``ws_host``) in the same transaction as the request, so a resume elsewhere restores it;
``place`` records where a workspace was made or restored, and the snapshot a settling
child left.

Ids are derived from (parent, turn, tool_call id), so a request replayed after a crash
maps to the same runs; records are created only when absent, and a run settles once.
Every lease, grace period and wall-time count is on the server's clock (``TIME`` in the
scripts): a run's ``used`` seconds grow only while it runs, whichever host runs it.
The coordinators read the spawn and settle streams through a consumer group
(:meth:`Ledger.read_inbox`). This module is long because it is the one place the state
machine lives; every Redis write of a transition is here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from redis.client import Pipeline
from redis.typing import EncodableT, FieldT

from swarm.domain.messages import Message
from swarm.domain.records import (
    ACTIVE,
    SETTLED,
    AgentRecord,
    RequestRecord,
    RootEnd,
    RootStart,
    RunRecord,
)
from swarm.domain.session import Session
from swarm.domain.spawn import BACKGROUND_SETTLED, Admission, Facts, Limits
from swarm.errors import LeaseLost, StoreError
from swarm.store import keys
from swarm.store.sessions import RedisSessionStore, write_session
from swarm.text import cap_middle

log = logging.getLogger(__name__)

__all__ = ["ACTIVE", "SETTLED", "AgentRecord", "Claim", "Joined", "Ledger", "NewRun", "RunRecord",
           "Start", "derive_id", "joined_text", "label_of", "new_swarm_id", "result_text"]

#: Seconds a run sent (or re-sent) has to be claimed before a coordinator sends it again
#: (``SWARM_TAKEOVER_GRACE``): a run in flight is covered by a lease from the moment it is
#: put in flight until a worker claims it, so nothing is lost when a coordinator dies before
#: its task went out, or the task is lost or fails before its claim (a worker died holding
#: it). A task that waits in the queue longer is sent again: the second delivery of a run is
#: a no-op. A parked parent whose request was joined is covered the same way until its
#: resume task is claimed.
TAKEOVER_GRACE = 60.0

_SWARM = "\x01"
"""Stands for the swarm id in a key name a script completes (:meth:`Ledger.dispatch`)."""

_SETTLED_LUA = "{" + ", ".join(f"'{s}'" for s in SETTLED) + "}"

# Leases, deadlines and grace periods are on the server's clock, never a host's: a worker
# or coordinator whose clock is skewed neither takes a run over early nor keeps a dead
# lease. (TIME in a script is allowed: scripts replicate their effects.)
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# Lua helpers shared by the scripts below. Each script names its keys and arguments in
# one table (K, from KEYS, in the order of the Python list built next to its call; A,
# decoded from the JSON object in ARGV[1]): no positional ARGV[n] to count.

# Write a table's fields into a hash in one HSET (a field at a time cost a command each:
# ~25 more commands a child when a park wrote its runs and agents so).
_HSET_ALL_FN = """
local function hset_all(key, fields)
  local flat = {}
  for k, v in pairs(fields) do
    flat[#flat + 1] = k
    flat[#flat + 1] = v
  end
  if #flat > 0 then redis.call('HSET', key, unpack(flat)) end
end
"""

# A running run stops running: the time since its claim is added to 'used'.
_PAUSE_FN = """
local function pause(run_key, now)
  local since = tonumber(redis.call('HGET', run_key, 'running_since') or '')
  if since then
    redis.call('HINCRBYFLOAT', run_key, 'used', math.max(0, now - since))
    redis.call('HDEL', run_key, 'running_since')
  end
end
"""

# Record a run's outcome once (fenced by its lease token when one is given) and announce
# it. K: run, agent, inflight, settle (stream), leases, request, events.
_SETTLE_FN = """
local function settle(K, A)
  local row = redis.call('HMGET', K.run, 'state', 'lease')
  local state = row[1]
  if state == false then return -1 end
  for _, s in ipairs(SETTLED_STATES) do
    if state == s then return 0 end
  end
  if A.token ~= '' and row[2] ~= A.token then
    return -2  -- fenced: another worker took this run over; its settlement counts
  end
  redis.call('HSET', K.run, 'state', A.state, 'result', A.result, 'settled', A.ts, 'lease', '')
  if A.agent ~= '' then
    redis.call('HSET', K.agent, 'state', A.state, 'settled', A.ts, 'usage', A.usage,
               unpack(A.place))
  end
  redis.call('SREM', K.inflight, A.run)
  redis.call('ZREM', K.leases, A.run)
  if A.request ~= '' then redis.call('HINCRBY', K.request, 'settled', 1) end
  if A.agent ~= '' then
    redis.call('XADD', K.events, 'MAXLEN', '~', A.events_maxlen, '*', 'kind', 'settled',
               'agent', A.agent, 'state', A.state, 'ts', A.ts, 'error', A.error)
  end
  -- 'held': how many runs of the swarm wait now. With none, the coordinator releases
  -- none for this settlement: a run held later was held with this slot free already.
  redis.call('XADD', K.settle, 'MAXLEN', '~', A.stream_maxlen, '*', 'run', A.run,
             'request', A.request, 'held', redis.call('LLEN', K.waiting))
  return 1
end
""".replace("SETTLED_STATES", _SETTLED_LUA)

_SETTLE_KEYS = """
local K = {run = KEYS[1], agent = KEYS[2], inflight = KEYS[3], settle = KEYS[4],
           leases = KEYS[5], request = KEYS[6], events = KEYS[7], waiting = KEYS[8]}
local A = cjson.decode(ARGV[1])
"""

_SETTLE = _SETTLE_FN + _SETTLE_KEYS + "return settle(K, A)"

# A held run of a cancelled agent leaves the waiting list and settles, in one step (a run
# released meanwhile is in flight: its worker sees the flag and stops it).
_CANCEL_HELD = _SETTLE_FN + _SETTLE_KEYS + """
if redis.call('LREM', K.waiting, 0, A.run) == 0 then return 0 end
return settle(K, A)
"""

# Held runs into flight while the swarm has free slots (oldest first).
_RELEASE_FN = """
local function release(waiting, inflight, leases, max_parallel, A, now)
  local free = tonumber(max_parallel) - redis.call('SCARD', inflight)
  if free <= 0 then return {} end
  local ids = redis.call('LPOP', waiting, free)
  if not ids then return {} end
  if not now then  -- read the clock only for runs to release (most calls release none)
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  redis.call('SADD', inflight, unpack(ids))
  redis.call('EXPIRE', inflight, A.ttl)
  for _, id in ipairs(ids) do
    redis.call('ZADD', leases, now + A.grace, id)
    local agent = redis.call('HGET', A.run_prefix .. id, 'agent')
    if agent and redis.call('HGET', A.agent_prefix .. agent, 'state') == 'waiting' then
      redis.call('HSET', A.agent_prefix .. agent, 'state', 'queued')
    end
  end
  return ids
end
"""

# What a run's task message carries (:meth:`Ledger._described`): run id, agent, trace
# context, swarm, depth, label, the parent's run, the host that must take it ("": any).
# ``r``: the run's state, agent, trace context and swarm when read already (nil: read
# here); a parent's run is read once a script (a request's runs share their parent).
_DESCRIBE_FN = """
local parent_runs = {}
local function describe(id, A, r)
  if not r then
    r = redis.call('HMGET', A.run_prefix .. id, 'state', 'agent', 'traceparent', 'swarm')
  end
  local agent = r[2] or ''
  local a = redis.call('HMGET', A.agent_prefix .. agent, 'depth', 'label', 'parent',
                       'workspace', 'ws_state', 'ws_host', 'swarm')
  local parent_run = ''
  if a[3] and a[3] ~= '' then
    if parent_runs[a[3]] == nil then
      parent_runs[a[3]] = redis.call('HGET', A.agent_prefix .. a[3], 'run') or ''
    end
    parent_run = parent_runs[a[3]]
  end
  local host = ''
  if a[4] and a[4] ~= '' and not (a[5] and a[5] ~= '') then host = a[6] or '' end
  return {id, agent, r[3] or '', r[4] or a[7] or '', a[1] or '?', a[2] or '', parent_run,
          host}
end
"""

_RELEASE = _RELEASE_FN + _DESCRIBE_FN + """
local K = {waiting = KEYS[1], inflight = KEYS[2], leases = KEYS[3]}
local A = cjson.decode(ARGV[1])
local out = {}
for _, id in ipairs(release(K.waiting, K.inflight, K.leases, A.max_parallel, A, nil)) do
  table.insert(out, describe(id, A))
end
return out
"""

# The claim, and in the same round trip what the worker reads next: the run, the agent's
# record, its session, whether it was cancelled while queued, what the swarm has spent.
# A run's wall time ('used') counts only while it runs: a park adds the time since
# 'running_since', and a takeover adds its dead predecessor's time up to its lease's end.
# Each record is read once and written once (a field at a time cost ~7 commands a claim).
# Its other keys are made here from the run's agent and swarm (A: their names, the swarm's
# with _SWARM for its id). -3: no such run; -1: its agent has no record of its swarm.
_START = _NOW + """
local A = cjson.decode(ARGV[1])
local function hash(key)
  local flat, out = redis.call('HGETALL', key), {}
  for i = 1, #flat, 2 do out[flat[i]] = flat[i + 1] end
  return out, flat
end
local run, run_flat = hash(KEYS[1])
local state = run.state
if not state then return {-3} end
for _, s in ipairs(SETTLED_STATES) do
  if state == s then return {0, state} end
end
if not run.agent or run.agent == '' then return {-1} end
local akey = A.agent_prefix .. run.agent
local agent = hash(akey)
if not agent.swarm then return {-1} end
local swarm = run.swarm
if not swarm or swarm == '' then swarm = agent.swarm end  -- a run from before runs had it
local lease = tonumber(run.lease_until or '0') or 0
if not (state == A.from_state or (state == 'running' and lease < now)) then
  return {0, state}
end
local used = tonumber(run.used or '0') or 0
if state == 'running' then
  local since = tonumber(run.running_since or '') or lease
  used = used + math.max(0, math.min(now, lease) - since)
end
local until_ = now + tonumber(A.lease)
redis.call('HSET', KEYS[1], 'state', 'running', 'lease', A.token, 'lease_until',
           tostring(until_), 'running_since', tostring(now), 'used', tostring(used),
           'attempts', tostring((tonumber(run.attempts or '0') or 0) + 1))
agent.state, agent.host = 'running', A.host
if agent.started then
  redis.call('HSET', akey, 'state', 'running', 'host', A.host)
else
  agent.started = string.format('%.3f', now)
  redis.call('HSET', akey, 'state', 'running', 'host', A.host, 'started', agent.started)
end
redis.call('ZADD', KEYS[2], until_, A.run)
if state == 'parked' then
  redis.call('SADD', (string.gsub(A.inflight, '\\1', swarm, 1)), A.run)
end
local flat = {}
for k, v in pairs(agent) do
  flat[#flat + 1] = k
  flat[#flat + 1] = v
end
return {1, flat, run_flat, swarm,
        redis.call('HMGET', A.session_prefix .. run.agent, 'meta', 'messages'),
        redis.call('EXISTS', A.cancel_prefix .. run.agent),
        redis.call('HGET', (string.gsub(A.counters, '\\1', swarm, 1)), 'tokens') or '',
        tostring(used)}
""".replace("SETTLED_STATES", _SETTLED_LUA)

_RENEW = _NOW + """
if redis.call('HGET', KEYS[1], 'lease') == ARGV[1] then
  local until_ = now + tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], 'lease_until', tostring(until_))
  redis.call('ZADD', KEYS[2], until_, ARGV[3])
  return 1
end
return 0
"""

# _RENEW for many runs at once (a worker's running children): one TIME and one ZADD for
# all. KEYS: leases, then the runs; ARGV: the lease, then each run's token, then its id.
_RENEW_ALL = _NOW + """
local n = #KEYS - 1
local until_ = now + tonumber(ARGV[1])
local out, members = {}, {}
for i = 1, n do
  if redis.call('HGET', KEYS[i + 1], 'lease') == ARGV[i + 1] then
    redis.call('HSET', KEYS[i + 1], 'lease_until', tostring(until_))
    members[#members + 1] = until_
    members[#members + 1] = ARGV[i + 1 + n]
    out[i] = 1
  else
    out[i] = 0
  end
end
if #members > 0 then redis.call('ZADD', KEYS[1], unpack(members)) end
return out
"""

#: Runs renewed by one call of _RENEW_ALL (a script's arguments are unpacked onto Lua's stack).
RENEW_BATCH = 500

# Who holds each run's lease now: its token while it runs and its lease has not run out on
# the server's clock, else ''. Read only.
_HOLDERS = _NOW + """
local out = {}
for i, key in ipairs(KEYS) do
  local row = redis.call('HMGET', key, 'state', 'lease', 'lease_until')
  local until_ = tonumber(row[3] or '') or 0
  if row[1] == 'running' and row[2] and row[2] ~= '' and until_ >= now then
    out[i] = row[2]
  else
    out[i] = ''
  end
end
return out
"""

# A claim given up at once (the run's workspace is on another host, whose worker should
# take it): its lease runs out now, so the coordinator sends it again at its next pass.
_HAND_BACK = _NOW + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease', '', 'lease_until', tostring(now))
redis.call('ZADD', KEYS[2], now, ARGV[2])
return 1
"""

# Runs put in flight get a grace lease (ARGV[1] seconds) until their task is sent and
# claimed; ARGV[2] == 'nx' keeps a lease already there.
_GRACE = _NOW + """
for i = 3, #ARGV do
  if ARGV[2] == 'nx' then
    redis.call('ZADD', KEYS[1], 'NX', now + tonumber(ARGV[1]), ARGV[i])
  else
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
  end
end
return 0
"""

_FINISH = _HSET_ALL_FN + """
local state = redis.call('HGET', KEYS[1], 'state')
if state == false then return 0 end
for _, s in ipairs(SETTLED_STATES) do
  if state == s then return 0 end
end
hset_all(KEYS[1], cjson.decode(ARGV[1]))
hset_all(KEYS[2], cjson.decode(ARGV[2]))
return 1
""".replace("SETTLED_STATES", _SETTLED_LUA)
"""Settle a swarm (and its root in a terminal) unless it settled already: a settled
swarm's record is frozen (a later run in its folder never changes it)."""

# A resumed run whose request is still out parks again, if its lease is still this one.
_STAY_PARKED = _NOW + _PAUSE_FN + """
local K = {run = KEYS[1], agent = KEYS[2], leases = KEYS[3], inflight = KEYS[4],
           settle = KEYS[5]}
local A = cjson.decode(ARGV[1])
if redis.call('HGET', K.run, 'lease') ~= A.token then return 0 end
pause(K.run, now)
redis.call('HSET', K.run, 'state', 'parked', 'lease', '')
redis.call('HSET', K.agent, 'state', 'parked')
redis.call('ZREM', K.leases, A.run)
redis.call('SREM', K.inflight, A.run)
redis.call('XADD', K.settle, 'MAXLEN', '~', A.stream_maxlen, '*', 'freed', A.swarm)
return 1
"""

# The parent parks (its run, if it runs in a worker, gives its lease and its slot back).
# K: parent, parent_run, leases, inflight; A: parent_run, ws_state, ws_host.
_PARK_PARENT_FN = """
local function park_parent(K, A, now)
  redis.call('HSET', K.parent, 'state', 'parked')
  if A.ws_state ~= '' then
    redis.call('HSET', K.parent, 'ws_state', A.ws_state, 'ws_host', A.ws_host)
  end
  if A.parent_run ~= '' then
    pause(K.parent_run, now)
    redis.call('HSET', K.parent_run, 'state', 'parked', 'lease', '')
    redis.call('ZREM', K.leases, A.parent_run)
    redis.call('SREM', K.inflight, A.parent_run)
  end
end
"""

# The parent waits for background runs (agent_join, or a final answer given while they
# run): 2 when any (A.any) or all of them settled already (nothing written: the parent
# takes their results itself); else the wait is written, each run names it (a settlement
# makes the coordinator look at it), the parent parks and its slot is announced free.
# 0: the wait exists (a replay); -1: the parent's lease is another worker's.
_WAIT = _NOW + _PAUSE_FN + _PARK_PARENT_FN + """
local K = {wait = KEYS[1], parent = KEYS[2], parent_run = KEYS[3], leases = KEYS[4],
           inflight = KEYS[5], settle = KEYS[6], events = KEYS[7]}
local A = cjson.decode(ARGV[1])
if redis.call('EXISTS', K.wait) == 1 then return 0 end
if A.parent_run ~= '' and A.token ~= '' and
    redis.call('HGET', K.parent_run, 'lease') ~= A.token then
  return -1
end
local settled = 0
for _, id in ipairs(A.run_ids) do
  local state = redis.call('HGET', A.run_prefix .. id, 'state')
  for _, s in ipairs(SETTLED_STATES) do
    if state == s then settled = settled + 1 end
  end
end
if settled > 0 and (A.any or settled == #A.run_ids) then return 2 end
park_parent(K, A, now)
for _, id in ipairs(A.run_ids) do redis.call('HSET', A.run_prefix .. id, 'waiter', A.wait) end
local ts = string.format('%.3f', now)
redis.call('HSET', K.wait, 'id', A.wait, 'parent', A.parent, 'swarm', A.swarm, 'kind', 'wait',
           'state', 'waiting', 'turn', A.turn, 'created', ts, 'runs', A.runs,
           'any', A.any and '1' or '0', 'call', A.call, 'results', A.results,
           'count', #A.run_ids, 'settled', settled)
redis.call('EXPIRE', K.wait, A.ttl)
if A.parent_run ~= '' then
  redis.call('XADD', K.settle, 'MAXLEN', '~', A.stream_maxlen, '*', 'freed', A.swarm)
end
redis.call('XADD', K.events, 'MAXLEN', '~', A.events_maxlen, '*', 'kind', 'wait',
           'agent', A.parent, 'ts', ts, 'children', #A.run_ids)
return 1
""".replace("SETTLED_STATES", _SETTLED_LUA)

# The parent takes the results of settled background runs not delivered yet, once each
# (A.tag names what took them); with A.any_state, unsettled ones too (dropped: cancelled).
_DELIVER = """
local A = cjson.decode(ARGV[1])
local out = {}
for _, id in ipairs(A.run_ids) do
  local key = A.run_prefix .. id
  local row = redis.call('HMGET', key, 'state', 'delivered')
  local ok = A.any_state
  for _, s in ipairs(SETTLED_STATES) do
    if row[1] == s then ok = true end
  end
  if row[1] and ok and (row[2] == false or row[2] == '') then
    redis.call('HSET', key, 'delivered', A.tag)
    redis.call('HDEL', key, 'waiter')
    table.insert(out, id)
  end
end
return out
""".replace("SETTLED_STATES", _SETTLED_LUA)

# The parent parks on its request: the request, its runs and their agents (new children,
# or continued ones), refused calls' runs settled ``refused``, the parent parked (its slot
# given back) and the request on the spawn stream. The parent decided each call
# (A.runs[i].refusal); the swarm's children limit and the cancel flag are checked here, on
# what the swarm has now. 0: the request exists (a replay); -1: the parent's lease is
# another worker's.
_PARK = _NOW + _PAUSE_FN + _PARK_PARENT_FN + _HSET_ALL_FN + """
local K = {request = KEYS[1], parent = KEYS[2], parent_run = KEYS[3], leases = KEYS[4],
           inflight = KEYS[5], counters = KEYS[6], agents = KEYS[7], cancel = KEYS[8],
           spawn = KEYS[9], events = KEYS[10], background = KEYS[11]}
local A = cjson.decode(ARGV[1])
if redis.call('EXISTS', K.request) == 1 then return 0 end
if A.parent_run ~= '' and A.token ~= '' and
    redis.call('HGET', K.parent_run, 'lease') ~= A.token then
  return -1
end
if A.background == '' then park_parent(K, A, now) end
local cancelled = redis.call('EXISTS', K.cancel) == 1
local children = tonumber(redis.call('HGET', K.counters, 'children') or '0') or 0
local created, refused, admitted = 0, 0, {}
local ts = string.format('%.3f', now)
for _, r in ipairs(A.runs) do
  local refusal = r.refusal
  if refusal == '' and cancelled then refusal = 'the parent was cancelled' end
  if refusal == '' and r.new_agent and children >= A.max_children then
    refusal = 'children limit reached: this swarm has spawned ' .. children .. ' of ' ..
      A.max_children .. ' (SWARM_MAX_CHILDREN); do this part yourself'
  end
  local run = r.run
  if refusal ~= '' then
    run.agent, run.state, run.settled = '', 'refused', ts
    run.result = cjson.encode({error = refusal})
    refused = refused + 1
  else
    local akey = A.agent_prefix .. run.agent
    if r.new_agent then
      r.agent.id, r.agent.run, r.agent.state = run.agent, r.id, 'queued'
      hset_all(akey, r.agent)
      redis.call('EXPIRE', akey, A.ttl)
      redis.call('ZADD', K.agents, 'NX', now, run.agent)
      created, children = created + 1, children + 1
    else
      redis.call('HSET', akey, 'run', r.id, 'state', 'queued')
    end
    redis.call('XADD', K.events, 'MAXLEN', '~', A.events_maxlen, '*', 'kind', 'queued',
               'agent', run.agent, 'ts', ts, 'parent', A.parent, 'depth', r.depth)
    table.insert(admitted, r.id)
  end
  local rkey = A.run_prefix .. r.id
  run.id = r.id
  hset_all(rkey, run)
  redis.call('EXPIRE', rkey, A.ttl)
end
if created > 0 then redis.call('HINCRBY', K.counters, 'children', created) end
if refused > 0 then redis.call('HINCRBY', K.counters, 'refused', refused) end
redis.call('EXPIRE', K.counters, A.ttl)
redis.call('HSET', K.request, 'id', A.request, 'parent', A.parent, 'swarm', A.swarm,
           'turn', A.turn, 'created', ts, 'calls', A.calls, 'results', A.results,
           'state', 'new', 'runs', A.runs_by_call, 'count', #A.runs, 'settled', refused,
           'refused', refused, 'max_parallel', A.max_parallel,
           'admitted', cjson.encode(admitted), 'kind', A.background)
redis.call('EXPIRE', K.request, A.ttl)
if A.background ~= '' and #admitted > 0 then
  redis.call('RPUSH', K.background, unpack(admitted))
  redis.call('EXPIRE', K.background, A.ttl)
  redis.call('HSET', K.parent, 'background', '1')
end
redis.call('XADD', K.spawn, 'MAXLEN', '~', A.stream_maxlen, '*', 'request', A.request)
redis.call('XADD', K.events, 'MAXLEN', '~', A.events_maxlen, '*', 'kind', 'spawn',
           'agent', A.parent, 'ts', ts, 'children', #A.runs)
return 1
"""

# A coordinator claims a request: new -> dispatching, its admitted runs in flight while
# the swarm has free slots (after the runs held before them; the parent gave its slot
# back), the rest held (waiting). A replay (dispatching: a coordinator died before its
# tasks all went out) returns its runs still queued in flight, without moving any run: a
# run that settled, or is held, stays so. Returns the state, whether every run settled,
# and the runs to send (:data:`_DESCRIBE_FN`); state 'old' for a request an older swarm
# wrote (no runs admitted by its parent), which it leaves alone.
_DISPATCH = _NOW + _RELEASE_FN + _DESCRIBE_FN + """
local A = cjson.decode(ARGV[1])
local row = redis.call('HMGET', KEYS[1], 'state', 'admitted', 'max_parallel', 'parent',
                       'count', 'refused', 'swarm')
local state = row[1]
if not state then return {'', 0, '', {}} end
if not row[2] and (state == 'new' or state == 'dispatching') then  -- no 'admitted'
  return {'old', 0, row[7], {}}
end
local function of_swarm(name) return (string.gsub(name, '\\1', row[7], 1)) end
local K = {request = KEYS[1], leases = KEYS[2], inflight = of_swarm(A.inflight),
           waiting = of_swarm(A.waiting), events = of_swarm(A.events)}
local send, rows = {}, {}
if state == 'new' or state == 'dispatching' then
  for _, id in ipairs(release(K.waiting, K.inflight, K.leases, row[3], A, now)) do
    table.insert(send, id)
  end
  local admitted = cjson.decode(row[2] or '[]')
  if state == 'new' then
    state = 'dispatching'
    local free = tonumber(row[3]) - redis.call('SCARD', K.inflight)
    for _, id in ipairs(admitted) do
      local r = redis.call('HMGET', A.run_prefix .. id, 'state', 'agent', 'traceparent',
                           'swarm')
      if r[1] == 'queued' then
        if free > 0 then
          redis.call('SADD', K.inflight, id)
          redis.call('ZADD', K.leases, now + A.grace, id)
          table.insert(send, id)
          rows[id] = r
          free = free - 1
        else
          redis.call('RPUSH', K.waiting, id)
          redis.call('HSET', A.agent_prefix .. r[2], 'state', 'waiting')
        end
      end
    end
    redis.call('EXPIRE', K.inflight, A.ttl)
    redis.call('EXPIRE', K.waiting, A.ttl)
    redis.call('HSET', K.request, 'state', state)
    local refused = tonumber(row[6] or '0') or 0
    redis.call('XADD', K.events, 'MAXLEN', '~', A.events_maxlen, '*', 'kind', 'dispatched',
               'agent', row[4], 'ts', string.format('%.3f', now),
               'children', tostring((tonumber(row[5]) or 0) - refused),
               'refused', tostring(refused))
  else
    for _, id in ipairs(admitted) do
      if redis.call('HGET', A.run_prefix .. id, 'state') == 'queued' and
          redis.call('SISMEMBER', K.inflight, id) == 1 then
        redis.call('ZADD', K.leases, 'NX', now + A.grace, id)
        table.insert(send, id)
      end
    end
  end
end
local out = {}
for _, id in ipairs(send) do table.insert(out, describe(id, A, rows[id])) end
local head = redis.call('HMGET', K.request, 'settled', 'count')
local complete = (tonumber(head[1]) or 0) >= (tonumber(head[2]) or 0) and 1 or 0
return {state, complete, row[7], out}
"""

# Its tasks went out: dispatching -> dispatched; returns whether every run settled
# meanwhile (1; the coordinator joins it then), 0 if not, -1 if it was not dispatching.
_DISPATCHED = """
if redis.call('HGET', KEYS[1], 'state') ~= 'dispatching' then return -1 end
redis.call('HSET', KEYS[1], 'state', 'dispatched')
local head = redis.call('HMGET', KEYS[1], 'settled', 'count')
return (tonumber(head[1]) or 0) >= (tonumber(head[2]) or 0) and 1 or 0
"""

# A request moves on only from the state the caller expects (a slow coordinator never
# moves a request back): ARGV[1] -> ARGV[2], with the field pairs ARGV[3..].
_ADVANCE = """
if redis.call('HGET', KEYS[1], 'state') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], unpack(ARGV, 3))
return 1
"""

# Runs whose lease ran out: pushed forward by the grace period (so a run is not re-sent
# on every pass while its task waits in the queue), returned if still running, still
# queued (its task never went out, was lost, or failed before its claim), or still parked
# (a parked run is in the leases only once its request was joined: its resume task was
# lost, or never went out).
_REAP = _NOW + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[3])
local out = {}
for _, id in ipairs(ids) do
  local state = redis.call('HGET', ARGV[4] .. id, 'state')
  if state == 'running' or state == 'queued' or state == 'parked' then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
    table.insert(out, id)
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
"""


def derive_id(prefix: str, *parts: object) -> str:
    """A short stable id from ``parts``: the same inputs always give the same id."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()
    return f"{prefix}{digest[:15]}"


def new_swarm_id() -> str:
    return "s" + secrets.token_hex(6)


def label_of(text: str, words: int = 8) -> str:
    """The first words of a task, for lists and Flower."""
    parts = text.split()
    label = " ".join(parts[:words])
    return label + (" ..." if len(parts) > words else "")


#: The most files a child's result names to its parent (the rest are counted).
FILES_SHOWN = 200


def result_text(run: RunRecord | None, call_id: str, cap: int = 0) -> str:
    """What the parent's model sees for one ``agent`` call. With ``cap``, a longer answer,
    output or error keeps its head and tail, as command output does, and the result says
    so and where the whole is (the child's session: ``swarm logs``)."""
    if run is None:
        return json.dumps({"state": "failed", "error": f"no run was recorded for call {call_id}"})
    agent_id = run.result.get("agent_id", run.agent)
    body: dict[str, Any] = {"agent_id": agent_id, "state": run.state}
    for name in ("error", "output", "answer", "workspace", "files_changed", "changes",
                 "usage", "delta", "seed", "host"):
        if run.result.get(name) not in (None, "", [], {}):
            body[name] = run.result[name]
    if "output" in body:
        body.pop("answer", None)
    cut = []
    for name in ("error", "answer", "output") if cap else ():
        if name not in body:
            continue
        text = body[name] if isinstance(body[name], str) else json.dumps(body[name],
                                                                          ensure_ascii=False)
        if len(text) > cap:
            body[name] = cap_middle(text, cap)
            cut.append(f"its {name} ({len(text)} characters)")
    files = body.get("files_changed")
    if isinstance(files, list) and len(files) > FILES_SHOWN:
        body["files_changed"] = [*files[:FILES_SHOWN], f"... {len(files) - FILES_SHOWN} more"]
        cut.append(f"its list of {len(files)} files changed")
    if cut:
        where = f"`swarm logs {agent_id}` shows it whole" if agent_id else "it is not kept"
        body["cut"] = (f"{' and '.join(cut)} cut to the first and last part here; {where}")
    return json.dumps(body, ensure_ascii=False, indent=1)


def joined_text(runs: list[RunRecord], pending: list[str], cap: int = 0) -> str:
    """What a parent's model sees for the background runs it takes: each one's result
    (as :func:`result_text`, with the ``call_id`` of the ``agent`` call that started it),
    and the ids of those it asked for that still run."""
    results = [{**json.loads(result_text(r, r.call_id, cap)), "call_id": r.call_id}
               for r in runs]
    body: dict[str, Any] = {"results": results}
    if pending:
        body["still_running"] = pending
    return json.dumps(body, ensure_ascii=False, indent=1)


@dataclass
class Start:
    """What :meth:`Ledger.start` found: whether the run was claimed and, if so, the run, its
    agent's record, its session's raw fields (None when it has none), whether the agent was
    cancelled while it waited, and the tokens its swarm had spent."""

    claimed: bool
    agent: dict[str, str] = field(default_factory=dict)
    session_meta: str | None = None
    session_messages: str | None = None
    cancelled: bool = False
    spent: int = 0
    used: float = 0.0
    """Seconds the run has run before this claim (earlier claims, on any host)."""
    run: RunRecord | None = None
    """The run as it was claimed (its swarm filled in from its agent's for an older one)."""
    state: str = ""
    """The run's state when it was not claimed (settled, or another worker's)."""

    @functools.cached_property
    def record(self) -> AgentRecord:
        """The agent's record (one, kept: a worker holds it while the child lives)."""
        record = AgentRecord.from_hash(self.agent)
        assert record is not None, "a claimed run has an agent record"
        return record


@dataclass
class NewRun:
    """A run about to be enqueued, with what its task message shows (Flower) and carries."""

    run: RunRecord
    new_agent: bool = True
    depth: int | str = "?"
    label: str = ""
    traceparent: str = ""
    parent_run: str = ""
    """The Celery task of the parent's run ("" for a root in a terminal)."""
    seed: str = ""
    """The snapshot a new child's workspace starts from ("": an empty folder)."""
    type: str = ""
    """A new child's declared agent type ("": a copy of its parent)."""
    host: str = ""
    """The host whose workers must take it ("": any): its agent's folder is there, with no
    snapshot to restore it from elsewhere (a child taken over mid-run)."""

    @classmethod
    def of(cls, run: RunRecord, record: AgentRecord | None) -> NewRun:
        """A run already in the ledger, with its agent's ``record``."""
        if record is None:
            return cls(run, new_agent=False, traceparent=run.traceparent)
        return cls(run, new_agent=False, depth=record.depth, label=record.label,
                   traceparent=run.traceparent)


@dataclass
class Claim:
    """What :meth:`Ledger.dispatch` did: the request's state now, whether every run of
    it has settled, and the runs to send."""

    request_id: str
    swarm_id: str
    state: str
    complete: bool
    send: list[NewRun]


@dataclass
class Joined:
    """A request whose children all settled, answered in its parent's session: the
    parent must be woken (a root was woken by the join itself; ``resume`` says a worker
    parent needs its resume task)."""

    request_id: str
    swarm_id: str
    parent: AgentRecord

    @property
    def resume(self) -> bool:
        return self.parent.kind != "root"


@dataclass
class Progress:
    """A child's tool start, as the worker's supervisor batches it."""

    swarm_id: str
    agent_id: str
    last: str
    turns: int
    tool: str
    ts: float


def _h(redis_: redis.Redis, key: str) -> dict[str, str]:
    return cast("dict[str, str]", redis_.hgetall(key))


def _fields(run: RunRecord, now: float, **more: str) -> dict[FieldT, EncodableT]:
    return cast("dict[FieldT, EncodableT]", {**run.to_hash(now), **more})


class Ledger:
    """The swarm's state in Redis; every method is one or a few round trips."""

    def __init__(self, redis_: redis.Redis, ttl: int = keys.LEDGER_TTL,
                 grace: float = TAKEOVER_GRACE) -> None:
        self.redis = redis_
        self.ttl = ttl
        self.grace = grace
        """Seconds a run put in flight, or a parent to resume, has to be claimed."""
        self._settle = redis_.register_script(_SETTLE)
        self._start = redis_.register_script(_START)
        self._renew = redis_.register_script(_RENEW)
        self._renew_all = redis_.register_script(_RENEW_ALL)
        self._hand_back = redis_.register_script(_HAND_BACK)
        self._release = redis_.register_script(_RELEASE)
        self._park = redis_.register_script(_PARK)
        self._dispatch = redis_.register_script(_DISPATCH)
        self._dispatched = redis_.register_script(_DISPATCHED)
        self._cancel_held = redis_.register_script(_CANCEL_HELD)
        self._reap = redis_.register_script(_REAP)
        self._advance = redis_.register_script(_ADVANCE)
        self._stay_parked = redis_.register_script(_STAY_PARKED)
        self._grace = redis_.register_script(_GRACE)
        self._holders = redis_.register_script(_HOLDERS)
        self._finish = redis_.register_script(_FINISH)
        self._wait = redis_.register_script(_WAIT)
        self._deliver = redis_.register_script(_DELIVER)

    def _transaction(self, fn: Any, *watch: str) -> Any:
        """``fn(pipe)`` under WATCH of ``watch``: it reads, calls ``pipe.multi()``, queues
        its writes and returns its answer; run again if a watched key changed meanwhile."""
        return self.redis.transaction(fn, *watch, value_from_callable=True)

    # -- swarms and jobs ------------------------------------------------------------------

    def create_swarm(self, swarm_id: str, root_id: str, workspace: str, task: str,
                     settings: dict[str, Any], host: str, session_id: str,
                     kind: str = "root", state: str = "running",
                     job: RunRecord | None = None, source: str = "",
                     mcp: dict[str, Any] | None = None, types: dict[str, Any] | None = None,
                     owner: str = "",
                     jobs_root: str = "", start: RootStart | None = None,
                     unconfined: bool = False) -> None:
        """Create a swarm and its root agent (idempotent). ``kind`` is ``root`` for a root
        in a terminal, ``job`` for a root that runs as a task (HTTP jobs, schedules),
        whose queued ``job`` run is written in the same transaction. ``mcp`` is the swarm's
        MCP configuration, fixed for its agents (a root's as it started, a job's as it was
        submitted); ``types`` its declared agent types, fixed the same way
        (:mod:`swarm.agent.agent_types`). A job's ``owner`` is the id of the API token that
        submitted it; its ``jobs_root`` the folder its workspace must stay beneath (the
        worker opens the workspace from there, never through a symbolic link). ``start`` is a root's
        folder session as the swarm began (:class:`~swarm.domain.records.RootStart`).
        ``unconfined``: a root in a
        terminal that runs its commands unconfined; its children may run unconfined too, on
        a local worker of its own server that cannot box them
        (:attr:`swarm.agent.sandbox.Choice.fallback`)."""
        now = time.time()
        with self.redis.pipeline() as pipe:
            pipe.hsetnx(keys.swarm(swarm_id), "id", swarm_id)
            pipe.hset(keys.swarm(swarm_id), mapping={
                "root": root_id, "workspace": workspace, "task": task[:500],
                "settings": json.dumps(settings), "created": now, "state": "running",
                **({"source": source} if source else {}),
                **({"owner": owner} if owner else {}),
                **({"jobs_root": jobs_root} if jobs_root else {}),
                **({"unconfined": "1"} if unconfined else {}),
                **({"mcp": json.dumps(mcp)} if mcp is not None else {}),
                **({"types": json.dumps(types)} if types else {})})
            pipe.zadd(keys.swarms_index(), {swarm_id: now}, nx=True)
            pipe.hset(keys.agent(root_id), mapping={
                "id": root_id, "swarm": swarm_id, "parent": "", "depth": 0, "kind": kind,
                "state": state, "workspace": workspace, "label": label_of(task),
                "created": now, "started": now, "host": host, "session": session_id})
            if start is not None:
                pipe.hset(keys.agent(root_id),
                          mapping=cast("dict[FieldT, EncodableT]", start.fields()))
            pipe.zadd(keys.swarm_agents(swarm_id), {root_id: now}, nx=True)
            for key in (keys.swarm(swarm_id), keys.agent(root_id), keys.swarm_agents(swarm_id)):
                pipe.expire(key, self.ttl)
            if job is not None:
                pipe.hsetnx(keys.run(job.id), "id", job.id)
                pipe.hset(keys.run(job.id), mapping=_fields(job, now))
                pipe.expire(keys.run(job.id), self.ttl)
                pipe.hset(keys.agent(root_id), "run", job.id)
                self._event(pipe, swarm_id, "queued", root_id, depth=0, parent="")
            pipe.execute()

    def finish_swarm(self, swarm_id: str, state: str, root_id: str = "",
                     end: RootEnd | None = None) -> bool:
        """The swarm (and, with ``root_id``, its root agent in a terminal, whose figures
        and answer for this swarm ``end`` freezes) ended. Once a swarm has settled its
        record never changes: False, and nothing written, if it had."""
        fields: dict[str, Any] = {"state": state, "settled": time.time()}
        root = dict(fields)
        if end is not None:
            fields["error"] = end.error
            root.update(end.fields())
        args = [json.dumps({k: str(v) for k, v in fields.items()}),
                json.dumps({k: str(v) for k, v in root.items()} if root_id else {})]
        return bool(self._finish(keys=[keys.swarm(swarm_id), keys.agent(root_id or swarm_id)],
                                 args=args))

    def swarm(self, swarm_id: str) -> dict[str, str]:
        return _h(self.redis, keys.swarm(swarm_id))

    def swarm_settings(self, swarm_id: str) -> dict[str, Any]:
        raw = self.redis.hget(keys.swarm(swarm_id), "settings")
        return cast("dict[str, Any]", json.loads(cast(str, raw))) if raw else {}

    def swarm_mcp(self, swarm_id: str) -> dict[str, Any] | None:
        """The MCP configuration recorded with the swarm; None before it is recorded."""
        raw = self.redis.hget(keys.swarm(swarm_id), "mcp")
        return cast("dict[str, Any]", json.loads(cast(str, raw))) if raw else None

    def swarm_types(self, swarm_id: str) -> dict[str, Any]:
        """The agent types recorded with the swarm (``{}``: none were declared)."""
        raw = self.redis.hget(keys.swarm(swarm_id), "types")
        return cast("dict[str, Any]", json.loads(cast(str, raw))) if raw else {}

    def jobs_root(self, swarm_id: str) -> str:
        """The folder a job's workspace must stay beneath ("": the swarm records none)."""
        return str(self.redis.hget(keys.swarm(swarm_id), "jobs_root") or "")

    def unconfined(self, swarm_id: str) -> bool:
        """Whether the swarm's root runs its commands unconfined (:meth:`create_swarm`)."""
        return self.redis.hget(keys.swarm(swarm_id), "unconfined") == "1"

    def latest_swarm(self) -> str | None:
        ids = cast("list[str]", self.redis.zrevrange(keys.swarms_index(), 0, 0))
        return ids[0] if ids else None

    # -- reads ------------------------------------------------------------------------------

    def agent(self, agent_id: str) -> AgentRecord | None:
        return AgentRecord.from_hash(_h(self.redis, keys.agent(agent_id)))

    def agents(self, swarm_id: str) -> list[AgentRecord]:
        ids = cast("list[str]", self.redis.zrange(keys.swarm_agents(swarm_id), 0, -1))
        return [row for row in self.agents_by_id(ids) if row is not None]

    def agents_by_id(self, agent_ids: list[str]) -> list[AgentRecord | None]:
        """The records of ``agent_ids`` in order (None where absent), in one round trip."""
        with self.redis.pipeline(transaction=False) as pipe:
            for aid in agent_ids:
                pipe.hgetall(keys.agent(aid))
            return [AgentRecord.from_hash(row) for row in pipe.execute()]

    def run(self, run_id: str) -> RunRecord | None:
        return RunRecord.from_hash(run_id, _h(self.redis, keys.run(run_id)))

    def runs(self, run_ids: Iterable[str]) -> list[RunRecord | None]:
        """The runs of ``run_ids`` in order (None where absent), in one round trip."""
        ids = list(run_ids)
        with self.redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hgetall(keys.run(rid))
            rows = pipe.execute()
        return [RunRecord.from_hash(rid, row) for rid, row in zip(ids, rows, strict=True)]

    def request(self, request_id: str) -> RequestRecord | None:
        return RequestRecord.from_hash(_h(self.redis, keys.request(request_id)))

    def request_of(self, run_id: str, request_id: str | None = None
                   ) -> tuple[str, dict[str, str]]:
        """The request a run answers, and its small fields (swarm, state, settled, count):
        what a settlement needs to know whether the request is complete. ``request_id``:
        the run's request as its settlement named it (None: read from the run)."""
        if request_id is None:  # a settlement written before they named it
            request_id = cast("str | None", self.redis.hget(keys.run(run_id), "request"))
        if not request_id:
            return "", {}
        names = ["swarm", "state", "settled", "count", "kind"]
        row = self.redis.hmget(keys.request(request_id), names)
        return request_id, {k: cast(str, v) for k, v in zip(names, row, strict=True)
                            if v is not None}

    def children_spawned(self, swarm_id: str) -> int:
        return int(self.redis.hget(keys.swarm_counters(swarm_id), "children") or 0)

    def is_cancelled(self, agent_id: str) -> bool:
        return bool(self.redis.exists(keys.cancel(agent_id)))

    def cancel_reason(self, agent_id: str) -> str | None:
        """Why ``agent_id`` was cancelled; None if it was not."""
        reason = self.redis.get(keys.cancel(agent_id))
        return None if reason is None else str(reason)

    def cancelled(self, agent_ids: list[str]) -> list[bool]:
        """Which of ``agent_ids`` are flagged cancelled: one MGET, one command whatever
        their number (a worker polls its running children's flags every half second)."""
        if not agent_ids:
            return []
        return [v is not None for v in self.redis.mget([keys.cancel(a) for a in agent_ids])]

    # -- the parent: park on a request ------------------------------------------------------

    def facts(self, parent_id: str, swarm_id: str, targets: Iterable[str],
              defaults: Limits | None = None) -> Facts:
        """What a parent reads to admit its ``agent`` calls, in one round trip: its record,
        the swarm's limits (recorded with it; ``defaults`` for those it does not record)
        and agent types, whether the parent was cancelled, the tokens spent, and the
        records of the children it continues (``targets``)."""
        targets = sorted(set(targets))
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.agent(parent_id))
            pipe.hmget(keys.swarm(swarm_id), ["settings", "types"])
            pipe.exists(keys.cancel(parent_id))
            pipe.hget(keys.swarm_counters(swarm_id), "tokens")
            for target in targets:
                pipe.hgetall(keys.agent(target))
            parent, (settings, types), cancelled, tokens, *rows = pipe.execute()
        recorded = json.loads(settings) if settings else {}
        limits = dataclasses.replace(defaults or Limits(), **{
            k: int(v) for k, v in recorded.items() if k in Limits.__dataclass_fields__})
        return Facts(parent=AgentRecord.from_hash(parent) or AgentRecord(parent_id, swarm_id),
                     limits=limits, types=frozenset(json.loads(types) if types else {}),
                     cancelled=bool(cancelled), spent=int(tokens or 0),
                     targets={t: AgentRecord.from_hash(r)
                              for t, r in zip(targets, rows, strict=True)})

    def park(self, request_id: str, parent_id: str, swarm_id: str, turn: int,
             admitted: list[Admission], results: dict[str, str], facts: Facts | None = None,
             parent_run: str = "", token: str = "", workspace_state: str = "",
             host: str = "", background: bool = False) -> bool:
        """Park the parent on its request (a parked parent holds no slot: its children
        must be able to run), in one script: the request, each call's run (``admitted``:
        the parent's decision on each call, :func:`swarm.domain.spawn.admit`; a refused
        call's run is settled ``refused`` at once) and each new or continued child's
        agent, and the request on the spawn stream; False (and nothing written) if the
        request exists already. The swarm's children limit and a cancel of the parent are
        checked in the script. With ``workspace_state``, the snapshot of the parent's
        workspace taken on ``host`` as it parked is recorded with it (a resume on another
        host restores it).

        A parent in a worker parks its run ``parent_run``, fenced by its lease ``token``:
        :class:`~swarm.errors.LeaseLost` if another worker holds the run now.

        ``background``: the same request, admitted and dispatched the same way, but the
        parent does not park (it goes on, holding its slot): its admitted runs join the
        parent's background list (:func:`keys.background`), and their results reach it
        only when it asks (:meth:`wait`, :meth:`deliver`)."""
        facts = facts or Facts(AgentRecord(parent_id, swarm_id), Limits())
        parent, now = facts.parent, time.time()
        runs = []
        for item in admitted:
            call = item.call
            run = RunRecord(
                id=derive_id("r", parent_id, turn, call["call_id"]), agent=item.agent_id,
                request=request_id, call_id=call["call_id"], message=call["message"],
                state="queued", output_schema=call.get("output_schema") or None,
                traceparent=str(call.get("traceparent") or ""), swarm=swarm_id,
                rebase=str(call.get("seed") or "") if item.continued else "")
            agent = {} if item.continued else {
                "swarm": swarm_id, "parent": parent_id, "depth": parent.depth + 1,
                "kind": "child", "workspace": "", "created": now, "host": "",
                "label": item.label or label_of(call["message"]),
                "parent_workspace": parent.workspace, "parent_host": parent.host,
                "seed": str(call.get("seed") or ""), "background": "0",
                **({"type": call["type"]} if call.get("type") else {})}
            runs.append({"id": run.id, "refusal": item.refusal, "new_agent": not item.continued,
                         "depth": str(parent.depth + 1),
                         "run": {k: str(v) for k, v in run.to_hash(now).items()},
                         "agent": {k: str(v) for k, v in agent.items()}})
        # KEYS of _PARK, by the names the script gives them.
        names = {"request": keys.request(request_id), "parent": keys.agent(parent_id),
                 "parent_run": keys.run(parent_run), "leases": keys.leases(),
                 "inflight": keys.swarm_inflight(swarm_id),
                 "counters": keys.swarm_counters(swarm_id),
                 "agents": keys.swarm_agents(swarm_id), "cancel": keys.cancel(parent_id),
                 "spawn": keys.spawn_stream(), "events": keys.events(swarm_id),
                 "background": keys.background(parent_id)}
        done = self._park(keys=list(names.values()), args=[json.dumps({
            "request": request_id, "parent": parent_id, "swarm": swarm_id, "turn": str(turn),
            "calls": json.dumps([a.call for a in admitted], ensure_ascii=False),
            "results": json.dumps(results, ensure_ascii=False),
            "runs_by_call": json.dumps({a.call["call_id"]: r["id"]
                                        for a, r in zip(admitted, runs, strict=True)}),
            "runs": runs, "parent_run": parent_run, "token": token,
            "ws_state": workspace_state, "ws_host": host,
            "max_children": facts.limits.max_children,
            "max_parallel": str(facts.limits.max_parallel),
            "background": "background" if background else "", **self._names()},
            ensure_ascii=False)])
        if done == -1:
            raise LeaseLost(f"run {parent_run}: another worker holds its lease now; "
                            "this one stops without parking it")
        return bool(done == 1)

    def _names(self) -> dict[str, Any]:
        """The arguments every script that builds run and agent keys, or caps a stream,
        takes."""
        return {"run_prefix": keys.run(""), "agent_prefix": keys.agent(""), "ttl": self.ttl,
                "grace": self.grace, "events_maxlen": keys.EVENTS_MAXLEN,
                "stream_maxlen": keys.STREAM_MAXLEN}

    def stay_parked(self, run: RunRecord, swarm_id: str, token: str) -> bool:
        """A resumed run found its request still out: back to parked, without its lease
        or its slot (the join resumes it), if ``token`` still holds the run. The freed
        slot is announced on the settle stream, so a coordinator releases a held run."""
        return bool(self._stay_parked(
            keys=[keys.run(run.id), keys.agent(run.agent), keys.leases(),
                  keys.swarm_inflight(swarm_id), keys.settle_stream()],
            args=[json.dumps({"token": token, "run": run.id, "swarm": swarm_id,
                              "stream_maxlen": keys.STREAM_MAXLEN})]))

    # -- the parent: background runs ---------------------------------------------------

    def background_runs(self, parent_id: str) -> list[RunRecord]:
        """The runs of ``parent_id``'s background calls, in call order (two round trips)."""
        ids = cast("list[str]", self.redis.lrange(keys.background(parent_id), 0, -1))
        return [r for r in self.runs(ids) if r is not None]

    def wait(self, wait_id: str, parent_id: str, swarm_id: str, turn: int,
             runs: dict[str, str], any_: bool, call_id: str, results: dict[str, str],
             parent_run: str = "", token: str = "", workspace_state: str = "",
             host: str = "") -> bool:
        """Park the parent until any (``any_``) or all of its background ``runs`` (agent id
        -> run id, none delivered yet) settle, to answer its call ``call_id`` ("": its final
        answer; ``results``: its other calls') with their results (:meth:`answer_wait`).
        False, and nothing written, when they settled already (the parent takes them
        itself, :meth:`deliver`). A replay writes nothing and parks. Fenced as
        :meth:`park` is."""
        names = [keys.request(wait_id), keys.agent(parent_id), keys.run(parent_run),
                 keys.leases(), keys.swarm_inflight(swarm_id), keys.settle_stream(),
                 keys.events(swarm_id)]
        done = self._wait(keys=names, args=[json.dumps({
            "wait": wait_id, "parent": parent_id, "swarm": swarm_id, "turn": str(turn),
            "run_ids": list(runs.values()), "runs": json.dumps(runs), "any": any_,
            "call": call_id, "results": json.dumps(results, ensure_ascii=False),
            "parent_run": parent_run, "token": token, "ws_state": workspace_state,
            "ws_host": host, **self._names()}, ensure_ascii=False)])
        if done == -1:
            raise LeaseLost(f"run {parent_run}: another worker holds its lease now; "
                            "this one stops without parking it")
        return bool(done != 2)

    def deliver(self, run_ids: list[str], tag: str, unsettled: bool = False
                ) -> list[RunRecord]:
        """Mark the settled runs of ``run_ids`` not delivered yet as delivered by ``tag``
        and return them (each run once, ever); ``unsettled``: the others too (dropped by a
        cancel: their results are never delivered)."""
        ids = cast("list[str]", self._deliver(args=[json.dumps({
            "run_ids": run_ids, "tag": tag, "any_state": unsettled,
            "run_prefix": keys.run("")})]))
        return [r for r in self.runs(ids) if r is not None]

    def tokens_of(self, agent_ids: list[str]) -> list[int]:
        """The tokens each agent's session has used so far (one round trip)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for aid in agent_ids:
                pipe.hget(keys.session(aid), "meta")
            metas = pipe.execute()
        return [int((json.loads(m).get("usage") or {}).get("total_tokens", 0)) if m else 0
                for m in metas]

    def take(self, session: Session, run_ids: list[str], tag: str,
             message: Callable[[list[RunRecord]], Message], session_ttl: int,
             index: bool) -> list[RunRecord]:
        """The parent takes the settled runs of ``run_ids`` not delivered yet, in one
        transaction: each marked delivered by ``tag``, and ``session`` written with
        ``message(them)`` appended and unparked (then changed so here too); a crash leaves
        both or neither: each result reaches the parent once. [] (nothing written) when none
        had settled."""
        rkeys = [keys.run(r) for r in run_ids]

        def take(pipe: Pipeline) -> tuple[list[RunRecord], Message | None]:
            runs = [RunRecord.from_hash(rid, cast("dict[str, str]", pipe.hgetall(key)))
                    for rid, key in zip(run_ids, rkeys, strict=True)]
            ready = [r for r in runs if r is not None and r.state in SETTLED
                     and not r.delivered]
            if not ready:
                return [], None
            said = message(ready)
            pipe.multi()
            for run in ready:
                pipe.hset(keys.run(run.id), "delivered", tag)
                pipe.hdel(keys.run(run.id), "waiter")
            write_session(pipe, dataclasses.replace(
                session, messages=[*session.messages, said], parked="", updated=time.time()),
                session_ttl, index)
            return ready, said

        ready, said = cast("tuple[list[RunRecord], Message | None]",
                           self._transaction(take, *rkeys))
        if said is not None:
            session.messages.append(said)
            session.parked = ""
        return ready

    def waiter_of(self, run_id: str) -> str:
        """The wait a background run's parent is parked on for it ("": none)."""
        return str(self.redis.hget(keys.run(run_id), "waiter") or "")

    # -- the coordinator: spawn, hold, release, refuse --------------------------------------

    def dispatch(self, request_id: str) -> Claim | None:
        """Claim a request (one script): a new one's admitted runs go in flight while the
        swarm has free slots, held (waiting) past them; held runs of the swarm that fit
        (the parent gave its slot back) go first. A replay (a coordinator died before its
        tasks all went out) returns the runs still queued in flight, moving none: a run
        settled or held meanwhile stays so. None for an unknown request;
        :class:`~swarm.errors.StoreError` for one written new (or left dispatching) by an
        older swarm, whose calls no parent admitted: it is refused, untouched."""
        # The swarm's keys are made in the script from the request's swarm (_SWARM in each
        # name stands for it): the claim reads nothing first.
        names = {name: fn(_SWARM) for name, fn in (
            ("inflight", keys.swarm_inflight), ("waiting", keys.swarm_waiting),
            ("events", keys.events))}
        state, complete, swarm_id, rows = self._dispatch(
            keys=[keys.request(request_id), keys.leases()],
            args=[json.dumps({**names, **self._names()})])
        if not state:
            return None
        if state == "old":
            raise StoreError(
                f"spawn request {request_id} of swarm {swarm_id} was written by an older "
                "swarm (its coordinator admitted the calls; now the parent does) and is "
                "left as it is: its parent waits for children that will not be sent. "
                f"Cancel that swarm (swarm cancel {swarm_id}) and run its task again; "
                "upgrade while no swarm is running to avoid this")
        return Claim(request_id, swarm_id, state, bool(complete), self._described(rows))

    def dispatched(self, request_id: str) -> bool:
        """The request's tasks went out: dispatching -> dispatched. True when every run
        of it has settled already (the caller joins it: no settlement will)."""
        return bool(self._dispatched(keys=[keys.request(request_id)]) == 1)

    def release(self, swarm_id: str, max_parallel: int) -> list[NewRun]:
        """Held runs into flight while the swarm has fewer than ``max_parallel``; returns
        them to send (one script)."""
        rows = self._release(
            keys=[keys.swarm_waiting(swarm_id), keys.swarm_inflight(swarm_id), keys.leases()],
            args=[json.dumps({"max_parallel": max_parallel, **self._names()})])
        return self._described(rows)

    @staticmethod
    def _described(rows: list[list[str]]) -> list[NewRun]:
        """Runs to send from the rows of :data:`_DESCRIBE_FN`."""
        out = []
        for run_id, agent, traceparent, swarm_id, depth, label, parent_run, host in rows:
            run = RunRecord(id=run_id, agent=agent, request="", call_id="", message="",
                            state="queued", traceparent=traceparent, swarm=swarm_id)
            out.append(NewRun(run, new_agent=False, depth=int(depth) if depth.isdigit()
                              else depth, label=label, traceparent=traceparent,
                              parent_run=parent_run, host=host))
        return out

    def _new_runs(self, run_ids: list[str]) -> list[NewRun]:
        """Runs to send, each with its agent's depth and label and its parent's run."""
        if not run_ids:
            return []
        runs = [r for r in self.runs(run_ids) if r is not None]
        records = self.agents_by_id([r.agent for r in runs])
        parents = sorted({r.parent for r in records if r is not None} - {""})
        with self.redis.pipeline(transaction=False) as pipe:
            for parent_id in parents:
                pipe.hget(keys.agent(parent_id), "run")
            parent_runs = dict(zip(parents, pipe.execute(), strict=True))
        out = []
        for run, record in zip(runs, records, strict=True):
            if not run.swarm and record is not None:
                run.swarm = record.swarm  # a record from before runs carried their swarm
            new = NewRun.of(run, record)
            new.parent_run = str(parent_runs.get(record.parent) or "") if record else ""
            if record is not None and record.workspace and not record.ws_state:
                new.host = record.ws_host
            out.append(new)
        return out

    # -- the worker: start, renew, settle ---------------------------------------------------

    def start(self, run_id: str, token: str, lease: float, host: str,
              from_state: str = "queued") -> Start | None:
        """Claim the run from ``from_state`` (or from an expired lease) into ``running`` (a
        resumed parent counts as in flight again) and read it and what its worker needs
        next, in one round trip; None (and nothing claimed) when there is no such run or its
        agent has no record of its swarm."""
        names = {"inflight": keys.swarm_inflight(_SWARM),
                 "counters": keys.swarm_counters(_SWARM)}
        reply = self._start(keys=[keys.run(run_id), keys.leases()], args=[json.dumps({
            "token": token, "lease": lease, "from_state": from_state, "host": host,
            "run": run_id, "agent_prefix": keys.agent(""), "session_prefix": keys.session(""),
            "cancel_prefix": keys.cancel(""), **names})])
        if reply[0] in (-1, -3):
            return None
        if reply[0] == 0:
            return Start(False, state=reply[1])
        _, flat, run_flat, swarm, (meta, messages), cancelled, tokens, used = reply
        run = RunRecord.from_hash(run_id, dict(zip(run_flat[::2], run_flat[1::2], strict=True)))
        assert run is not None
        run.swarm = swarm
        return Start(True, dict(zip(flat[::2], flat[1::2], strict=True)), meta, messages,
                     bool(cancelled), int(tokens or 0), float(used or 0), run=run)

    def begin(self, run_id: str, start_turn: int, start_index: int,
              usage: dict[str, int]) -> None:
        """A run's message is about to join its agent's history at ``start_index``."""
        self.redis.hset(keys.run(run_id), mapping={
            "start_turn": start_turn, "start_index": start_index,
            "result": json.dumps({"usage_at_start": usage})})

    def place(self, agent_id: str, workspace: str, host: str = "", state: str = "") -> None:
        """The agent's workspace is at ``workspace`` on ``host`` (ready, or restored there);
        with ``state``, the snapshot it can be restored from elsewhere (as it settled: a
        settling run's goes with its settlement, :meth:`settle`)."""
        self.redis.hset(keys.agent(agent_id), mapping=cast(
            "dict[FieldT, EncodableT]", self.where(workspace, host, state)))

    @staticmethod
    def where(workspace: str, host: str = "", state: str = "") -> dict[str, str]:
        """The fields of an agent's record that say where its workspace is (:meth:`place`)."""
        fields = {"workspace": workspace}
        if host:
            fields["ws_host"] = host
        if state:
            fields["ws_state"] = state
        return fields

    def reseed(self, agent_id: str, seed: str) -> None:
        """A continued child's workspace now starts from the snapshot ``seed`` (its
        parent's as it was called again): its work is taken against it from now on."""
        self.redis.hset(keys.agent(agent_id), "seed", seed)

    def landed(self, swarm_id: str, states: dict[str, str], request_id: str = "") -> None:
        """How each child's work came home in its parent's workspace (by agent id): on
        its record and as a ``landed`` event of the swarm (``swarm status``, the report,
        the HTTP API and its SSE). With ``request_id`` (the request they answered), once:
        told again (a Redis restart hid whether the first call went through), it writes
        nothing."""
        if not states:
            return
        request = keys.request(request_id) if request_id else ""

        def landed(pipe: Pipeline) -> None:
            if request and pipe.hexists(request, "landed"):
                return
            pipe.multi()
            for agent_id, state in states.items():
                pipe.hset(keys.agent(agent_id), "landing", state)
                self._event(pipe, swarm_id, "landed", agent_id, landing=state)
            if request:
                pipe.hset(request, "landed", "1")
                pipe.expire(request, self.ttl, nx=True)  # a request gone meanwhile

        self._transaction(landed, *([request] if request else []))

    def renew(self, run_id: str, token: str, lease: float, *, client: Any = None) -> bool:
        """Push the run's lease to ``lease`` seconds from now (the server's clock) if
        ``token`` still holds it. With ``client`` a pipeline, the answer comes from its
        ``execute()``."""
        return bool(self._renew(keys=[keys.run(run_id), keys.leases()],
                                args=[token, lease, run_id], client=client))

    def renew_all(self, leases: list[tuple[str, str]], lease: float) -> list[bool]:
        """:meth:`renew` of many runs, given as (run id, token): which still held theirs.
        One script a :data:`RENEW_BATCH` runs: a worker renews all its children at once."""
        out: list[bool] = []
        for i in range(0, len(leases), RENEW_BATCH):
            batch = leases[i:i + RENEW_BATCH]
            got = self._renew_all(keys=[keys.leases(), *(keys.run(r) for r, _ in batch)],
                                  args=[lease, *(t for _, t in batch), *(r for r, _ in batch)])
            out.extend(bool(x) for x in cast("list[int]", got))
        return out

    def lease_holders(self, run_ids: list[str]) -> dict[str, str]:
        """The lease token that holds each of ``run_ids`` now: "" for a run that is not
        running or whose lease ran out on the server's clock (its worker died or was cut
        off; a takeover claims it with a new token). One round trip."""
        if not run_ids:
            return {}
        got = cast("list[str]", self._holders(keys=[keys.run(r) for r in run_ids]))
        return dict(zip(run_ids, got, strict=True))
    def hand_back(self, run_id: str, token: str) -> bool:
        """Give up the claim ``token`` holds on the run at once (still ``running``, its lease
        run out): the coordinator's next reap sends it again, for another worker."""
        return bool(self._hand_back(keys=[keys.run(run_id), keys.leases()],
                                    args=[token, run_id]))

    def spend(self, swarm_id: str, tokens: int) -> int:
        """Add a model call's tokens to the swarm's count; returns the new total."""
        with self.redis.pipeline() as pipe:
            pipe.hincrby(keys.swarm_counters(swarm_id), "tokens", tokens)
            pipe.expire(keys.swarm_counters(swarm_id), self.ttl)
            return int(pipe.execute()[0])

    def counters(self, swarm_id: str) -> dict[str, int]:
        """The swarm's counters (:func:`keys.swarm_counters`): children, refused, tokens..."""
        return {k: int(v) for k, v in _h(self.redis, keys.swarm_counters(swarm_id)).items()}

    def report(self, progress: list[Progress], tokens: dict[str, int]) -> None:
        """What running children did since the last report, in one round trip: their last
        action and turn count, a ``tool`` event each, the tokens their swarms spent."""
        if not progress and not tokens:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for p in progress:
                pipe.hset(keys.agent(p.agent_id), mapping={"last": p.last, "turns": p.turns})
                self._event(pipe, p.swarm_id, "tool", p.agent_id, ts=p.ts, tool=p.tool,
                            text=p.last)
            for swarm_id, n in tokens.items():
                pipe.hincrby(keys.swarm_counters(swarm_id), "tokens", n)
            pipe.execute()

    def settle(self, run: RunRecord, swarm_id: str, state: str, result: dict[str, Any],
               usage: dict[str, int], token: str = "",
               place: dict[str, str] | None = None) -> bool:
        """Record a run's outcome once and announce it (on the settle stream, and as a
        ``settled`` progress event, before anyone can be woken by it); False if it had
        settled already, or if ``token`` is given and no longer holds the run's lease
        (a worker that lost its lease never overwrites its successor's result). ``place``:
        where its workspace is as it settles (:meth:`where`), written with the outcome."""
        assert state in SETTLED, state
        done = self._settle(keys=self._settle_keys(run, swarm_id),
                            args=[self._settle_args(run, state, result, usage, token, place)])
        return bool(done == 1)

    @staticmethod
    def _settle_keys(run: RunRecord, swarm_id: str) -> list[str]:
        """KEYS of _SETTLE and _CANCEL_HELD, in the order of their table K."""
        return [keys.run(run.id), keys.agent(run.agent), keys.swarm_inflight(swarm_id),
                keys.settle_stream(), keys.leases(), keys.request(run.request),
                keys.events(swarm_id), keys.swarm_waiting(swarm_id)]

    def _settle_args(self, run: RunRecord, state: str, result: dict[str, Any],
                     usage: dict[str, int], token: str = "",
                     place: dict[str, str] | None = None) -> str:
        """ARGV[1] of _SETTLE and _CANCEL_HELD: their table A."""
        return json.dumps({
            "state": state, "result": json.dumps(result, ensure_ascii=False),
            "ts": f"{time.time():.3f}", "usage": json.dumps(usage), "agent": run.agent,
            "run": run.id, "request": run.request, "token": token,
            "error": str(result.get("error", ""))[:500],
            "place": [x for kv in (place or {}).items() for x in kv], **self._names()})

    # -- the coordinator: reap, join, wake --------------------------------------------------

    def reap(self, grace: float | None = None, limit: int = 100) -> list[NewRun]:
        """Runs whose worker stopped renewing their lease (it died or hangs), or whose
        task (a parked parent's resume: its run is ``parked``) was not claimed in time, to
        re-send; their lease is pushed ``grace`` seconds on (default :attr:`grace`), so they
        are re-sent once per grace period until a worker claims them. A ``takeover`` event
        each."""
        grace = self.grace if grace is None else grace
        ids = cast("list[str]", self._reap(keys=[keys.leases()],
                                           args=["", grace, limit, keys.run("")]))
        runs = self._new_runs(ids)
        if runs:
            with self.redis.pipeline(transaction=False) as pipe:
                for new in runs:
                    self._event(pipe, new.run.swarm, "takeover", new.run.agent)
                pipe.execute()
        return runs

    def join(self, request_id: str, head: dict[str, str] | None = None,
             session_ttl: int = keys.SESSION_TTL, cap: int = 0) -> Joined | None:
        """When every run of the request has settled, append their results to the parent's
        session in call order and unpark it, in one transaction; a root is woken in the
        same transaction. ``cap``: the characters of a child's answer (or error) the parent
        gets, head and tail (:func:`result_text`; 0: whole). Returns what to wake, or None
        while runs are out. A worker parent's run is put in the leases with a grace period
        in the same transaction: if its resume task is lost (or never sent), :meth:`reap`
        returns it to resume again.

        ``head`` (state, settled and count of the request) spares reading the whole request
        on every settlement but the last. A request answered but whose worker parent was not
        resumed yet (a coordinator died in between) is returned again: resuming twice is a
        no-op."""
        if head is not None and (head.get("state") not in ("dispatched", "answered") or (
                head.get("count") and int(head.get("settled") or 0) < int(head["count"]))):
            return None
        req = self.request(request_id)
        if req is None or req.state not in ("dispatched", "answered") or req.kind:
            return None  # a background request is never joined: its parent asks (a wait)
        parent = self.agent(req.parent)
        if parent is None:
            return None
        joined = Joined(request_id, req.swarm, parent)
        if req.state == "answered":
            return joined
        if req.settled < len(req.runs):
            return None  # the runs are read once, when all are in
        runs = dict(zip(req.runs, self.runs(req.runs.values()), strict=True))
        if any(r is None or r.state not in SETTLED for r in runs.values()):
            return None
        rkey, skey = keys.request(request_id), keys.session(parent.session_id)

        def answer(pipe: Pipeline) -> Joined | None:
            state = pipe.hget(rkey, "state")
            meta, messages = cast("list[str | None]", pipe.hmget(skey, ["meta", "messages"]))
            session = RedisSessionStore.from_fields(parent.session_id, meta, messages)
            if state in ("answered", "joined"):
                return None  # another coordinator answered it meanwhile, and wakes it
            if session is not None and not session.parked:
                pipe.multi()  # answered before; the wake may not have gone out
                pipe.hset(rkey, "state", "answered" if joined.resume else "joined")
                if not joined.resume:
                    pipe.rpush(keys.wake(parent.id), request_id)
                elif parent.run:
                    self._grace(keys=[keys.leases()], args=[self.grace, "nx", parent.run],
                                client=pipe)
                return joined
            if state != "dispatched" or session is None or session.parked != request_id:
                log.warning("request %s: parent %s is not parked on it; not joined",
                            request_id, parent.id)
                return None
            _answer_calls(session, runs, req.results, cap)
            pipe.multi()
            write_session(pipe, session, session_ttl, index=not joined.resume)
            refused = sum(1 for r in runs.values() if r is not None and r.state == "refused")
            self._event(pipe, joined.swarm_id, "joined", parent.id,
                        children=len(runs) - refused, refused=refused)
            self._wake(pipe, joined, request_id)
            return joined

        return cast("Joined | None", self._transaction(answer, rkey, skey))

    def answer_wait(self, wait_id: str, session_ttl: int = keys.SESSION_TTL,
                    cap: int = 0) -> Joined | None:
        """When any (or all) of the background runs a parent waits on have settled, answer
        its call with their results (:func:`joined_text`: all in call order, any as they
        came), mark each delivered and unpark the parent, in one transaction; a root is
        woken in it. Returns what to wake, or None while the wait is not met (or was
        answered: a wait answered whose worker parent was not resumed yet is returned
        again, as :meth:`join` does)."""
        req = self.request(wait_id)
        if req is None or req.kind != "wait" or req.state not in ("waiting", "answered"):
            return None
        parent = self.agent(req.parent)
        if parent is None:
            return None
        joined = Joined(wait_id, req.swarm, parent)
        if req.state == "answered":
            return joined
        runs = [r for r in self.runs(req.runs.values()) if r is not None]
        ready = [r for r in runs if r.state in SETTLED and r.delivered in ("", wait_id)]
        if not ready or (not req.any and len(ready) < len(req.runs)):
            return None
        if req.any:
            ready.sort(key=lambda r: r.settled)
        pending = [r.agent for r in runs if r not in ready and not r.delivered]
        wkey, skey = keys.request(wait_id), keys.session(parent.session_id)

        def answer(pipe: Pipeline) -> Joined | None:
            state = pipe.hget(wkey, "state")
            meta, messages = cast("list[str | None]", pipe.hmget(skey, ["meta", "messages"]))
            session = RedisSessionStore.from_fields(parent.session_id, meta, messages)
            if state != "waiting" or session is None or session.parked != wait_id:
                log.warning("wait %s: parent %s is not parked on it; not answered",
                            wait_id, parent.id)
                return None
            text = joined_text(ready, pending, cap)
            if req.call:
                _answer_calls(session, {}, {**req.results, req.call: text})
            else:
                session.messages.append({"role": "user", "content": BACKGROUND_SETTLED + text})
                session.parked = ""
            pipe.multi()
            write_session(pipe, session, session_ttl, index=not joined.resume)
            for run in runs:
                pipe.hdel(keys.run(run.id), "waiter")
            for run in ready:
                pipe.hset(keys.run(run.id), "delivered", wait_id)
            self._event(pipe, joined.swarm_id, "joined", parent.id, children=len(ready),
                        refused=0)
            self._wake(pipe, joined, wait_id)
            return joined

        return cast("Joined | None", self._transaction(answer, wkey, skey))

    def _wake(self, pipe: Pipeline, joined: Joined, request_id: str) -> None:
        """In an answer's transaction: a worker parent's request is ``answered`` (joined
        once its resume is sent; its run covered until a worker claims it), a root's is
        ``joined`` and the root woken."""
        if joined.resume:
            pipe.hset(keys.request(request_id), "state", "answered")
            if joined.parent.run:
                self._grace(keys=[keys.leases()], args=[self.grace, "", joined.parent.run],
                            client=pipe)
        else:
            pipe.rpush(keys.wake(joined.parent.id), request_id)
            pipe.expire(keys.wake(joined.parent.id), self.ttl)
            pipe.hset(keys.request(request_id), "state", "joined")

    def resumed(self, request_id: str) -> None:
        """The parent's resume task was sent: the request is done with."""
        self._advance(keys=[keys.request(request_id)], args=["answered", "joined"])

    def wait_woken(self, agent_id: str, timeout: float) -> str | None:
        """Block up to ``timeout`` seconds for a root's wake-up; the request id, or None."""
        popped = self.redis.blpop([keys.wake(agent_id)], timeout=timeout)
        return cast("tuple[str, str]", popped)[1] if popped is not None else None

    # -- cancel -----------------------------------------------------------------------------

    def cancel(self, agent_id: str, reason: str = "cancelled by swarm cancel") -> list[str]:
        """Flag ``agent_id`` (an agent or a swarm id) and its subtree; returns the ids
        flagged that had not settled yet. Idempotent. Workers see the flags within a second
        and settle their agents ``cancelled``; queued runs settle when claimed, held runs
        settle now (they would wait for a slot just to stop), new spawns of a cancelled
        parent are refused."""
        record = self.agent(agent_id)
        if record is None:
            return []
        swarm_id = record.swarm
        agents = self.agents(swarm_id)
        ids = subtree(agents, agent_id)
        with self.redis.pipeline() as pipe:
            for aid in ids:
                pipe.set(keys.cancel(aid), reason, ex=self.ttl)
            self._event(pipe, swarm_id, "cancel", agent_id, text=reason)
            pipe.execute()
        for agent in agents:
            if agent.id in ids and agent.state == "waiting" and agent.run:
                run = self.run(agent.run)
                if run is not None:  # out of the waiting list and settled, in one step
                    self._cancel_held(keys=self._settle_keys(run, swarm_id), args=[
                        self._settle_args(run, "cancelled", {"error": reason}, {})])
        states = {a.id: a.state for a in agents}
        return [aid for aid in ids if states.get(aid) not in SETTLED]

    # -- the coordinators' inbox: the spawn and settle streams ------------------------------

    def open_inbox(self) -> None:
        """Create the coordinators' consumer group on both streams (idempotent)."""
        for stream in (keys.spawn_stream(), keys.settle_stream()):
            try:
                self.redis.xgroup_create(stream, keys.COORDINATORS, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def read_inbox(self, consumer: str, count: int, block_ms: int
                   ) -> list[tuple[str, str, dict[str, str]]]:
        """New entries for ``consumer``: (stream, entry id, fields)."""
        streams = {keys.spawn_stream(): ">", keys.settle_stream(): ">"}
        got = self.redis.xreadgroup(keys.COORDINATORS, consumer, streams,  # type: ignore[arg-type]
                                    count=count, block=block_ms)
        return [(stream, entry_id, fields) for stream, entries in cast(
            "list[tuple[str, list[tuple[str, dict[str, str]]]]]", got or [])
            for entry_id, fields in entries]

    def reclaim_inbox(self, consumer: str, idle_ms: int, count: int
                      ) -> list[tuple[str, str, dict[str, str]]]:
        """Entries another coordinator read but never acknowledged for ``idle_ms`` (it
        died), now ``consumer``'s."""
        out = []
        for stream in (keys.spawn_stream(), keys.settle_stream()):
            reply: list[Any] = self.redis.xautoclaim(stream, keys.COORDINATORS, consumer,
                                                     idle_ms, "0-0", count=count)
            out += [(stream, entry_id, fields) for entry_id, fields in reply[1] if fields]
        return out

    def ack(self, entries: list[tuple[str, str]]) -> None:
        """Acknowledge handled entries, given as (stream, entry id): one XACK a stream, in
        one round trip."""
        ids: dict[str, list[str]] = {}
        for stream, entry_id in entries:
            ids.setdefault(stream, []).append(entry_id)
        if not ids:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for stream, entry_ids in ids.items():
                pipe.xack(stream, keys.COORDINATORS, *entry_ids)
            pipe.execute()

    # -- events -----------------------------------------------------------------------------

    def event(self, swarm_id: str, kind: str, agent_id: str, **data: Any) -> None:
        """Append a progress event to the swarm's stream (capped)."""
        self._event(self.redis, swarm_id, kind, agent_id, **data)

    def events_since(self, swarm_id: str, last_id: str, count: int = 500,
                     block_ms: int | None = None) -> list[tuple[str, dict[str, str]]]:
        """The swarm's progress events after ``last_id`` ("0-0": from the start); with
        ``block_ms``, waits that long for one when there is none yet."""
        got = self.redis.xread({keys.events(swarm_id): last_id}, count=count, block=block_ms)
        return [entry for _, entries in cast(
            "list[tuple[str, list[tuple[str, dict[str, str]]]]]", got or []) for entry in entries]

    @staticmethod
    def _event(client: Any, swarm_id: str, kind: str, agent_id: str,
               ts: float | None = None, **data: Any) -> None:
        fields = {"kind": kind, "agent": agent_id,
                  "ts": f"{time.time() if ts is None else ts:.3f}"}
        fields.update({k: str(v)[:500] for k, v in data.items()})
        client.xadd(keys.events(swarm_id), fields, maxlen=keys.EVENTS_MAXLEN, approximate=True)


def subtree(agents: list[AgentRecord], agent_id: str) -> list[str]:
    """``agent_id`` and all its descendants, parents before children."""
    children: dict[str, list[str]] = {}
    for a in agents:
        children.setdefault(a.parent, []).append(a.id)
    out, todo = [], [agent_id]
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def _answer_calls(session: Session, runs: dict[str, RunRecord | None],
                  results: dict[str, str], cap: int = 0) -> None:
    """Answer the calls of the session's last assistant message in call order: ``agent``
    calls with their run's result, the others with what was recorded when it parked."""
    assistant = next((m for m in reversed(session.messages) if m.get("role") == "assistant"),
                     None)
    answered = {m.get("tool_call_id") for m in session.messages if m.get("role") == "tool"}
    for call in (assistant or {}).get("tool_calls") or []:
        cid = call.get("id")
        if cid in answered:
            continue
        content = (result_text(runs[cid], cid, cap) if cid in runs
                   else results.get(cid, "[no result was recorded for this call]"))
        session.messages.append({"role": "tool", "tool_call_id": cid, "content": content})
    session.parked = ""
    session.updated = time.time()
