"""One rate gate per swarm: when a child's model call is told to back off, all hold."""

from __future__ import annotations

import time
from typing import cast

import redis

from swarm.store import keys


class RedisRateGate:
    """:class:`swarm.llm.client.RateGate` shared by the children of one swarm."""

    def __init__(self, redis_: redis.Redis, swarm_id: str, longest: float = 60.0) -> None:
        self.redis = redis_
        self.key = keys.rate_gate(swarm_id)
        self.longest = longest

    def wait(self) -> None:
        try:
            until = float(cast("str | None", self.redis.get(self.key)) or 0)
        except redis.RedisError:
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
        except redis.RedisError:
            pass
