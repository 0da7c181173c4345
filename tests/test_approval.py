"""Policies always/never/once/review, the reviewer, the terminal approver, why a denial
was made reaching the model, and the requests of a child that is gone expiring."""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest
import redis as redis_lib

from swarm.agent.approval import ApprovalGate, TerminalApprover, deny_all
from swarm.agent.protocols import Approver
from swarm.config import Settings, parse_policies
from swarm.domain.approval import Answer, ApprovalRequest, Decision
from swarm.store import keys
from swarm.store.approvals import EXPIRED, ApprovalQueue, QueueApprover, outcome
from swarm.store.ledger import Ledger
from tests.helpers import child_run, spawn_children, wait_until

R1 = child_run("aroot", "a1")


class Recorder:
    def __init__(self, *answers: Decision | Answer) -> None:
        self.answers = [a if isinstance(a, Answer) else Answer(a) for a in answers]
        self.asked: list[ApprovalRequest] = []

    def __call__(self, request: ApprovalRequest, /) -> Answer:
        self.asked.append(request)
        return self.answers.pop(0)


def req(tool: str = "run_cli", summary: str = "rm -rf build") -> ApprovalRequest:
    return ApprovalRequest(tool, {"command": summary}, summary)


def gate(policy: str, approver: Approver, reviewer: object = None, yes: bool = False
         ) -> ApprovalGate:
    return ApprovalGate(lambda tool: policy, approver, reviewer, yes=yes)  # type: ignore[arg-type]


def test_never_runs_without_asking() -> None:
    ask = Recorder()
    assert gate("never", ask).check(req()).allowed
    assert ask.asked == []


def test_always_asks_every_time() -> None:
    ask = Recorder("approve", "approve", "deny")
    g = gate("always", ask)
    assert [g.check(req()).allowed for _ in range(3)] == [True, True, False]
    assert len(ask.asked) == 3


def test_once_asks_until_approved_then_remembers() -> None:
    ask = Recorder("deny", "approve")
    g = gate("once", ask)
    assert not g.check(req()).allowed
    assert g.check(req()).allowed
    assert g.check(req()).allowed
    assert len(ask.asked) == 2


def test_review_passes_read_only_and_asks_for_the_rest() -> None:
    ask = Recorder("deny")
    g = gate("review", ask, reviewer=lambda cmd: cmd.startswith("ls"))
    assert g.check(req(summary="ls -la")).reason == "reviewer: read-only"
    verdict = g.check(req(summary="rm -rf /"))
    assert not verdict.allowed
    assert "reviewer" in ask.asked[0].reason


def test_always_answer_remembers_for_the_session() -> None:
    ask = Recorder("always")
    g = gate("always", ask)
    assert g.check(req()).allowed and g.check(req()).allowed
    assert len(ask.asked) == 1


def test_a_denial_says_why_it_was_denied() -> None:
    g = gate("always", Recorder(Answer("deny", "no one answered within 5 s"), "deny"))
    assert g.check(req()).reason == "no one answered within 5 s"
    assert g.check(req()).reason == "denied by the user"  # an answer without a reason


def test_a_child_is_told_no_one_answered_its_approval(redis: redis_lib.Redis) -> None:
    """The queue's reason (its timeout) reaches the verdict through the Approver protocol."""
    approver = QueueApprover(ApprovalQueue(redis, "s-why"), timeout=0)
    verdict = gate("always", approver).check(req())
    assert not verdict.allowed
    assert verdict.reason == "no one answered within 0 s"


GONE = pytest.mark.parametrize("gone", [{"lease_until": "0"}, {"lease": "tok-next"}],
                               ids=["its lease ran out", "another attempt took the run"])


def asking(redis: redis_lib.Redis) -> tuple[threading.Thread, threading.Event, list[Any]]:
    """A child's attempt (run :data:`R1` of agent a1, lease token "tok") asking for
    approval in a thread: the thread, the event that stops it, and the list its verdict is
    appended to."""
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aroot", "/w", "task", {}, "host", "aroot")
    spawn_children(ledger, "s1", "aroot", "a1")
    run = ledger.run(R1)
    assert run is not None
    claim = ledger.start(run.id, "tok", 30.0, "host")
    assert claim is not None and claim.claimed
    stop = threading.Event()
    got: list[Any] = []
    asker = ApprovalQueue(redis, "s1", run=R1, lease="tok")
    thread = threading.Thread(target=lambda: got.append(asker.ask(req(), 30, stop.is_set)),
                              daemon=True)
    thread.start()
    return thread, stop, got


