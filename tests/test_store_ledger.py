"""The ledger's transitions on a real server: park (limits, refusals), dispatch (holds),
release, start, stay parked, settle, reap, join, cancel. Each is atomic and idempotent."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial

import pytest
import redis as redis_py

from swarm.domain.records import RootEnd, RootStart
from swarm.domain.session import Session
from swarm.domain.spawn import Admission, SpawnCall
from swarm.errors import LeaseLost, StoreError
from swarm.runtime.spawner import RedisSpawner
from swarm.store import keys
from swarm.store.ledger import TAKEOVER_GRACE, Claim, Ledger, RunRecord, derive_id, result_text
from swarm.store.sessions import RedisSessionStore
from tests.helpers import child_run, round_trips, scripts_run, spawn_children

R1, R2, R3, R4 = (child_run("aparent", f"a{n}") for n in (1, 2, 3, 4))


def swarm_with(ledger: Ledger, *agents: str, **settings: int) -> Claim:
    """Swarm s1 (root aparent, recording ``settings``) whose root spawned ``agents``."""
    ledger.create_swarm("s1", "aparent", "/work/parent", "task", settings, "host-a",
                        "aparent")
    return spawn_children(ledger, "s1", "aparent", *agents)


def add_child(ledger: Ledger) -> RunRecord:
    """Child a1 of swarm s1, its run R1 in flight."""
    swarm_with(ledger, "a1")
    got = ledger.run(R1)
    assert got is not None
    return got


# -- start --------------------------------------------------------------------------------


def test_start_claims_and_reads_the_record(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert run.swarm == "s1"  # the run carries its swarm: no read of the agent first
    start = ledger.start(run.id, "tok", 30.0, "host-b")
    assert start is not None and start.claimed
    record = start.record
    assert record.swarm == "s1" and record.parent_workspace == "/work/parent"
    assert record.state == "running" and record.host == "host-b"
    assert abs(record.started - server_now(redis)) < 5  # its first run began now
    assert (start.session_meta, start.session_messages, start.cancelled, start.spent) == \
        (None, None, False, 0)
    row = redis.hgetall(keys.run(R1))
    assert (row["state"], row["lease"], row["attempts"]) == ("running", "tok", "1")
    assert redis.zscore(keys.leases(), R1) is not None


def test_a_run_written_before_runs_carried_their_swarm_is_claimed_in_its_agents(
        redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    add_child(ledger)
    redis.hdel(keys.run(R1), "swarm")
    start = ledger.start(R1, "tok", 30.0, "host-b")
    assert start is not None and start.claimed and start.run is not None
    assert (start.run.id, start.run.agent, start.run.swarm) == (R1, "a1", "s1")
    assert start.run.message == "do a1" and start.run.state == "queued"  # as it was claimed


def test_a_settled_run_is_not_claimed_and_says_its_state(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert ledger.settle(run, "s1", "done", {}, {})
    start = ledger.start(R1, "tok", 30.0, "host-b")
    assert start is not None and not start.claimed and start.state == "done"
    assert redis.hget(keys.run(R1), "lease") == ""


def test_start_of_a_run_another_worker_holds(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    first = ledger.start(run.id, "tok1", 30.0, "host-a")
    second = ledger.start(run.id, "tok2", 30.0, "host-b")
    assert first is not None and first.claimed
    assert second is not None and not second.claimed and second.agent == {}
    assert redis.hget(keys.run(R1), "lease") == "tok1"


def test_start_takes_over_an_expired_lease(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert ledger.start(run.id, "tok1", 30.0, "host-a").claimed  # type: ignore[union-attr]
    redis.hset(keys.run(R1), "lease_until", time.time() - 1)  # the worker stopped renewing
    again = ledger.start(run.id, "tok2", 30.0, "host-b")
    assert again is not None and again.claimed
    assert redis.hget(keys.run(R1), "attempts") == "2"


def test_start_reads_session_cancel_and_spent_tokens(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    sessions = RedisSessionStore(redis, index=False)
    sessions.save(Session(id="a1", workspace="/w", messages=[{"role": "user", "content": "hé"}],
                          usage={}, created=1.0, updated=2.0, turns=3))
    ledger.cancel("a1")
    ledger.spend("s1", 1234)
    start = ledger.start(run.id, "tok", 30.0, "host-a")
    assert start is not None and start.claimed and start.cancelled and start.spent == 1234
    session = sessions.from_fields("a1", start.session_meta, start.session_messages)
    assert session is not None and session.turns == 3
    assert session.messages == [{"role": "user", "content": "hé"}]


def test_start_without_an_agent_record_claims_nothing(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = RunRecord(id="r9", agent="agone", request="q", call_id="c", message="m",
                    state="queued")
    assert ledger.start(run.id, "tok", 30.0, "host-a") is None  # no such run
    redis.hset(keys.run("r9"), mapping=run.to_hash(0.0))
    assert ledger.start(run.id, "tok", 30.0, "host-a") is None  # no such agent
    assert redis.hget(keys.run("r9"), "state") == "queued"
    assert not redis.exists(keys.agent("agone")) and not redis.zscore(keys.leases(), "r9")


def server_now(redis: redis_py.Redis) -> float:
    seconds, micros = redis.time()
    return float(seconds) + micros / 1e6


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
def test_leases_and_grace_periods_are_on_the_servers_clock(
        redis: redis_py.Redis, monkeypatch: pytest.MonkeyPatch, skew: float) -> None:
    """A host whose clock is an hour fast (or slow) neither takes a run over early nor
    gives a lease an hour too long: every deadline is the server's TIME plus a duration."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew)
    ledger = Ledger(redis)
    run = add_child(ledger)  # put in flight: a grace lease
    assert abs(redis.zscore(keys.leases(), R1) - (server_now(redis) + TAKEOVER_GRACE)) < 5
    start = ledger.start(run.id, "tok", 30.0, "host-a")
    assert start is not None and start.claimed
    assert ledger.renew(R1, "tok", 30.0)
    until = float(redis.hget(keys.run(R1), "lease_until"))
    assert abs(until - (server_now(redis) + 30)) < 5
    assert abs(redis.zscore(keys.leases(), R1) - until) < 1e-3
    assert ledger.reap(60.0) == []  # a fast coordinator reaps nothing early
    other = ledger.start(run.id, "intruder", 30.0, "host-b")  # nor can a fast worker
    assert other is not None and not other.claimed


