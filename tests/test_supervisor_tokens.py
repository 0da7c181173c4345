"""A worker's supervisor writes the tokens its children spent every TOKENS_EVERY seconds
(a command each write), not at every flush of their progress; a settling child's flush
writes them all."""

from __future__ import annotations

import redis as redis_py

from swarm.store import keys
from swarm.workers.supervisor import Supervisor, Watched
from tests.helpers import wait_until


def test_tokens_wait_for_their_interval_but_not_for_a_settling_childs_flush(
        redis: redis_py.Redis) -> None:
    supervisor = Supervisor(redis, 30.0, flush_every=0.01, tokens_every=3600.0)
    passes: list[int] = []
    supervisor.flush_hooks.append(lambda: passes.append(1))
    supervisor.add_tokens("s1", 5)
    watched = supervisor.watch(Watched("r1", "a1", "", limit=3600.0))
    try:
        wait_until(lambda: redis.hget(keys.swarm_counters("s1"), "tokens") == "5",
                   "the first pass's write of the tokens")
        supervisor.add_tokens("s1", 7)
        seen = len(passes)
        wait_until(lambda: len(passes) >= seen + 20, "20 more passes of the supervisor")
        assert redis.hget(keys.swarm_counters("s1"), "tokens") == "5"  # not yet: an hour
        supervisor.flush()  # a child settling
        assert redis.hget(keys.swarm_counters("s1"), "tokens") == "12"
    finally:
        supervisor.forget(watched)
