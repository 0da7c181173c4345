"""Every Redis key name and TTL swarm uses, in one place.

All keys live under the ``swarm:`` prefix so one Redis can be shared with other
programs (and flushed by prefix). Functions build names; constants are TTLs in
seconds. Writes that use these keys are idempotent: saving a session replaces
it whole, a lock is set only when absent, hints are replaced whole.
"""

from __future__ import annotations

import hashlib

PREFIX = "swarm:"

#: A session lock lives this long unless its holder renews it (it renews every ttl/3).
LOCK_TTL = 30
#: An idle session is forgotten after this long (default of ``SWARM_SESSION_TTL``).
SESSION_TTL = 30 * 24 * 3600


def session_id_for(workspace: str) -> str:
    """The session id of a working directory: two folders, two conversations."""
    return hashlib.sha256(workspace.encode()).hexdigest()[:16]


def session(session_id: str) -> str:
    """Hash: ``meta`` (JSON: workspace, created, updated, usage) and ``messages`` (JSON list)."""
    return f"{PREFIX}session:{session_id}"


def sessions_index() -> str:
    """Sorted set of session ids scored by last update time (for ``swarm sessions``)."""
    return f"{PREFIX}sessions"


def lock(name: str) -> str:
    """String holding the owner token of a lock; expires by itself (PX)."""
    return f"{PREFIX}lock:{name}"


def hints(scope: str = "global") -> str:
    """String: the latest memory hints text of ``scope`` (the same text as ``hints.md``)."""
    return f"{PREFIX}hints:{scope}"
