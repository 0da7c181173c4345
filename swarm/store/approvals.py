"""Approvals from children reach a person: a Redis queue per swarm.

A child that must ask (its policy says so) adds a request to the swarm's hash and waits
on its own answer list; the root terminal (or ``swarm approve`` from another one) shows
pending requests and pushes ``approve`` / ``deny`` / ``always`` (approve this tool for the
whole swarm). Silence is not consent: no answer within the timeout denies.

Each request is closed once: the first answer (or the timeout, or a cancel) sets its
"answered" marker, so a second answer is told it came too late (:func:`outcome`).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import redis

from swarm.domain.approval import Answer, ApprovalRequest, Decision
from swarm.store import keys

DECISIONS: tuple[Decision, ...] = ("approve", "deny", "always")
#: How a request no person answered was closed: its child gave up waiting.
TIMED_OUT, CANCELLED = "timed out", "cancelled"


def outcome(redis_: redis.Redis, approval_id: str) -> str | None:
    """How a request that is no longer pending was closed: the decision it was answered
    with, :data:`TIMED_OUT` or :data:`CANCELLED`; None when it is pending or unknown."""
    got = redis_.get(keys.approval_answered(approval_id))
    return None if got is None else str(got)


@dataclass(frozen=True)
class Pending:
    """An approval request waiting for a person."""

    id: str
    swarm: str
    agent: str
    tool: str
    summary: str
    reason: str
    created: float


class ApprovalQueue:
    """The approval requests of one swarm."""

    def __init__(self, redis_: redis.Redis, swarm_id: str) -> None:
        self.redis = redis_
        self.swarm_id = swarm_id

    def ask(self, request: ApprovalRequest, timeout: float,
            cancelled: Callable[[], bool] = lambda: False) -> tuple[Decision, str]:
        """Queue ``request`` and wait for a person; returns the decision and why."""
        if self.redis.sismember(keys.swarm_approved(self.swarm_id), request.tool):
            return "approve", "approved for this swarm"
        approval_id = "p" + secrets.token_hex(6)
        entry = {"id": approval_id, "swarm": self.swarm_id, "agent": request.agent_id,
                 "tool": request.tool, "summary": request.summary[:2000],
                 "reason": request.reason, "created": time.time()}
        with self.redis.pipeline() as pipe:
            pipe.hset(keys.approvals(self.swarm_id), approval_id, json.dumps(entry))
            pipe.expire(keys.approvals(self.swarm_id), keys.LEDGER_TTL)
            pipe.xadd(keys.events(self.swarm_id), {"kind": "approval", "agent": request.agent_id,
                                                    "text": request.summary[:300],
                                                    "ts": f"{time.time():.3f}"},
                      maxlen=keys.EVENTS_MAXLEN, approximate=True)
            pipe.execute()
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                gave_up = TIMED_OUT if left <= 0 else CANCELLED if cancelled() else ""
                if gave_up and self._close(approval_id, gave_up):
                    return "deny", (f"no one answered within {timeout:.0f} s"
                                    if gave_up == TIMED_OUT else "the agent was cancelled")
                # Still waiting, or a person answered just before: the answer is on its way.
                got = self.redis.blpop([keys.approval_answer(approval_id)],
                                       timeout=1.0 if gave_up else max(0.1, min(1.0, left)))
                if got is not None:
                    decision = cast("tuple[str, str]", got)[1]
                    if decision in DECISIONS:
                        return decision, "answered by a person"
                    return "deny", f"unknown answer {decision!r}"
                if gave_up:
                    return "deny", "the person's answer did not arrive"
        finally:
            self.redis.hdel(keys.approvals(self.swarm_id), approval_id)

    def pending(self) -> list[Pending]:
        """Requests waiting for an answer, oldest first (not those answered already whose
        child has yet to read the answer)."""
        rows = cast("dict[str, str]", self.redis.hgetall(keys.approvals(self.swarm_id)))
        if not rows:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for approval_id in rows:
                pipe.exists(keys.approval_answered(approval_id))
            closed = pipe.execute()
        out = [Pending(**{k: v for k, v in json.loads(raw).items()
                          if k in Pending.__dataclass_fields__})
               for raw, done in zip(rows.values(), closed, strict=True) if not done]
        return sorted(out, key=lambda p: p.created)

    def answer(self, approval_id: str, decision: Decision) -> bool:
        """Answer a pending request; False when it is not (or no longer) pending, or was
        answered already (:func:`outcome` then tells how)."""
        raw = self.redis.hget(keys.approvals(self.swarm_id), approval_id)
        if raw is None or not self._close(approval_id, decision):
            return False
        if decision == "always":
            tool = json.loads(cast(str, raw))["tool"]
            self.redis.sadd(keys.swarm_approved(self.swarm_id), tool)
            self.redis.expire(keys.swarm_approved(self.swarm_id), keys.LEDGER_TTL)
        with self.redis.pipeline() as pipe:
            pipe.rpush(keys.approval_answer(approval_id), decision)
            pipe.expire(keys.approval_answer(approval_id), 3600)
            pipe.execute()
        return True

    def _close(self, approval_id: str, how: str) -> bool:
        """Mark the request closed (answered ``how``); False when it was closed already."""
        return bool(self.redis.set(keys.approval_answered(approval_id), how, nx=True,
                                   ex=keys.APPROVAL_ANSWERED_TTL))


class QueueApprover:
    """The approver of a child (:class:`swarm.agent.protocols.Approver`): asks through the
    swarm's queue, denies on silence and says so."""

    def __init__(self, queue: ApprovalQueue, timeout: float,
                 cancelled: Callable[[], bool] = lambda: False) -> None:
        self.queue = queue
        self.timeout = timeout
        self.cancelled = cancelled

    def __call__(self, request: ApprovalRequest, /) -> Answer:
        return Answer(*self.queue.ask(request, self.timeout, self.cancelled))
