"""One rate gate per swarm: when a child's model call is told to back off, all hold."""

from __future__ import annotations

import time
from typing import cast

import redis

from swarm.cache import TTLCache
from swarm.store import keys

#: Seconds a process trusts what it last read of a gate: a pause reaches the children of
#: other processes within this long (the process that paused knows at once).
FRESH = 0.25
#: Each gate's closing time as this process last read (or set) it.
_seen: TTLCache[str, float] = TTLCache(FRESH, maxsize=10_000)


class RedisRateGate:
    """:class:`swarm.llm.client.RateGate` shared by the children of one swarm."""

    def __init__(self, redis_: redis.Redis, swarm_id: str, longest: float = 60.0) -> None:
        self.redis = redis_
        self.key = keys.rate_gate(swarm_id)
        self.longest = longest

    def wait(self) -> None:
        until = self._until()
        if until is None:
            return  # no gate is better than no model
        left = min(until - time.time(), self.longest)
        if left > 0:
            time.sleep(left)

    def pause(self, seconds: float) -> None:
        until = time.time() + min(seconds, self.longest)
        try:
            current = float(cast("str | None", self.redis.get(self.key)) or 0)
            if until > current:
                self.redis.set(self.key, f"{until:.3f}", ex=int(self.longest) + 5)
                _seen.put(self.key, until)
        except redis.RedisError:
            pass

    def _until(self) -> float | None:
        """The gate's closing time, read at most every :data:`FRESH` seconds per process
        (every child of a swarm asks before each model call): one thread reads, the
        siblings that ask meanwhile keep the last value."""
        try:
            return _seen.get_or_load(self.key, self._read)
        except redis.RedisError:
            return None

    def _read(self) -> float:
        return float(cast("str | None", self.redis.get(self.key)) or 0)