def test_renew_all_pushes_the_leases_its_tokens_still_hold_in_one_script(
        redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    swarm_with(ledger, "a1", "a2", "a3")
    runs = {1: R1, 2: R2, 3: R3}
    for n in (1, 2, 3):
        run = ledger.run(runs[n])
        assert run is not None and ledger.start(run.id, f"tok{n}", 5.0, "host-a")
    before = {n: float(redis.hget(keys.run(runs[n]), "lease_until")) for n in (1, 2, 3)}
    scripts = scripts_run(redis)
    assert ledger.renew_all([(R1, "tok1"), (R2, "stolen"), (R3, "tok3")], 60.0) == \
        [True, False, True]
    assert scripts_run(redis) == scripts + 1
    for n in (1, 3):
        until = float(redis.hget(keys.run(runs[n]), "lease_until"))
        assert abs(until - (server_now(redis) + 60)) < 5 and until > before[n]
        assert abs(redis.zscore(keys.leases(), runs[n]) - until) < 1e-3
    assert float(redis.hget(keys.run(R2), "lease_until")) == before[2]  # not its token
    assert ledger.renew_all([], 60.0) == []


def test_a_runs_wall_time_counts_across_parks_and_takeovers(redis: redis_py.Redis) -> None:
    """Time running counts (on the server's clock); time parked does not; a takeover
    charges its dead predecessor's time up to the end of its lease."""
    ledger = Ledger(redis)
    run = add_child(ledger)
    first = ledger.start(run.id, "tok1", 30.0, "host-a")
    assert first is not None and first.claimed and first.used == 0
    redis.hset(keys.run(R1), "running_since", server_now(redis) - 100)  # ran 100 s
    assert ledger.park("q9", "a1", "s1", 2, [], {}, parent_run=R1, token="tok1")
    assert 99 < float(redis.hget(keys.run(R1), "used")) < 105
    redis.hset(keys.run(R1), "used", 100)
    assert not redis.sismember(keys.swarm_inflight("s1"), R1)  # its slot given back
    resumed = ledger.start(run.id, "tok2", 30.0, "host-b", from_state="parked")
    assert resumed is not None and resumed.claimed and resumed.used == 100
    assert redis.sismember(keys.swarm_inflight("s1"), R1)  # in flight again
    # the resumed worker ran 50 s, then died 40 s before its lease ran out
    now = server_now(redis)
    redis.hset(keys.run(R1), mapping={"running_since": now - 90, "lease_until": now - 40})
    taken = ledger.start(run.id, "tok3", 30.0, "host-c")
    assert taken is not None and taken.claimed
    assert 149 < taken.used < 155


def test_park_is_fenced_by_the_lease(redis: redis_py.Redis) -> None:
    """A worker that lost its run's lease cannot park it (the successor's lease stays)."""
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert ledger.start(run.id, "tok", 30.0, "host-a").claimed  # type: ignore[union-attr]
    with pytest.raises(LeaseLost):
        ledger.park("q9", "a1", "s1", 2, [], {}, parent_run=R1, token="stale")
    assert not redis.exists(keys.request("q9"))
    assert redis.hget(keys.run(R1), "lease") == "tok"
    assert redis.xlen(keys.spawn_stream()) == 1  # the root's request q1 alone


# -- park, spawn, refuse, release ---------------------------------------------------------


def test_park_records_the_request_once_and_frees_the_parents_slot(
        redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert ledger.start(run.id, "tok", 30.0, "host-a").claimed  # type: ignore[union-attr]
    calls = [Admission({"call_id": "c9", "message": "sub"}, "a9")]
    assert ledger.park("q9", "a1", "s1", 2, calls, {"c8": "other"}, parent_run=R1)
    assert not ledger.park("q9", "a1", "s1", 2, calls, {}, parent_run=R1)  # a replay
    assert redis.xlen(keys.spawn_stream()) == 2  # q1 (the root's), q9 once
    row = redis.hgetall(keys.run(R1))
    assert (row["state"], row["lease"]) == ("parked", "")
    assert ledger.agent("a1").state == "parked"  # type: ignore[union-attr]
    assert not redis.sismember(keys.swarm_inflight("s1"), R1)
    assert redis.zscore(keys.leases(), R1) is None
    request = ledger.request("q9")
    assert request is not None and request.calls == [c.call for c in calls]
    assert request.runs == {"c9": derive_id("r", "a1", 2, "c9")} and request.count == 1
    assert ledger.agent("a9").state == "queued"  # type: ignore[union-attr]


def test_landed_for_a_request_is_written_once(redis: redis_py.Redis) -> None:
    """A root told again how its children landed (a Redis restart hid whether the first
    write went through) writes nothing twice: one ``landed`` event per child."""
    ledger = Ledger(redis)
    ledger.park("q9", "aparent", "s1", 2, [], {})
    for _ in range(2):
        ledger.landed("s1", {"ak1": "landed", "ak2": "conflict"}, "q9")
    events = [f for _, f in ledger.events_since("s1", "0-0") if f["kind"] == "landed"]
    assert [(e["agent"], e["landing"]) for e in events] == [("ak1", "landed"),
                                                           ("ak2", "conflict")]
    assert redis.hget(keys.agent("ak2"), "landing") == "conflict"
    ledger.landed("s1", {"ak1": "landed"}, "q10")  # a later request lands it again
    assert len([f for _, f in ledger.events_since("s1", "0-0") if f["kind"] == "landed"]) == 3


def test_a_dispatch_sends_up_to_the_parallel_limit_and_holds_the_rest(
        redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    claim = swarm_with(ledger, "a1", "a2", "a3", max_parallel=2)
    assert [n.run.id for n in claim.send] == [R1, R2]
    assert redis.smembers(keys.swarm_inflight("s1")) == {R1, R2}
    assert redis.lrange(keys.swarm_waiting("s1"), 0, -1) == [R3]
    assert [a.state for a in ledger.agents_by_id(["a1", "a3"])] == ["queued", "waiting"]  # type: ignore[union-attr]
    record = ledger.agent("a1")
    assert record is not None and (record.parent, record.parent_host) == ("aparent", "host-a")
    assert ledger.children_spawned("s1") == 3


def test_a_dispatch_replayed_sends_nothing_twice(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert ledger.start(run.id, "tok", 30.0, "host-a").claimed  # type: ignore[union-attr]
    again = ledger.dispatch("q1")  # a second coordinator's replay
    assert again is not None and again.state == "dispatching" and again.send == []
    assert redis.hget(keys.run(R1), "state") == "running"
    assert ledger.children_spawned("s1") == 1


def test_a_run_put_in_flight_is_covered_until_a_worker_claims_it(
        redis: redis_py.Redis) -> None:
    """A run whose task never went out (its coordinator died), was lost, or failed before
    its claim is sent again once its grace lease runs out; a claimed run's lease is its
    worker's."""
    ledger = Ledger(redis)
    swarm_with(ledger, "a1", "a2")
    assert redis.zscore(keys.leases(), R1) is not None  # a grace lease while sending
    r1 = ledger.run(R1)
    assert r1 is not None and ledger.start(r1.id, "tok", 30.0, "host-a").claimed  # type: ignore[union-attr]
    # r2's task is lost before any worker claimed it: once the grace is over, reap re-sends
    redis.zadd(keys.leases(), {R2: time.time() - 1})
    assert [n.run.id for n in ledger.reap(60.0)] == [R2]
    assert ledger.reap(60.0) == []  # once per grace period


def test_a_request_only_moves_forward(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent")
    ledger.park("q1", "aparent", "s1", 1, [], {})
    claim = ledger.dispatch("q1")
    assert claim is not None and claim.state == "dispatching" and claim.complete
    assert (claim.request_id, claim.swarm_id) == ("q1", "s1")
    assert ledger.dispatched("q1")
    redis.hset(keys.request("q1"), "state", "joined")
    assert not ledger.dispatched("q1")  # a slow coordinator, late
    assert ledger.request("q1").state == "joined"  # type: ignore[union-attr]
    claim = ledger.dispatch("q1")
    assert claim is not None and claim.state == "joined" and claim.send == []


def test_the_children_limit_holds_across_requests(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    first = swarm_with(ledger, "a1", "a2", max_children=3)
    second = spawn_children(ledger, "s1", "aparent", "a3", "a4", request="q2", turn=2)
    assert len(first.send) == 2
    assert [n.run.id for n in second.send] == [child_run("aparent", "a3", 2)]
    over = ledger.run(child_run("aparent", "a4", 2))
    assert over is not None and over.state == "refused"
    assert "children limit reached" in over.result["error"]
    assert not redis.exists(keys.agent("a4")) and ledger.children_spawned("s1") == 3


def test_a_refused_call_is_settled_in_the_parks_own_script(redis: redis_py.Redis) -> None:
    """A call the parent refused (here: over the children limit) has its run written
    settled ``refused`` by the park itself, counted in its request and swarm; a park that
    is not written (a replay) writes no run either."""
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/w", "task", {"max_children": 1}, "host-a",
                        "aparent")
    facts = ledger.facts("aparent", "s1", [])
    calls = [Admission({"call_id": "c1", "message": "one"}, "a1"),
             Admission({"call_id": "c2", "message": "two"}, "a2"),
             Admission({"call_id": "c3", "message": "x"}, refusal="depth limit reached")]
    assert ledger.park("q1", "aparent", "s1", 1, calls, {}, facts)
    runs = ledger.runs(derive_id("r", "aparent", 1, c) for c in ("c1", "c2", "c3"))
    assert [r.state for r in runs if r is not None] == ["queued", "refused", "refused"]
    assert "children limit reached" in runs[1].result["error"]  # type: ignore[union-attr]
    assert runs[2].result == {"error": "depth limit reached"}  # type: ignore[union-attr]
    assert runs[1].agent == "" and ledger.agent("a2") is None  # type: ignore[union-attr]
    request = ledger.request("q1")
    assert request is not None and (request.settled, request.refused, request.count) == \
        (2, 2, 3)
    assert ledger.counters("s1") == {"children": 1, "refused": 2}
    assert not ledger.park("q1", "aparent", "s1", 1, calls, {}, facts)
    assert ledger.counters("s1") == {"children": 1, "refused": 2}


def test_a_childs_result_is_capped_head_and_tail_with_where_the_whole_is() -> None:
    run = RunRecord(id="r1", agent="a1", request="q1", call_id="c1", message="m",
                    state="done", result={"agent_id": "a1", "output": {"rows": ["y" * 50] * 40},
                                          "files_changed": [f"f{i}" for i in range(250)]})
    body = json.loads(result_text(run, "c1", cap=300))
    assert body["output"].startswith('{"rows": ["yyy') and "characters cut" in body["output"]
    assert len(body["output"]) < 400
    assert body["files_changed"][-1] == "... 50 more" and len(body["files_changed"]) == 201
    assert body["cut"].endswith("`swarm logs a1` shows it whole")
    assert "output" in body["cut"] and "250 files" in body["cut"]
    assert json.loads(result_text(run, "c1"))["output"] == run.result["output"]  # no cap


def test_release_fills_free_slots_in_order(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    swarm_with(ledger, "a1", "a2", "a3", "a4", max_parallel=1)
    assert ledger.release("s1", 1) == []  # no free slot yet
    run = ledger.run(R1)
    assert run is not None and ledger.settle(run, "s1", "done", {}, {})
    released = ledger.release("s1", 2)
    assert [n.run.id for n in released] == [R2, R3]
    assert released[0].label == "do a2" and released[0].depth == 1
    assert ledger.agent("a2").state == "queued"  # type: ignore[union-attr]
    assert redis.lrange(keys.swarm_waiting("s1"), 0, -1) == [R4]


# -- settle, stay parked, reap ---------------------------------------------------------------


def test_settle_once_and_fenced_by_the_lease(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    ledger.start(run.id, "tok1", 30.0, "host-a")
    assert not ledger.settle(run, "s1", "done", {"answer": "x"}, {}, token="stale")
    assert ledger.settle(run, "s1", "done", {"answer": "x"}, {"total_tokens": 3}, token="tok1")
    assert not ledger.settle(run, "s1", "failed", {}, {})
    got = ledger.run(R1)
    assert got is not None and got.state == "done" and got.result == {"answer": "x"}
    assert ledger.agent("a1").usage == {"total_tokens": 3}  # type: ignore[union-attr]
    assert not redis.sismember(keys.swarm_inflight("s1"), R1)
    assert redis.zscore(keys.leases(), R1) is None


def test_stay_parked_gives_back_the_lease_and_the_slot(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    ledger.park("q9", "a1", "s1", 2, [], {}, parent_run=R1)
    resumed = ledger.start(run.id, "tok", 30.0, "host-a", from_state="parked")
    assert resumed is not None and resumed.claimed
    assert redis.sismember(keys.swarm_inflight("s1"), R1)
    assert not ledger.stay_parked(run, "s1", "stale-token")  # fenced by the lease
    assert redis.hget(keys.run(R1), "state") == "running"
    assert ledger.stay_parked(run, "s1", "tok")
    assert redis.hget(keys.run(R1), "state") == "parked"
    assert ledger.agent("a1").state == "parked"  # type: ignore[union-attr]
    assert not redis.sismember(keys.swarm_inflight("s1"), R1)
    assert redis.zscore(keys.leases(), R1) is None
    freed = [f for _, f in redis.xrange(keys.settle_stream()) if "freed" in f]
    assert freed == [{"freed": "s1"}]  # so a coordinator releases a held run


def test_reap_returns_runs_whose_lease_ran_out_once_per_grace(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    run = add_child(ledger)
    ledger.start(run.id, "tok", 30.0, "host-a")
    assert ledger.reap(60.0) == []
    redis.zadd(keys.leases(), {R1: time.time() - 1, "rgone": time.time() - 1})
    reaped = ledger.reap(60.0)
    assert [n.run.id for n in reaped] == [R1] and reaped[0].label == "do a1"
    assert ledger.reap(60.0) == []  # pushed on by the grace period
    assert redis.zscore(keys.leases(), "rgone") is None
    kinds = [f["kind"] for _, f in redis.xrange(keys.events("s1"))]
    assert kinds.count("takeover") == 1


# -- join -------------------------------------------------------------------------------------


RC1 = derive_id("r", "aparent", 1, "c1")


def parked_parent(ledger: Ledger, redis: redis_py.Redis, kind: str) -> None:
    """A parent (``kind`` root or child) parked on q1 = calls c1 (agent, run RC1) and c2
    (other)."""
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent", kind=kind)
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "agent", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "run_cli", "arguments": "{}"}}]}
    RedisSessionStore(redis).save(Session(
        id="aparent", workspace="/w", messages=[{"role": "user", "content": "go"}, assistant],
        usage={}, created=1.0, updated=1.0, parked="q1"))
    ledger.park("q1", "aparent", "s1", 1, [Admission({"call_id": "c1", "message": "do 1"},
                                                     "a1")], {"c2": "ran: ls"})
    claim = ledger.dispatch("q1")
    assert claim is not None and [n.run.id for n in claim.send] == [RC1]
    assert not ledger.dispatched("q1")  # RC1 is out


def test_join_answers_the_calls_in_order_and_wakes_a_root(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    parked_parent(ledger, redis, "root")
    assert ledger.join("q1") is None  # r1 is still out
    run = ledger.run(RC1)
    assert run is not None and ledger.settle(run, "s1", "done", {"answer": "one"}, {})
    joined = ledger.join("q1")
    assert joined is not None and not joined.resume
    session = RedisSessionStore(redis).load("aparent")
    assert session is not None and session.parked == ""
    tools = [m for m in session.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["c1", "c2"]
    assert json.loads(tools[0]["content"])["answer"] == "one" and tools[1]["content"] == \
        "ran: ls"
    assert ledger.wait_woken("aparent", 0.1) == "q1"
    assert ledger.request("q1").state == "joined"  # type: ignore[union-attr]
    assert ledger.join("q1") is None  # joined once
    assert ledger.wait_woken("aparent", 0.1) is None  # and woken once


def test_join_of_a_worker_parent_waits_for_its_resume(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    parked_parent(ledger, redis, "child")
    run = ledger.run(RC1)
    assert run is not None and ledger.settle(run, "s1", "failed", {"error": "x"}, {})
    joined = ledger.join("q1")
    assert joined is not None and joined.resume and joined.parent.run == ""
    assert ledger.request("q1").state == "answered"  # type: ignore[union-attr]
    again = ledger.join("q1")  # a coordinator that died before the resume went out
    assert again is not None and again.resume
    assert ledger.join("q1", head={"state": "answered", "settled": "1", "count": "1"})
    session = RedisSessionStore(redis).load("aparent")
    assert session is not None and len([m for m in session.messages
                                        if m["role"] == "tool"]) == 2  # answered once
    ledger.resumed("q1")
    assert ledger.join("q1") is None


def test_a_joined_parent_whose_resume_task_is_lost_is_reaped_to_resume_again(
        redis: redis_py.Redis) -> None:
    """The join covers a worker parent's run with a grace lease until its resume is
    claimed: a resume task lost with its worker (or never sent) is sent again by the reap;
    a claim of the resume takes the run out of it as a lease of its own."""
    ledger = Ledger(redis, grace=30.0)
    parked_parent(ledger, redis, "child")
    redis.hset(keys.agent("aparent"), "run", "rparent")
    redis.hset(keys.run("rparent"), mapping={"id": "rparent", "agent": "aparent",
                                             "swarm": "s1", "state": "parked"})
    run = ledger.run(RC1)
    assert run is not None and ledger.settle(run, "s1", "done", {"answer": "one"}, {})
    joined = ledger.join("q1")
    assert joined is not None and joined.resume
    ledger.resumed("q1")  # its resume task went out, and was lost with its worker
    until = redis.zscore(keys.leases(), "rparent")
    assert until is not None and abs(until - (server_now(redis) + 30.0)) < 5
    assert ledger.reap() == []  # not before the grace is over
    redis.zadd(keys.leases(), {"rparent": server_now(redis) - 1})  # the grace ran out
    reaped = ledger.reap()
    assert [(n.run.id, n.run.state) for n in reaped] == [("rparent", "parked")]
    assert ledger.reap() == []  # once per grace period
    parent = ledger.run("rparent")
    assert parent is not None
    start = ledger.start(parent.id, "tok", 10.0, "host-a", from_state="parked")
    assert start is not None and start.claimed
    assert abs(redis.zscore(keys.leases(), "rparent") - (server_now(redis) + 10.0)) < 5


# -- cancel -------------------------------------------------------------------------------------


def test_cancel_flags_the_subtree_and_settles_held_runs(redis: redis_py.Redis) -> None:
    """a1 in flight, a2 done, a3 held: a cancel of a1 alone leaves a3 alone; one of the
    root flags them all and settles the held run, in flight ones being the workers' to
    stop; it returns those not settled before."""
    ledger = Ledger(redis)
    swarm_with(ledger, "a1", "a2", "a3", max_parallel=2)
    done = ledger.run(R2)
    assert done is not None and ledger.settle(done, "s1", "done", {}, {})
    assert ledger.cancel("a1", "stop a1") == ["a1"]
    assert ledger.run(R3).state == "queued"  # type: ignore[union-attr]
    assert redis.lrange(keys.swarm_waiting("s1"), 0, -1) == [R3]
    active = ledger.cancel("aparent", "stop")
    assert set(active) == {"aparent", "a1", "a3"}
    assert ledger.cancelled(["aparent", "a1", "a3", "other"]) == [True, True, True, False]
    assert 0 < redis.ttl(keys.cancel("a3")) <= ledger.ttl
    held = ledger.run(R3)
    assert held is not None and held.state == "cancelled" and held.result == {"error": "stop"}
    assert redis.hget(keys.agent("a3"), "usage") == "{}"  # it never ran
    assert ledger.run(R1).state == "queued"  # type: ignore[union-attr]
    assert redis.llen(keys.swarm_waiting("s1")) == 0
    said = [(f["agent"], f["text"]) for _, f in redis.xrange(keys.events("s1"))
            if f["kind"] == "cancel"]
    assert said == [("a1", "stop a1"), ("aparent", "stop")]


def commands(redis: redis_py.Redis) -> int:
    """Commands the server has run, those inside scripts included (INFO commandstats)."""
    stats = redis.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def test_the_cancel_flags_of_many_agents_are_read_in_one_command(
        redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    redis.set(keys.cancel("a7"), "stop")
    before = commands(redis)
    flags = ledger.cancelled([f"a{i}" for i in range(50)])
    assert commands(redis) - before == 1  # a worker polls its children's flags twice a second
    assert flags == [i == 7 for i in range(50)]
    assert ledger.cancelled([]) == []


def test_a_settled_swarms_record_is_never_written_again(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    ledger.create_swarm("s-kept", "s-kept", "/w", "task", {}, "h", "sess",
                        start=RootStart({"total_tokens": 10}, 3, 1.5))
    assert ledger.finish_swarm("s-kept", "cancelled", root_id="s-kept",
                               end=RootEnd({"total_tokens": 5}, 1, 4, error="stopped"))
    kept = (redis.hgetall(keys.swarm("s-kept")), redis.hgetall(keys.agent("s-kept")))
    assert not ledger.finish_swarm("s-kept", "done", root_id="s-kept",
                                   end=RootEnd({"total_tokens": 99}, 9, 9, answer="later"))
    assert (redis.hgetall(keys.swarm("s-kept")), redis.hgetall(keys.agent("s-kept"))) == kept
    root = ledger.agent("s-kept")
    assert root is not None and root.kept and root.error == "stopped"
    assert root.usage == {"total_tokens": 5} and root.base_turns == 3
    assert kept[0]["state"] == "cancelled" and kept[0]["error"] == "stopped"


def test_a_join_that_read_the_request_before_another_joined_it_does_nothing(
        redis: redis_py.Redis) -> None:
    """Two coordinators join the same request: the second read it as ``dispatched``, then
    the first joined it before the second's transaction; the second must not wake the root
    again (its check of the state inside the transaction is what stops it)."""
    first, second = Ledger(redis), Ledger(redis)
    parked_parent(first, redis, "root")
    run = first.run(RC1)
    assert run is not None and first.settle(run, "s1", "done", {"answer": "one"}, {})
    read_runs = second.runs
    won: list[object] = []

    def runs_then_the_other_joins(ids):  # type: ignore[no-untyped-def]
        got = read_runs(ids)  # the second has read the request (dispatched) and its runs
        won.append(first.join("q1"))
        return got

    second.runs = runs_then_the_other_joins  # type: ignore[method-assign]
    assert second.join("q1") is None
    assert won and won[0] is not None  # the first did join it in between
    assert first.wait_woken("aparent", 0.1) == "q1"
    assert first.wait_woken("aparent", 0.1) is None  # woken once
    session = RedisSessionStore(redis).load("aparent")
    assert session is not None and [m["tool_call_id"] for m in session.messages
                                    if m["role"] == "tool"] == ["c1", "c2"]  # answered once


# -- requests written by an older swarm ---------------------------------------------------------


def old_request(redis: redis_py.Redis, state: str, **more: str) -> None:
    """Request q1 as swarms wrote it before the parent admitted its calls: no admitted
    runs, no in-flight limit; the coordinator wrote the runs and ``runs``/``count``."""
    redis.hset(keys.request("q1"), mapping={
        "id": "q1", "parent": "aparent", "swarm": "s1", "turn": 1, "created": time.time(),
        "calls": json.dumps([{"call_id": "c1", "message": "do 1"}]), "results": "{}",
        "state": state, **more})


@pytest.mark.parametrize("state", ["new", "dispatching"])
def test_an_old_request_not_yet_dispatched_is_refused_saying_what_to_do(
        redis: redis_py.Redis, state: str) -> None:
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent")
    old_request(redis, state)
    kept = redis.hgetall(keys.request("q1"))
    with pytest.raises(StoreError, match=r"request q1 of swarm s1 was written by an older "
                                         r"swarm.*swarm cancel s1"):
        ledger.dispatch("q1")
    assert redis.hgetall(keys.request("q1")) == kept
    assert redis.scard(keys.swarm_inflight("s1")) == 0


def test_an_old_request_dispatched_before_the_upgrade_is_read_and_joined(
        redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent")
    call = {"id": "c1", "type": "function", "function": {"name": "agent", "arguments": "{}"}}
    RedisSessionStore(redis).save(Session(
        id="aparent", workspace="/w", usage={}, created=1.0, updated=1.0, parked="q1",
        messages=[{"role": "user", "content": "go"},
                  {"role": "assistant", "content": "", "tool_calls": [call]}]))
    old_request(redis, "dispatched", runs=json.dumps({"c1": "rold"}), count="1")
    redis.hset(keys.run("rold"), mapping={"id": "rold", "agent": "a1", "swarm": "s1",
                                          "request": "q1", "call_id": "c1", "state": "running"})
    request = ledger.request("q1")
    assert request is not None and (request.state, request.runs, request.count) == \
        ("dispatched", {"c1": "rold"}, 1)
    claim = ledger.dispatch("q1")  # a replay of its spawn entry moves nothing
    assert claim is not None and claim.state == "dispatched" and claim.send == []
    run = ledger.run("rold")
    assert run is not None and ledger.settle(run, "s1", "done", {"answer": "one"}, {})
    assert ledger.join("q1") is not None
    session = RedisSessionStore(redis).load("aparent")
    assert session is not None and [json.loads(m["content"])["answer"]
                                    for m in session.messages if m["role"] == "tool"] == ["one"]


# -- what a park writes, and the join's other paths ---------------------------------------------


def test_park_writes_each_child_as_its_worker_reads_it(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    swarm_with(ledger, "a9", "a8")  # their first runs: q1, turn 1
    schema = {"type": "object"}
    trace = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    calls = [Admission({"call_id": "c1", "message": "écris 1", "output_schema": schema,
                        "traceparent": trace, "seed": "seed1", "type": "reviewer"}, "a1"),
             Admission({"call_id": "c2", "message": "go on", "agent_id": "a9",
                        "seed": "seed2"}, "a9"),
             Admission({"call_id": "c3", "message": "again", "agent_id": "a8"}, "a8")]
    assert ledger.park("q2", "aparent", "s1", 2, calls, {}, ledger.facts("aparent", "s1", []))
    r1, r2, r3 = (derive_id("r", "aparent", 2, c) for c in ("c1", "c2", "c3"))
    new = ledger.run(r1)
    assert new is not None and (new.agent, new.request, new.call_id, new.message, new.state,
                                new.output_schema, new.traceparent, new.swarm, new.rebase) \
        == ("a1", "q2", "c1", "écris 1", "queued", schema, trace, "s1", "")
    agent = ledger.agent("a1")
    assert agent is not None and (
        agent.parent, agent.depth, agent.kind, agent.workspace, agent.host, agent.label,
        agent.parent_workspace, agent.parent_host, agent.seed, agent.type, agent.state,
        agent.run) == ("aparent", 1, "child", "", "", "écris 1", "/work/parent", "host-a",
                       "seed1", "reviewer", "queued", r1)
    assert abs(agent.created - time.time()) < 60
    again = ledger.run(r2)  # a continuation: its agent's record is kept, its run rebases
    assert again is not None and (again.agent, again.rebase, again.message) == \
        ("a9", "seed2", "go on")
    plain = ledger.run(r3)  # no snapshot to rebase on, no trace to carry
    assert plain is not None and (plain.agent, plain.rebase, plain.traceparent) == ("a8", "", "")
    kept = ledger.agent("a9")
    assert kept is not None and (kept.run, kept.state, kept.seed, kept.label) == \
        (r2, "queued", "", "do a9")
    assert ledger.request("q2").turn == 2  # type: ignore[union-attr]
    queued = [(f["agent"], f["depth"]) for _, f in redis.xrange(keys.events("s1"))
              if f["kind"] == "queued"]
    assert queued == [("a9", "1"), ("a8", "1"), ("a1", "1"), ("a9", "1"), ("a8", "1")]
    # A root's park touches no run of its own, and records no snapshot it was not given.
    assert set(redis.keys(keys.run("*"))) == {keys.run(r) for r in (
        child_run("aparent", "a9"), child_run("aparent", "a8"), r1, r2, r3)}
    assert redis.hget(keys.agent("aparent"), "ws_state") is None


def test_park_records_the_snapshot_and_refuses_the_calls_of_a_cancelled_parent(
        redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent")
    assert ledger.park("q1", "aparent", "s1", 1, [], {}, workspace_state="snap1",
                       host="host-b")
    assert redis.hmget(keys.agent("aparent"), ["ws_state", "ws_host"]) == ["snap1", "host-b"]
    ledger.cancel("aparent")
    assert ledger.park("q2", "aparent", "s1", 2, [Admission({"call_id": "c1", "message": "m"},
                                                            "a1")], {})
    run = ledger.run(derive_id("r", "aparent", 2, "c1"))
    assert run is not None and run.state == "refused"
    assert run.result == {"error": "the parent was cancelled"}


def test_join_believes_a_head_that_says_runs_are_out(redis: redis_py.Redis) -> None:
    """What a settlement knows of the request (its head) spares reading the request until
    the last run settled; an unknown request, or one whose count and runs disagree, is not
    joined."""
    ledger = Ledger(redis)
    assert ledger.join("qnope") is None
    parked_parent(ledger, redis, "root")
    redis.hset(keys.request("q1"), "settled", 1)  # counted, yet RC1 is still running
    assert ledger.join("q1") is None
    redis.hset(keys.request("q1"), "settled", 0)
    run = ledger.run(RC1)
    assert run is not None and ledger.settle(run, "s1", "done", {"answer": "one"}, {})
    for stale in ({"state": "dispatched", "settled": "0", "count": "1"},
                  {"state": "dispatched", "count": "1"},
                  {"state": "dispatching", "settled": "1", "count": "1"}):
        assert ledger.join("q1", head=stale) is None, stale
    joined = ledger.join("q1", head={"state": "dispatched", "settled": "1", "count": "1"})
    assert joined is not None and (joined.request_id, joined.swarm_id) == ("q1", "s1")


@pytest.mark.parametrize(("kind", "lease"), [("root", None), ("child", None),
                                             ("child", 12345.0)])
def test_a_request_answered_whose_wake_or_resume_may_be_lost_is_joined_again(
        redis: redis_py.Redis, kind: str, lease: float | None) -> None:
    """The session was answered (not parked) but the request still says dispatched: the
    join wakes a root again, or covers a worker parent's run for its resume (keeping a
    lease it has), and answers nothing twice."""
    ledger = Ledger(redis)
    parked_parent(ledger, redis, kind)
    redis.hset(keys.agent("aparent"), "run", "rparent")
    if lease is not None:
        redis.zadd(keys.leases(), {"rparent": lease})
    run = ledger.run(RC1)
    assert run is not None and ledger.settle(run, "s1", "done", {"answer": "ANSWER-ONE"}, {})
    sessions = RedisSessionStore(redis)
    session = sessions.load("aparent")
    assert session is not None
    session.parked = ""
    sessions.save(session)
    joined = ledger.join("q1")
    assert joined is not None and joined.resume == (kind == "child")
    assert ledger.request("q1").state == ("answered" if kind == "child" else "joined")  # type: ignore[union-attr]
    assert ledger.wait_woken("aparent", 0.1) == (None if kind == "child" else "q1")
    covered = redis.zscore(keys.leases(), "rparent")
    if kind == "root":
        assert covered is None
    elif lease is not None:
        assert covered == lease  # kept
    else:
        assert covered is not None and covered > server_now(redis)  # covered for its resume
    stored = redis.hget(keys.session("aparent"), "messages")
    assert stored is not None and "ANSWER-ONE" not in stored  # nothing answered twice


def test_join_caps_answers_counts_refusals_and_indexes_a_roots_session(
        redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent")
    agent = {"type": "function", "function": {"name": "agent", "arguments": "{}"}}
    RedisSessionStore(redis, index=False).save(Session(
        id="aparent", workspace="/w", usage={}, created=1.0, updated=1.0, parked="q1",
        messages=[{"role": "user", "content": "go"}, {"role": "assistant", "content": "",
                  "tool_calls": [{"id": "c1", **agent}, {"id": "c2", **agent},
                                 {"id": "c3", **agent}]}]))
    assert redis.zscore(keys.sessions_index(), "aparent") is None
    ledger.park("q1", "aparent", "s1", 1, [
        Admission({"call_id": "c1", "message": "do 1"}, "a1"),
        Admission({"call_id": "c2", "message": "do 2"}, "a2"),
        Admission({"call_id": "c3", "message": "x"}, refusal="depth limit reached")], {})
    ledger.dispatch("q1")
    ledger.dispatched("q1")
    run, other = ledger.runs([RC1, derive_id("r", "aparent", 1, "c2")])
    assert run is not None and ledger.settle(run, "s1", "done", {"answer": "y" * 5000}, {})
    assert other is not None and ledger.settle(other, "s1", "done", {"answer": "two"}, {})
    assert ledger.join("q1", cap=300) is not None
    session = RedisSessionStore(redis).load("aparent")
    assert session is not None
    first, _, second = (json.loads(m["content"]) for m in session.messages
                        if m["role"] == "tool")
    assert "characters cut" in first["answer"] and len(first["answer"]) < 500
    assert second["state"] == "refused" and second["error"] == "depth limit reached"
    (event,) = [f for _, f in redis.xrange(keys.events("s1")) if f["kind"] == "joined"]
    assert (event["agent"], event["children"], event["refused"]) == ("aparent", "2", "1")
    assert 0 < redis.ttl(keys.wake("aparent")) <= ledger.ttl
    assert redis.zscore(keys.sessions_index(), "aparent") is not None


def test_join_leaves_a_parent_not_parked_on_the_request_alone(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    parked_parent(ledger, redis, "root")
    run = ledger.run(RC1)
    assert run is not None and ledger.settle(run, "s1", "done", {"answer": "one"}, {})
    sessions = RedisSessionStore(redis)
    session = sessions.load("aparent")
    assert session is not None
    session.parked = "q2"  # parked on another request
    sessions.save(session)
    assert ledger.join("q1") is None
    redis.delete(keys.session("aparent"))  # no session at all
    assert ledger.join("q1") is None
    assert ledger.request("q1").state == "dispatched"  # type: ignore[union-attr]


def test_a_childs_transitions_read_and_write_each_record_once(redis: redis_py.Redis) -> None:
    """Commands two children's transitions cost, those inside the scripts included: their
    park, dispatch, claims and settlements, and the coordinator's handling of each
    settlement, which names the run's request and says no run of the swarm is held
    (nothing to release)."""
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/work/parent", "task", {}, "host-a", "aparent")
    spent: dict[str, int] = {}

    def cost(name: str, fn: Callable[[], object]) -> None:
        before = commands(redis)
        fn()
        spent[name] = spent.get(name, 0) + commands(redis) - before

    for turn, agents in enumerate((["a0"], ["a1", "a2"]), 1):  # the first loads the scripts
        spent.clear()
        request = f"q{turn}"
        calls = [Admission({"call_id": f"c-{a}", "message": f"do {a}"}, a) for a in agents]
        facts = ledger.facts("aparent", "s1", [])
        cost("park", partial(ledger.park, request, "aparent", "s1", turn, calls, {}, facts))
        cost("dispatch", partial(ledger.dispatch, request))
        for agent in agents:
            run = ledger.run(child_run("aparent", agent, turn))
            assert run is not None
            cost("start", partial(ledger.start, run.id, "tok", 30.0, "host-b"))
            cost("settle", partial(ledger.settle, run, "s1", "done", {"answer": "ok"}, {},
                                   token="tok"))
            (_, entry), = redis.xrevrange(keys.settle_stream(), count=1)
            assert entry == {"run": run.id, "request": request, "held": "0"}
            cost("settled", partial(ledger.request_of, run.id, entry["request"]))
    # Each script's EVALSHA counts one; a start (the worker reads nothing before it): TIME,
    # HGETALL run, HGETALL agent, HSET run, HSET agent, ZADD, HMGET session, EXISTS, HGET
    # (17 with the worker's read of the run first); a dispatch reads each run once and the
    # parent's run once; the coordinator reads the request's head only, and releases none.
    # Each record read and written a field at a time, it was 30, 23, 32 (+ 2), 20, 4 (+ 8).
    assert spent == {"park": 24, "dispatch": 20, "start": 20, "settle": 20, "settled": 2}


def test_a_settlement_says_whether_runs_are_held(redis: redis_py.Redis) -> None:
    """One slot and two children: the second is held, so the first's settlement says so
    (the coordinator releases it); the second's, with nothing held, says none."""
    ledger = Ledger(redis)
    swarm_with(ledger, "a1", "a2", max_parallel=1)
    first = ledger.run(R1)
    assert first is not None and ledger.settle(first, "s1", "done", {}, {})
    assert [f["held"] for _, f in redis.xrange(keys.settle_stream())] == ["1"]
    (released,) = ledger.release("s1", 1)
    assert ledger.settle(released.run, "s1", "done", {}, {})
    assert [(f["run"], f["held"]) for _, f in redis.xrange(keys.settle_stream())] == \
        [(R1, "1"), (R2, "0")]


def test_a_child_that_started_no_background_children_reads_no_list_of_them(
        redis: redis_py.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new child's record says it started no background children, so its final answer
    reads no list of them; once it starts one its record says so (a worker that takes it
    over reads the list) and so does its spawner."""
    ledger = Ledger(redis)
    swarm_with(ledger, "a1")
    record = ledger.agent("a1")
    assert record is not None and record.background is False
    assert ledger.agent("aparent").background is None  # type: ignore[union-attr]
    spawner = RedisSpawner(ledger, "a1", "s1", run_id=R1, background=record.background)
    trips = round_trips(monkeypatch)
    assert spawner.outstanding([]) == ({}, [])
    assert trips == []
    spawner.start(2, [SpawnCall("c-b1", "do b1", background=True)])
    assert ledger.agent("a1").background is True  # type: ignore[union-attr]
    assert spawner.background is True
    (child,) = spawner.outstanding([])[0]
    assert ledger.agent(child).background is False  # type: ignore[union-attr]


def test_where_a_settling_childs_workspace_is_goes_with_its_settlement(
        redis: redis_py.Redis) -> None:
    """The snapshot a child's work was stored in, and where its workspace is, are written
    in its settlement's script (not a round trip of their own); a worker that lost its
    lease writes neither."""
    ledger = Ledger(redis)
    run = add_child(ledger)
    assert ledger.start(run.id, "tok", 30.0, "host-b") is not None
    where = Ledger.where("/ws/a1", "host-b", "state1")
    assert not ledger.settle(run, "s1", "done", {}, {}, token="old", place=where)
    assert redis.hget(keys.agent("a1"), "ws_state") is None
    assert ledger.settle(run, "s1", "done", {}, {}, token="tok", place=where)
    record = ledger.agent("a1")
    assert record is not None and record.state == "done"
    assert (record.workspace, record.ws_host, record.ws_state) == ("/ws/a1", "host-b", "state1")
