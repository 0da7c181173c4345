"""The coordinator's heartbeat costs a command a second, not one per pass of its loop."""

from __future__ import annotations

import threading
import time

import redis as redis_py

from swarm.broker.app import configure
from swarm.config import Settings
from swarm.coordinator.service import Coordinator
from swarm.store import keys
from tests.helpers import wait_until


def sets(redis: redis_py.Redis) -> int:
    return int(redis.info("commandstats").get("cmdstat_set", {}).get("calls", 0))


def test_a_coordinator_beats_once_a_second_however_many_passes_its_loop_makes(
        redis_server: str, redis: redis_py.Redis) -> None:
    coordinator = Coordinator(redis, configure(redis_server), Settings(), name="beats")
    passes: list[int] = []

    def poll(block_ms: int = 0) -> int:  # a pass per batch handled, as under load
        passes.append(1)
        return 0

    coordinator.poll = poll  # type: ignore[method-assign]
    before, started = sets(redis), time.monotonic()
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(passes) >= 300, "300 passes of the coordinator's loop")
    finally:
        coordinator.stop.set()
        thread.join(timeout=10)
    took = time.monotonic() - started
    assert redis.exists(keys.heartbeat("coordinator", "beats"))
    assert 1 <= sets(redis) - before <= took + 1  # a beat a second, not one a pass