@GONE
def test_a_request_of_an_attempt_that_is_gone_expires(redis: redis_lib.Redis,
                                                      gone: dict[str, str]) -> None:
    thread, stop, got = asking(redis)
    listed = wait_until(lambda: ApprovalQueue(redis, "s1").pending(), "the request")
    assert ApprovalQueue(redis, "s1").pending() == listed  # listed while its lease holds
    redis.hset(keys.run(R1), mapping=gone)  # the worker died, or the run was taken over
    assert ApprovalQueue(redis, "s1").pending() == []
    assert outcome(redis, listed[0].id) == EXPIRED
    assert not redis.hexists(keys.approvals("s1"), listed[0].id)
    assert not ApprovalQueue(redis, "s1").answer(listed[0].id, "approve")
    stop.set()  # an asker still alive (a partitioned worker) stops: denied, never approved
    thread.join(timeout=10)
    assert got and got[0][0] == "deny"


@GONE
def test_an_answer_to_a_request_of_an_attempt_that_is_gone_is_refused(
        redis: redis_lib.Redis, gone: dict[str, str]) -> None:
    """``swarm approve ID`` and the API answer without listing the queue first: answer()
    itself refuses a request whose attempt is gone, and closes it as expired."""
    thread, stop, got = asking(redis)
    approval_id = wait_until(lambda: redis.hkeys(keys.approvals("s1")), "the request")[0]
    redis.hset(keys.run(R1), mapping=gone)
    assert not ApprovalQueue(redis, "s1").answer(approval_id, "approve")
    assert outcome(redis, approval_id) == EXPIRED
    assert not redis.hexists(keys.approvals("s1"), approval_id)
    assert redis.llen(keys.approval_answer(approval_id)) == 0  # no approval on its way
    stop.set()
    thread.join(timeout=10)
    assert got and got[0][0] == "deny"


def test_nobody_to_ask_denies_and_says_so() -> None:
    assert gate("always", deny_all).check(req()).reason == "there is no one to ask"


def test_yes_skips_every_policy() -> None:
    ask = Recorder()
    assert gate("always", ask, yes=True).check(req()).allowed
    assert ask.asked == []


@pytest.mark.parametrize(("typed", "decision"), [
    ("y\n", "approve"), ("YES\n", "approve"), ("a\n", "always"), ("n\n", "deny"),
    ("\n", "deny"), ("maybe\n", "deny"), ("", "deny"),
])
def test_terminal_approver_answers(typed: str, decision: str) -> None:
    err = io.StringIO()
    assert TerminalApprover(io.StringIO(typed), err)(req()).decision == decision
    assert "rm -rf build" in err.getvalue()


def test_terminal_approver_closed_stdin_denies() -> None:
    stdin = io.StringIO("y\n")
    stdin.close()
    err = io.StringIO()
    assert TerminalApprover(stdin, err)(req()) == Answer("deny", "no one answered "
                                                         "(stdin is closed)")
    assert "denied" in err.getvalue()


def test_policies_parse_and_default() -> None:
    policies = parse_policies("run_cli=always, *=never")
    assert policies == {"run_cli": "always", "*": "never"}
    s = Settings.from_env({"SWARM_APPROVAL": "run_cli=always,*=never"})
    assert s.policy_for("run_cli") == "always"
    assert s.policy_for("my_tool") == "never"
    assert Settings.from_env({}).policy_for("run_cli") == "review"
    assert Settings.from_env({}).policy_for("my_tool") == "once"


@pytest.mark.parametrize(("answer", "allowed"), [
    ("ALLOW", True), ("allow", True), (" **ALLOW**. ", True), ('"ALLOW"', True),
    ("DENY", False), ("DISALLOW", False), ("NOT ALLOWED", False), ("I cannot ALLOW this", False),
    ("ALLOW or DENY", False), ("", False), ("ALLOWED", False),
])
def test_reviewer_answer_parsing_fails_safe(answer: str, allowed: bool) -> None:
    from swarm.agent.approval import reviewer_allows

    assert reviewer_allows(answer) is allowed
