"""Every Redis key name and TTL swarm uses, in one place.

All keys live under the ``swarm:`` prefix so one Redis can be shared with other
programs (and flushed by prefix). Functions build names; constants are TTLs in
seconds. Writes that use these keys are idempotent: saving a session replaces
it whole, a lock is set only when absent, hints are replaced whole.
"""

from __future__ import annotations

import hashlib

# A session lock lives LOCK_TTL unless its holder renews it (every ttl/3); an idle session
# is forgotten after SESSION_TTL. They are the defaults of settings, so config owns them.
from swarm.config import LOCK_TTL as LOCK_TTL
from swarm.config import SESSION_TTL as SESSION_TTL

PREFIX = "swarm:"


def session_id_for(workspace: str) -> str:
    """The session id of a working directory: two folders, two conversations."""
    return hashlib.sha256(workspace.encode()).hexdigest()[:16]


def session(session_id: str) -> str:
    """Hash: ``meta`` (JSON: workspace, created, updated, usage) and ``messages`` (JSON list)."""
    return f"{PREFIX}session:{session_id}"


def sessions_index() -> str:
    """Sorted set of session ids scored by last update time (for ``swarm sessions``)."""
    return f"{PREFIX}sessions"


def session_lock(session_id: str) -> str:
    """The lock name (see :func:`lock`) that one swarm process holds on a session."""
    return f"session:{session_id}"


def lock(name: str) -> str:
    """String holding the owner token of a lock; expires by itself (PX)."""
    return f"{PREFIX}lock:{name}"


def lock_fence(name: str) -> str:
    """String holding the value of the last holder of lock ``name``: a holder whose lock
    expired while nobody else took it (a suspended process, Redis away) may take it back
    (see :class:`swarm.store.locks.RedisLock`). Lives :data:`LOCK_FENCE_TTL`."""
    return f"{PREFIX}lockfence:{name}"


#: Seconds a lock's fence outlives its last renewal: a laptop asleep overnight still
#: takes its lock back.
LOCK_FENCE_TTL = 7 * 24 * 3600


def hints(scope: str = "global") -> str:
    """String: the latest memory hints text of ``scope`` (the same text as ``hints.md``)."""
    return f"{PREFIX}hints:{scope}"


# -- berserk mode ---------------------------------------------------------------------------

#: Ledger entries (agents, runs, requests, swarms) live this long after their last write.
LEDGER_TTL = 7 * 24 * 3600
#: Progress events kept per swarm (XADD MAXLEN ~).
EVENTS_MAXLEN = 10_000
#: Entries kept on the spawn and settle streams (handled long before they are trimmed).
STREAM_MAXLEN = 100_000
#: A coordinator or worker counts as alive while its heartbeat key lives.
HEARTBEAT_TTL = 10

#: Consumer group of the coordinators on the spawn and settle streams.
COORDINATORS = "coordinators"


def swarm(swarm_id: str) -> str:
    """Hash: one swarm (root agent, workspace, task, settings and MCP servers that children
    inherit, state; a job's ``owner``, the id of the API token that submitted it, and its
    ``jobs_root``, the folder its workspace must stay beneath)."""
    return f"{PREFIX}swarm:{swarm_id}"


def swarm_agents(swarm_id: str) -> str:
    """Sorted set: every agent id of a swarm, scored by creation time."""
    return f"{PREFIX}swarm:{swarm_id}:agents"


def swarm_counters(swarm_id: str) -> str:
    """Hash of counters: ``children`` (ever created), ``refused`` (``agent`` calls refused),
    ``tokens`` (used by its agents, the root's counted with a token budget),
    ``snapshot_bytes`` (stored for its workspaces)."""
    return f"{PREFIX}swarm:{swarm_id}:counters"


def swarm_inflight(swarm_id: str) -> str:
    """Set of the run ids of a swarm that are enqueued or running (SADD/SREM: idempotent)."""
    return f"{PREFIX}swarm:{swarm_id}:inflight"


def leases() -> str:
    """Sorted set of running run ids scored by when their lease ends; the coordinators
    re-enqueue runs whose lease ran out (their worker died)."""
    return f"{PREFIX}leases"


def cancel(agent_id: str) -> str:
    """String, present when the agent (and so its subtree) is cancelled; value = reason."""
    return f"{PREFIX}cancel:{agent_id}"


def approvals(swarm_id: str) -> str:
    """Hash of a swarm's pending approval requests: id -> JSON (agent, tool, summary, ...)."""
    return f"{PREFIX}swarm:{swarm_id}:approvals"


def approval_answer(approval_id: str) -> str:
    """List the answer to one approval request is pushed to (the asking child BLPOPs it)."""
    return f"{PREFIX}approval:{approval_id}"


def swarm_approved(swarm_id: str) -> str:
    """Set of tools a person approved for the whole swarm ("always for this swarm")."""
    return f"{PREFIX}swarm:{swarm_id}:approved"


def rate_gate(swarm_id: str) -> str:
    """String: the time until which the swarm's children hold their model calls (a 429)."""
    return f"{PREFIX}swarm:{swarm_id}:gate"


def swarm_waiting(swarm_id: str) -> str:
    """List of run ids held back by the in-flight limit, oldest first."""
    return f"{PREFIX}swarm:{swarm_id}:waiting"


def swarm_hints(swarm_id: str) -> str:
    """List of memory hints left by agents of a swarm (trimmed to the newest)."""
    return f"{PREFIX}swarm:{swarm_id}:hints"


def swarms_index() -> str:
    """Sorted set of swarm ids by creation time (``swarm status`` picks the latest)."""
    return f"{PREFIX}swarms"


