"""The coordinator's inbox: what it handled is acknowledged in one round trip a batch."""

from __future__ import annotations

from typing import Any

import pytest
import redis as redis_py

from swarm.broker.app import configure
from swarm.config import Settings
from swarm.coordinator.service import Coordinator
from swarm.store import keys
from swarm.store.ledger import Ledger
from tests.helpers import child_run, spawn_children


def xacks(redis: redis_py.Redis) -> int:
    return int(redis.info("commandstats").get("cmdstat_xack", {}).get("calls", 0))


def pending(redis: redis_py.Redis, stream: str) -> list[str]:
    return [row["message_id"] for row in redis.xpending_range(
        stream, keys.COORDINATORS, "-", "+", 100)]


def settled_children(redis: redis_py.Redis, *agents: str) -> Ledger:
    """Children of a root, parked and dispatched, then settled: a spawn entry and a settle
    entry each on the coordinators' streams."""
    ledger = Ledger(redis)
    ledger.open_inbox()
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent")
    spawn_children(ledger, "s1", "aparent", *agents)
    for agent in agents:
        run = ledger.run(child_run("aparent", agent))
        assert run is not None and ledger.settle(run, "s1", "done", {"answer": agent}, {})
    return ledger


def test_a_batch_of_entries_is_acknowledged_in_one_round_trip(
        redis_server: str, redis: redis_py.Redis) -> None:
    settled_children(redis, "a1", "a2", "a3")
    coordinator = Coordinator(redis, configure(redis_server), Settings(), name="inbox")
    before = xacks(redis)
    assert coordinator.poll(block_ms=0) == 4
    assert xacks(redis) - before == 2  # one a stream, not one an entry
    assert pending(redis, keys.spawn_stream()) == pending(redis, keys.settle_stream()) == []
    assert redis.hget(keys.request("q1"), "state") == "dispatched"  # the spawn was handled


def test_an_entry_whose_handling_lost_the_connection_stays_pending_after_those_before_it(
        redis_server: str, redis: redis_py.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    settled_children(redis, "a1", "a2")
    coordinator = Coordinator(redis, configure(redis_server), Settings(), name="inbox")
    handled: list[str] = []
    settled = coordinator.settled

    def flaky(run_id: str, *args: Any) -> None:
        if handled:
            raise redis_py.ConnectionError("Redis went away")
        handled.append(run_id)
        settled(run_id, *args)

    monkeypatch.setattr(coordinator, "settled", flaky)
    entries = redis.xrange(keys.settle_stream())
    with pytest.raises(redis_py.ConnectionError):
        coordinator.poll(block_ms=0)
    assert handled == [child_run("aparent", "a1")]
    assert pending(redis, keys.spawn_stream()) == []
    assert pending(redis, keys.settle_stream()) == [entries[1][0]]  # handled again later
