"""Approvals from children reach a person: a Redis queue per swarm.

A child that must ask (its policy says so) adds a request to the swarm's hash and waits
on its own answer list; the root terminal (or ``swarm approve`` from another one) shows
pending requests and pushes ``approve`` / ``deny`` / ``always`` (approve this tool for the
whole swarm). Silence is not consent: no answer within the timeout denies.

Each request is closed once: the first answer (or the timeout, or a cancel) sets its
"answered" marker, so a second answer is told it came too late (:func:`outcome`).

A request whose child is gone (its worker died, or was cut off and lost the run) is closed
as :data:`EXPIRED` by the next look at the queue (:meth:`ApprovalQueue.pending`): a request
carries the run and lease token of the attempt that asked, and once that lease no longer
holds the run, nobody waits for the answer. The run's next attempt resumes from its last
saved step, where that tool call shows as interrupted: its model asks again if it still
needs the call, as a new request.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis

from swarm.domain.approval import Answer, ApprovalRequest, Decision
from swarm.store import keys
from swarm.store.ledger import Ledger

log = logging.getLogger(__name__)

DECISIONS: tuple[Decision, ...] = ("approve", "deny", "always")
#: How a request no person answered was closed: its child gave up waiting, or was gone.
TIMED_OUT, CANCELLED, EXPIRED = "timed out", "cancelled", "expired"

# Close a request (once) and drop it from the queue, in one step.
_EXPIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('HDEL', KEYS[2], ARGV[3])
  return 1
end
return 0
"""


def outcome(redis_: redis.Redis, approval_id: str) -> str | None:
    """How a request that is no longer pending was closed: the decision it was answered
    with, :data:`TIMED_OUT`, :data:`CANCELLED` or :data:`EXPIRED`; None when it is pending
    or unknown."""
    got = redis_.get(keys.approval_answered(approval_id))
    return None if got is None else str(got)


def swarm_of(redis_: redis.Redis, approval_id: str) -> str:
    """The swarm the request ``approval_id`` was asked in ("" when unknown)."""
    got = redis_.get(keys.approval_swarm(approval_id))
    return "" if got is None else str(got)


def closed_because(how: str) -> str:
    """Why a closed request can no longer be answered (``how``: :func:`outcome`'s)."""
    return {TIMED_OUT: "no one answered in time, so it was denied",
            CANCELLED: "its agent was cancelled",
            EXPIRED: "the agent that asked is gone (its worker died or lost the run); the "
                     "run's next attempt asks again if it still needs the call"
            }.get(how, f"it was answered already ({how})")


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
    """The approval requests of one swarm. A child's queue names the run and the lease
    token of its attempt (``run``, ``lease``), so its requests expire when the attempt is
    gone."""

    def __init__(self, redis_: redis.Redis, swarm_id: str, *, run: str = "",
                 lease: str = "") -> None:
        self.redis = redis_
        self.swarm_id = swarm_id
        self.run, self.lease = run, lease
        self._expire = redis_.register_script(_EXPIRE)

    @functools.cached_property
    def _ledger(self) -> Ledger:
        return Ledger(self.redis)

    def _gone(self, entries: list[dict[str, Any]]) -> set[str]:
        """The ids of ``entries`` whose asking attempt no longer holds its run's lease."""
        holders = self._ledger.lease_holders(
            sorted({str(e["run"]) for e in entries if e.get("run")}))
        return {str(e["id"]) for e in entries
                if e.get("run") and holders.get(str(e["run"])) != e.get("lease")}

    def ask(self, request: ApprovalRequest, timeout: float,
            cancelled: Callable[[], bool] = lambda: False) -> tuple[Decision, str]:
        """Queue ``request`` and wait for a person; returns the decision and why."""
        if self.redis.sismember(keys.swarm_approved(self.swarm_id), request.tool):
            return "approve", "approved for this swarm"
        approval_id = "p" + secrets.token_hex(6)
        entry = {"id": approval_id, "swarm": self.swarm_id, "agent": request.agent_id,
                 "tool": request.tool, "summary": request.summary[:2000],
                 "reason": request.reason, "created": time.time()}
        if self.run and self.lease:
            entry.update(run=self.run, lease=self.lease)
        with self.redis.pipeline() as pipe:
            pipe.hset(keys.approvals(self.swarm_id), approval_id, json.dumps(entry))
            pipe.expire(keys.approvals(self.swarm_id), keys.LEDGER_TTL)
            pipe.set(keys.approval_swarm(approval_id), self.swarm_id, ex=keys.LEDGER_TTL)
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
        child has yet to read the answer). Requests of an attempt whose lease is gone are
        closed as :data:`EXPIRED` here, and not listed."""
        rows = cast("dict[str, str]", self.redis.hgetall(keys.approvals(self.swarm_id)))
        if not rows:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for approval_id in rows:
                pipe.exists(keys.approval_answered(approval_id))
            closed = pipe.execute()
        entries = [json.loads(raw) for raw, done in zip(rows.values(), closed, strict=True)
                   if not done]
        gone = self._gone(entries)
        for approval_id in gone:
            self._close_gone(approval_id)
        out = [Pending(**{k: v for k, v in entry.items() if k in Pending.__dataclass_fields__})
               for entry in entries if entry["id"] not in gone]
        return sorted(out, key=lambda p: p.created)

    def _close_gone(self, approval_id: str) -> None:
        """Close a request whose asking attempt is gone, and drop it from the queue."""
        if self._expire(keys=[keys.approval_answered(approval_id),
                              keys.approvals(self.swarm_id)],
                        args=[EXPIRED, keys.APPROVAL_ANSWERED_TTL, approval_id]):
            log.warning("approval %s in swarm %s expired: the agent that asked is gone",
                        approval_id, self.swarm_id)

    def answer(self, approval_id: str, decision: Decision) -> bool:
        """Answer a pending request; False when it is not (or no longer) pending, was
        answered already, or its asking attempt is gone (:func:`outcome` then tells how)."""
        raw = self.redis.hget(keys.approvals(self.swarm_id), approval_id)
        if raw is None:
            return False
        entry = json.loads(cast(str, raw))
        if self._gone([entry]):
            self._close_gone(approval_id)  # nobody would read the answer
            return False
        if not self._close(approval_id, decision):
            return False
        if decision == "always":
            tool = entry["tool"]
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
