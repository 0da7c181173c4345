"""The approval queue on the real server, as a person and a child use it: a child asks and
waits, a person lists and answers (once), ``always`` approves a tool for the swarm, a
cancel or silence denies, and a closed request says why it can no longer be answered."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis as redis_py

from swarm.domain.approval import Answer, ApprovalRequest
from swarm.store import keys
from swarm.store.approvals import (
    CANCELLED,
    EXPIRED,
    TIMED_OUT,
    ApprovalQueue,
    Pending,
    QueueApprover,
    closed_because,
    outcome,
    swarm_of,
)
from tests.helpers import wait_until


def asking(queue: ApprovalQueue, request: ApprovalRequest, timeout: float = 30,
           cancelled: threading.Event | None = None) -> tuple[threading.Thread, list[Any]]:
    """A child asking in a thread; its verdict lands in the list."""
    got: list[Any] = []
    stop = cancelled or threading.Event()
    thread = threading.Thread(
        target=lambda: got.append(queue.ask(request, timeout, stop.is_set)), daemon=True)
    thread.start()
    return thread, got


def request(tool: str = "run_cli", summary: str = "rm -rf build") -> ApprovalRequest:
    return ApprovalRequest(tool, {"command": summary}, summary, reason="policy always",
                           agent_id="a1")


def listed(queue: ApprovalQueue, n: int = 1) -> list[Pending]:
    return wait_until(lambda: (lambda p: p if len(p) == n else None)(queue.pending()),
                      f"{n} pending request(s)")


@pytest.mark.parametrize("decision", ["approve", "deny"])
def test_a_person_answers_once_and_the_child_gets_it(redis: redis_py.Redis,
                                                     decision: str) -> None:
    queue = ApprovalQueue(redis, "s1")
    thread, got = asking(queue, request())
    (pending,) = listed(queue)
    assert (pending.swarm, pending.agent, pending.tool, pending.summary, pending.reason) == \
        ("s1", "a1", "run_cli", "rm -rf build", "policy always")
    assert abs(pending.created - time.time()) < 60
    assert swarm_of(redis, pending.id) == "s1" and outcome(redis, pending.id) is None
    # Nothing of it outlives the ledger.
    assert 0 < redis.ttl(keys.approvals("s1")) <= keys.LEDGER_TTL
    assert 0 < redis.ttl(keys.approval_swarm(pending.id)) <= keys.LEDGER_TTL
    assert queue.answer(pending.id, decision)  # type: ignore[arg-type]
    assert not queue.answer(pending.id, "approve")  # a second answer is too late
    thread.join(timeout=10)
    assert got == [(decision, "answered by a person")]
    assert outcome(redis, pending.id) == decision
    assert closed_because(decision) == f"it was answered already ({decision})"
    assert queue.pending() == [] and not redis.hexists(keys.approvals("s1"), pending.id)
    assert not redis.sismember(keys.swarm_approved("s1"), "run_cli")
    events = [f for _, f in redis.xrange(keys.events("s1"))]
    assert [(e["kind"], e["agent"], e["text"]) for e in events] == \
        [("approval", "a1", "rm -rf build")]
    assert abs(float(events[0]["ts"]) - time.time()) < 60


def test_always_approves_the_tool_for_the_whole_swarm(redis: redis_py.Redis) -> None:
    queue = ApprovalQueue(redis, "s1")
    thread, got = asking(queue, request())
    (pending,) = listed(queue)
    assert queue.answer(pending.id, "always")
    thread.join(timeout=10)
    assert got == [("always", "answered by a person")]
    assert redis.ttl(keys.swarm_approved("s1")) > 0
    # The next ask of that tool in the swarm is approved without a person; others still ask.
    assert queue.ask(request(summary="rm -rf dist"), 0) == ("approve",
                                                             "approved for this swarm")
    assert ApprovalQueue(redis, "s2").ask(request(), 0)[0] == "deny"
    assert queue.ask(request(tool="write_file"), 0)[0] == "deny"
    assert queue.pending() == []


def test_an_unknown_answer_denies(redis: redis_py.Redis) -> None:
    queue = ApprovalQueue(redis, "s1")
    thread, got = asking(queue, request())
    (pending,) = listed(queue)
    redis.rpush(keys.approval_answer(pending.id), "perhaps")  # not one of the decisions
    thread.join(timeout=10)
    assert got == [("deny", "unknown answer 'perhaps'")]


def test_pending_lists_the_oldest_first_and_not_those_answered(redis: redis_py.Redis) -> None:
    queue = ApprovalQueue(redis, "s1")
    first, _ = asking(queue, request(summary="first"))
    listed(queue)
    second, _ = asking(queue, request(summary="second"))
    pending = listed(queue, 2)
    assert [p.summary for p in pending] == ["first", "second"]
    assert queue.answer(pending[1].id, "deny")
    second.join(timeout=10)
    assert [p.summary for p in queue.pending()] == ["first"]
    queue.answer(pending[0].id, "deny")
    first.join(timeout=10)


def test_a_summary_is_cut_to_2000_characters_in_the_queue(redis: redis_py.Redis) -> None:
    queue = ApprovalQueue(redis, "s1")
    thread, _ = asking(queue, request(summary="x" * 5000))
    (pending,) = listed(queue)
    assert pending.summary == "x" * 2000
    (event,) = [f for _, f in redis.xrange(keys.events("s1"))]
    assert event["text"] == "x" * 300
    queue.answer(pending.id, "deny")
    thread.join(timeout=10)


def test_a_cancelled_child_gives_up_and_its_request_is_closed(redis: redis_py.Redis) -> None:
    queue = ApprovalQueue(redis, "s1")
    cancel = threading.Event()
    thread, got = asking(queue, request(), cancelled=cancel)
    (pending,) = listed(queue)
    cancel.set()
    thread.join(timeout=10)
    assert got == [("deny", "the agent was cancelled")]
    assert outcome(redis, pending.id) == CANCELLED
    assert closed_because(CANCELLED) == "its agent was cancelled"
    assert not queue.answer(pending.id, "approve")  # too late
    assert redis.llen(keys.approval_answer(pending.id)) == 0
    assert queue.pending() == []


def test_silence_denies_and_closes_the_request(redis: redis_py.Redis) -> None:
    queue = ApprovalQueue(redis, "s1")
    assert queue.ask(request(), 0.2) == ("deny", "no one answered within 0 s")
    head, tail = keys.approval_answered("ID").split("ID")
    (approval_id,) = [k[len(head):len(k) - len(tail)]
                      for k in redis.keys(keys.approval_answered("*"))]
    assert outcome(redis, approval_id) == TIMED_OUT
    assert 0 < redis.ttl(keys.approval_answered(approval_id)) <= keys.APPROVAL_ANSWERED_TTL
    assert closed_because(TIMED_OUT) == "no one answered in time, so it was denied"
    assert queue.pending() == []


def test_an_unknown_request_cannot_be_answered(redis: redis_py.Redis) -> None:
    assert not ApprovalQueue(redis, "s1").answer("pnope", "approve")
    assert outcome(redis, "pnope") is None and swarm_of(redis, "pnope") == ""
    assert closed_because(EXPIRED).startswith("the agent that asked is gone")


def test_a_queue_without_a_lease_token_never_expires_its_requests(
        redis: redis_py.Redis) -> None:
    """A queue that names no attempt (no lease token) has its requests wait for a person
    whatever the ledger holds: here its run is held under another token."""
    redis.hset(keys.run("r1"), mapping={"id": "r1", "state": "running", "lease": "tok",
                                        "lease_until": time.time() + 3600})
    redis.zadd(keys.leases(), {"r1": time.time() + 3600})
    queue = ApprovalQueue(redis, "s1", run="r1")  # a run, but no lease to check
    thread, got = asking(queue, request())
    (pending,) = listed(queue)
    assert queue.pending() == [pending]
    assert queue.answer(pending.id, "approve")
    thread.join(timeout=10)
    assert got == [("approve", "answered by a person")]


def test_an_answer_waits_for_its_child_an_hour_at_most(redis: redis_py.Redis) -> None:
    """The child reads the answer off a list; one it never reads goes in an hour."""
    redis.hset(keys.approvals("s1"), "p1", json.dumps(
        {"id": "p1", "swarm": "s1", "agent": "a1", "tool": "run_cli", "summary": "ls",
         "reason": "", "created": time.time()}))
    queue = ApprovalQueue(redis, "s1")
    assert queue.answer("p1", "approve")
    assert queue.pending() == []  # answered: not listed while its child has yet to read it
    assert not queue.answer("p1", "deny")  # closed once
    assert outcome(redis, "p1") == "approve"
    assert redis.lrange(keys.approval_answer("p1"), 0, -1) == ["approve"]
    assert 0 < redis.ttl(keys.approval_answer("p1")) <= 3600


def test_silence_is_waited_out_to_the_end_of_the_timeout(redis: redis_py.Redis) -> None:
    started = time.monotonic()
    assert ApprovalQueue(redis, "s1").ask(request(), 1.5)[0] == "deny"
    assert time.monotonic() - started >= 1.5


def test_a_childs_approver_denies_once_its_agent_is_cancelled(redis: redis_py.Redis) -> None:
    cancelled = threading.Event()
    cancelled.set()
    approver = QueueApprover(ApprovalQueue(redis, "s1"), 30, cancelled.is_set)
    assert approver(request()) == Answer("deny", "the agent was cancelled")
