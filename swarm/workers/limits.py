"""The limits of one running child: ``swarm cancel``, its wall time, the swarm's token
budget, a lost lease. Checked between the agent's steps, in the worker's thread; a stop
also cuts short the command or the model call in flight."""

from __future__ import annotations

import logging
import time

import redis

from swarm.agent.loop import Agent
from swarm.config import Settings
from swarm.errors import BudgetExceeded, Cancelled, LeaseLost, TimedOut
from swarm.workers.prompts import WRAP_UP
from swarm.workers.supervisor import Supervisor, Watched

log = logging.getLogger(__name__)


class Control:
    """Stops one running child between steps: ``swarm cancel``, its wall-time limit, the
    token budget, a lost lease.

    The process's :class:`Supervisor` sets :attr:`event` (which also kills a running
    command and aborts a model call in flight) on cancel, at the hard deadline or when the
    lease is lost; :meth:`before_step` stops the loop between steps (and says why after an
    aborted model call), and asks the child to wrap up at 80% of its time.
    """

    def __init__(self, redis_: redis.Redis, swarm_id: str, watched: Watched,
                 settings: Settings, supervisor: Supervisor, *, cancelled: bool,
                 spent: int) -> None:
        """``cancelled`` (while it waited in the queue: it stops before its first model
        call) and ``spent`` (the swarm's tokens before this child or this resume started:
        they count too) are read with the claim (:meth:`Ledger.start`)."""
        self.redis, self.swarm_id, self.watched = redis_, swarm_id, watched
        self.supervisor = supervisor
        self.limit = settings.child_timeout
        self.budget = settings.token_budget
        self.event = watched.event
        self.warned = False
        if cancelled:
            self.event.set()
        self.tokens = spent if self.budget else 0

    @property
    def timed_out(self) -> bool:
        return self.watched.timed_out

    def cancelled(self) -> bool:
        return self.event.is_set()

    def check_lease(self) -> None:
        """Raise :class:`LeaseLost` if this worker no longer holds the run's lease: called
        before every tool call and every save, so a worker cut off from Redis runs no
        command and writes no session once another worker may have the run."""
        if self.watched.lease_lost:
            raise LeaseLost(f"run {self.watched.run_id}: this worker lost its lease (Redis "
                            "unreachable for too long, or another worker took it over)")

    def before_step(self, agent: Agent) -> None:
        if self.event.is_set():
            self.check_lease()
            if self.timed_out:
                raise TimedOut(f"wall-time limit of {self.limit} s reached "
                               "(SWARM_CHILD_TIMEOUT)")
            raise Cancelled("cancelled (swarm cancel, or its parent was cancelled)")
        if self.budget and self.tokens >= self.budget:
            raise BudgetExceeded(f"the swarm used {self.tokens} tokens of its budget of "
                                 f"{self.budget} (SWARM_TOKEN_BUDGET)")
        used = time.monotonic() - self.watched.start
        if not self.warned and used >= 0.8 * self.limit:
            self.warned = True
            agent.messages.append({"role": "user",
                                   "content": WRAP_UP.format(used=used, limit=self.limit)})

    def count(self, tokens: int) -> None:
        """Add a model call's tokens to the swarm's count: at once when the swarm has a
        budget (its total decides whether to go on), else with the next progress flush."""
        if not self.budget:
            self.supervisor.add_tokens(self.swarm_id, tokens)
            return
        try:
            self.tokens = self.supervisor.ledger.spend(self.swarm_id, tokens)
        except redis.RedisError as exc:
            log.warning("token count not recorded: %s", exc)