def agent(agent_id: str) -> str:
    """Hash: a ledger entry (id, swarm, parent, depth, state, workspace, usage, result, ...)."""
    return f"{PREFIX}agent:{agent_id}"


def run(run_id: str) -> str:
    """Hash: one run of a child for one ``agent`` call (request, call id, message, result)."""
    return f"{PREFIX}run:{run_id}"


def request(request_id: str) -> str:
    """Hash: a spawn request (parent, the calls, results of the parent's other calls)."""
    return f"{PREFIX}request:{request_id}"


def spawn_stream() -> str:
    """Stream of spawn requests for the coordinators (field ``request``)."""
    return f"{PREFIX}stream:spawn"


def settle_stream() -> str:
    """Stream of settled runs for the coordinators (fields ``run``, its ``request`` and
    ``held``, how many runs its swarm held then; ``freed`` instead: a swarm whose parent in
    a worker gave its slot back)."""
    return f"{PREFIX}stream:settle"


def events(swarm_id: str) -> str:
    """Stream of progress events of one swarm (capped at :data:`EVENTS_MAXLEN`)."""
    return f"{PREFIX}events:{swarm_id}"


def mailbox(agent_id: str) -> str:
    """Stream of the messages people sent to a running agent (``swarm say``), oldest first
    (fields ``text``, ``from``); its loop reads those after its session's ``said`` at its
    next turn boundary and deletes them once the session that holds them is saved."""
    return f"{PREFIX}mailbox:{agent_id}"


def background(agent_id: str) -> str:
    """List: the runs of an agent's background ``agent`` calls, in call order (a run's
    ``delivered`` field says whether its result reached the agent)."""
    return f"{PREFIX}background:{agent_id}"


def wake(agent_id: str) -> str:
    """List the coordinator pushes to when a parent waiting in a terminal may go on."""
    return f"{PREFIX}wake:{agent_id}"


# -- workspace snapshots (seeds of children, parked and settled workspaces) -----------------

#: A snapshot lives this long after it was last stored or read: longer than the ledger
#: entries of the runs that start from it.
SNAPSHOT_TTL = LEDGER_TTL + 24 * 3600
#: Bytes per chunk of a stored snapshot (one string key each).
SNAPSHOT_CHUNK = 512 * 1024


def snapshot(snapshot_id: str) -> str:
    """Hash: one stored snapshot (a git bundle): ``size``, ``chunks``, ``sha256``, ``base``
    (the snapshot it is a delta over, or ""), ``files``, ``origin`` host and ``odb`` (the
    git object store on that host that has it), ``local`` (its commit over the origin's
    ``HEAD``), ``subdir``, ``created``."""
    return f"{PREFIX}snapshot:{snapshot_id}"


def snapshot_chunk(snapshot_id: str, index: int) -> str:
    """String: chunk ``index`` of a snapshot's bundle."""
    return f"{PREFIX}snapshot:{snapshot_id}:{index}"


def snapshot_hosts(snapshot_id: str) -> str:
    """Hash: where a snapshot is: host -> bytes that host fetched for it (0: it was made
    there, or reached without a transfer)."""
    return f"{PREFIX}snapshot:{snapshot_id}:hosts"


def heartbeat(kind: str, name: str) -> str:
    """String with a TTL: a live coordinator or worker (``kind``) called ``name``."""
    return f"{PREFIX}alive:{kind}:{name}"


#: A host counts as coming back this long after its workers' last heartbeat (a restart on
#: a loaded machine, a short partition): its children's folders are waited for, not lost.
HOST_TTL = 60


def worker_host(host: str) -> str:
    """String with the TTL :data:`HOST_TTL`: a worker ran on ``host`` (its host name)."""
    return f"{PREFIX}host:{host}"


def worker_sandbox(name: str) -> str:
    """String with the heartbeat's TTL: where worker ``name`` runs commands (one line)."""
    return f"{PREFIX}sandbox:{name}"


# -- the HTTP service and schedules ---------------------------------------------------------

#: An "approval answered" marker lives this long (a second answer gets 409 meanwhile).
APPROVAL_ANSWERED_TTL = 3600
#: A schedule firing is remembered this long, so a redelivered firing starts no second job.
SCHEDULE_FIRE_TTL = 24 * 3600
#: Prefix of the celery-redbeat keys (entries ``<prefix><name>``, ``<prefix>:schedule``
#: sorted set, ``<prefix>:lock`` held by the one beat that fires).
REDBEAT_PREFIX = f"{PREFIX}beat:"


def serve_tokens() -> str:
    """Hash of the API tokens of ``swarm serve``: sha256(token) hex -> JSON (name, created,
    scope: ``user`` or ``admin``; none: made before scopes, admin). The tokens themselves are
    never stored."""
    return f"{PREFIX}serve:tokens"


def approval_swarm(approval_id: str) -> str:
    """String: the swarm an approval request was asked in (so a closed one is told of only
    to whom may see that swarm's job)."""
    return f"{PREFIX}approval:{approval_id}:swarm"


def approval_answered(approval_id: str) -> str:
    """String set (NX) when an approval request closes: by its first answer (from any
    terminal or the API), or by the child giving up (timeout, cancel)."""
    return f"{PREFIX}approval:{approval_id}:answered"


def schedules() -> str:
    """Hash of the schedules: name -> JSON (cron, task, approve, workspace, source, settings)."""
    return f"{PREFIX}schedules"


def schedule_fire(task_id: str) -> str:
    """String set (NX) when the firing with Celery task id ``task_id`` submitted its job."""
    return f"{PREFIX}schedule-fire:{task_id}"
