"""One rate gate per swarm: when a child's model call is told to back off, all hold."""

from __future__ import annotations

import threading
import time
from typing import cast

import redis

from swarm.store import keys

#: Seconds a process trusts what it last read of a gate: a pause reaches the children of
#: other processes within this long (the process that paused knows at once).
FRESH = 0.25
_seen: dict[str, tuple[float, float]] = {}
_seen_lock = threading.Lock()


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
                with _seen_lock:
                    _seen[self.key] = (time.monotonic(), until)
        except redis.RedisError:
            pass

    def _until(self) -> float | None:
        """The gate's closing time, read at most every :data:`FRESH` seconds per process
        (every child of a swarm asks before each model call)."""
        now = time.monotonic()
        with _seen_lock:
            seen = _seen.get(self.key)
            if seen is not None:
                if now - seen[0] < FRESH:
                    return seen[1]
                # One thread reads; the siblings that ask meanwhile keep the last value.
                _seen[self.key] = (now, seen[1])
        try:
            until = float(cast("str | None", self.redis.get(self.key)) or 0)
        except redis.RedisError:
            return None
        with _seen_lock:
            if len(_seen) > 10_000:
                _seen.clear()
            _seen[self.key] = (now, until)
        return until
