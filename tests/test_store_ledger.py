"""Ledger.start (the claim and the reads a worker needs next, in one script) on a real server."""

from __future__ import annotations

import time

import redis as redis_py

from swarm.domain.session import Session
from swarm.store import keys
from swarm.store.ledger import Ledger, NewRun, Run
from swarm.store.sessions import RedisSessionStore

PARENT = {"id": "aparent", "workspace": "/work/parent", "host": "host-a"}


def add_child(ledger: Ledger, run_id: str = "r1", agent_id: str = "a1") -> Run:
    ledger.create_swarm("s1", "aparent", "/work/parent", "task", {}, "host-a", "aparent")
    run = Run(id=run_id, agent=agent_id, request="q1", call_id="c1", message="do it",
              state="queued")
    ledger.add_children("s1", PARENT, [NewRun(run, depth=1, label="do it")])
    got = ledger.run(run_id)
    assert got is not None
    return got


def test_start_claims_and_reads_the_record(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert run.swarm == "s1"  # the run carries its swarm: no read of the agent first
    start = ledger.start(run, run.swarm, "tok", 30.0, "host-b")
    assert start is not None and start.claimed
    assert start.agent["swarm"] == "s1" and start.agent["parent_workspace"] == "/work/parent"
    assert start.agent["state"] == "running" and start.agent["host"] == "host-b"
    assert (start.session_meta, start.session_messages, start.cancelled, start.spent) == \
        (None, None, False, 0)
    row = redis.hgetall(keys.run("r1"))
    assert (row["state"], row["lease"], row["attempts"]) == ("running", "tok", "1")
    assert redis.zscore(keys.leases(), "r1") is not None


def test_start_of_a_run_another_worker_holds(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    first = ledger.start(run, "s1", "tok1", 30.0, "host-a")
    second = ledger.start(run, "s1", "tok2", 30.0, "host-b")
    assert first is not None and first.claimed
    assert second is not None and not second.claimed and second.agent == {}
    assert redis.hget(keys.run("r1"), "lease") == "tok1"


def test_start_takes_over_an_expired_lease(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert ledger.start(run, "s1", "tok1", 0.01, "host-a").claimed  # type: ignore[union-attr]
    time.sleep(0.05)
    again = ledger.start(run, "s1", "tok2", 30.0, "host-b")
    assert again is not None and again.claimed
    assert redis.hget(keys.run("r1"), "attempts") == "2"


def test_start_reads_session_cancel_and_spent_tokens(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    sessions = RedisSessionStore(redis, index=False)
    sessions.save(Session(id="a1", workspace="/w", messages=[{"role": "user", "content": "hé"}],
                          usage={}, created=1.0, updated=2.0, turns=3))
    redis.set(keys.cancel("a1"), "1")
    redis.hset(keys.swarm_counters("s1"), "tokens", 1234)
    start = ledger.start(run, "s1", "tok", 30.0, "host-a")
    assert start is not None and start.claimed and start.cancelled and start.spent == 1234
    session = sessions.from_fields("a1", start.session_meta, start.session_messages)
    assert session is not None and session.turns == 3
    assert session.messages == [{"role": "user", "content": "hé"}]


def test_start_without_an_agent_record_claims_nothing(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = Run(id="r9", agent="agone", request="q", call_id="c", message="m", state="queued")
    ledger.add_run(run)
    assert ledger.start(run, "s1", "tok", 30.0, "host-a") is None
    assert redis.hget(keys.run("r9"), "state") == "queued"
    assert redis.hget(keys.agent("agone"), "state") == "queued"  # add_run's, not a claim's
