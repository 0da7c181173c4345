"""Memory hints, the two kinds of :class:`swarm.agent.protocols.HintStore`.

- :class:`HomeHints`: the hints of a ``SWARM_HOME`` (``hints.md``, for people and this
  host), mirrored in Redis for every worker; a root agent's ``leave_memory_hints``
  replaces them.
- :class:`SwarmHints`: what a child sees: the home's hints plus the entries agents of its
  swarm added (a child's ``leave_memory_hints`` adds one, never touching ``hints.md``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import cast

import redis

from swarm.store import keys
from swarm.store.connection import store_errors

log = logging.getLogger(__name__)


class HomeHints:
    """The hints of a ``SWARM_HOME``: kept in a file and in Redis.

    The ``global`` scope uses ``home/hints.md``; another scope ``home/hints-<scope>.md``.
    """

    def __init__(self, redis: redis.Redis, home: Path, scope: str = "global") -> None:
        self.redis = redis
        self.scope = scope
        safe = re.sub(r"[^\w.-]", "_", scope)
        name = "hints.md" if scope == "global" else f"hints-{safe}.md"
        self.path = Path(home) / name

    def save(self, text: str) -> None:
        """Replace the hints in the file (atomically) and in Redis."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with store_errors("saving memory hints"):
            self.redis.set(keys.hints(self.scope), text)

    def load(self) -> str:
        """The hints in Redis, else the file's text (also when Redis is unreachable), else ""."""
        try:
            value = cast("str | None", self.redis.get(keys.hints(self.scope)))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("memory hints: Redis unreachable (%s); reading %s", exc, self.path)
            value = None
        return value if value is not None else self.file_text()

    def file_text(self) -> str:
        """The hints file's text, "" when there is none."""
        try:
            return self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return ""


#: Hints an agent of a swarm left, newest last; older ones are trimmed.
SWARM_HINTS_KEPT = 20


class SwarmHints:
    """The hints a child sees: the user's hints plus what agents of its swarm added.

    ``leave_memory_hints`` from any agent of the swarm adds an entry (it never replaces
    the user's ``hints.md``); every child started afterwards has them in its prompt.
    """

    def __init__(self, redis: redis.Redis, swarm_id: str, base: HomeHints,
                 agent_id: str = "") -> None:
        self.redis = redis
        self.swarm_id = swarm_id
        self.base = base
        self.agent_id = agent_id

    def save(self, text: str) -> None:
        key = keys.swarm_hints(self.swarm_id)
        entry = f"(from agent {self.agent_id})\n{text.strip()}" if self.agent_id else text.strip()
        with store_errors("adding swarm hints"), self.redis.pipeline() as pipe:
            pipe.rpush(key, entry)
            pipe.ltrim(key, -SWARM_HINTS_KEPT, -1)
            pipe.expire(key, keys.LEDGER_TTL)
            pipe.execute()

    def load(self) -> str:
        # The user's hints and the swarm's in one round trip (every child reads both once).
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(keys.hints(self.base.scope))
                pipe.lrange(keys.swarm_hints(self.swarm_id), 0, -1)
                value, shared = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("memory hints: Redis unreachable (%s); reading %s", exc, self.base.path)
            value, shared = None, []
        base = value if value is not None else self.base.file_text()
        parts = [cast(str, base).strip()]
        if shared:
            parts.append("## Hints left by agents of this swarm\n\n" + "\n\n".join(shared))
        return "\n\n".join(p for p in parts if p)
