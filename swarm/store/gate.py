"""One rate gate per swarm: when a child's model call is told to back off, all hold."""

from __future__ import annotations

import threading
import time
from typing import cast

import redis

from swarm.cache import TTLCache
from swarm.store import keys

#: Seconds a process trusts what it last read of a gate: a pause reaches the children of
#: other processes within this long (the process that paused knows at once).
FRESH = 0.25
#: When each gate opens, as ``time.monotonic()`` of this process, as last read (or set).
_seen: TTLCache[str, float] = TTLCache(FRESH, maxsize=10_000)

# The gate's closing time is on the server's clock (hosts' clocks may disagree); a pause
# only ever pushes it later, in one step (two children told to back off at once do not
# race), and both scripts answer the seconds left.
_PAUSE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local until_ = now + tonumber(ARGV[1])
if until_ > current then
  redis.call('SET', KEYS[1], tostring(until_), 'EX', ARGV[2])
  current = until_
end
return tostring(current - now)
"""
_LEFT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return tostring((tonumber(redis.call('GET', KEYS[1]) or '0') or 0) - now)
"""


class RedisRateGate:
    """:class:`swarm.llm.client.RateGate` shared by the children of one swarm."""

    def __init__(self, redis_: redis.Redis, swarm_id: str, longest: float = 60.0) -> None:
        self.redis = redis_
        self.key = keys.rate_gate(swarm_id)
        self.longest = longest
        self._pause = redis_.register_script(_PAUSE)
        self._left = redis_.register_script(_LEFT)

    def wait(self, stop: threading.Event | None = None) -> None:
        """Hold while the gate is closed (not past ``stop`` being set)."""
        opens = self._opens()
        if opens is None:
            return  # no gate is better than no model
        left = min(opens - time.monotonic(), self.longest)
        if left > 0:
            if stop is None:
                time.sleep(left)
            else:
                stop.wait(left)

    def pause(self, seconds: float) -> None:
        """Close the gate for ``seconds`` (at most ``longest``) unless it is closed longer."""
        try:
            left = float(cast(str, self._pause(
                keys=[self.key], args=[min(seconds, self.longest), int(self.longest) + 5])))
        except redis.RedisError:
            return
        _seen.put(self.key, time.monotonic() + left)

    def _opens(self) -> float | None:
        """When the gate opens, read at most every :data:`FRESH` seconds per process
        (every child of a swarm asks before each model call): one thread reads, the
        siblings that ask meanwhile keep the last value."""
        try:
            return _seen.get_or_load(self.key, self._read)
        except redis.RedisError:
            return None

    def _read(self) -> float:
        return time.monotonic() + float(cast(str, self._left(keys=[self.key])))
