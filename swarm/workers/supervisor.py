"""One thread per worker process that watches every child the process runs.

Every :data:`POLL` seconds it asks Redis in one command (MGET) which children were
cancelled (``swarm cancel``) and checks their wall-time limits; every ``lease / 3`` seconds
it renews all their leases in one more round trip, one script (a child whose lease was
taken over by another worker is told to stop). Every :data:`FLUSH` seconds it writes what
the children reported meanwhile (their last action and turn count, ``tool`` events; the
tokens spent every :data:`TOKENS_EVERY` seconds) in one pipeline, and runs the flush hooks
(the children's Flower events, batched).

So a running child costs no thread of its own, no command a second, and no round trip
for its progress: under load, every blocking call of a thread is another wait for the
GIL behind all the others, so fewer calls per turn make every turn shorter.

A second thread, the watchdog, never touches Redis: it stops a child at its wall-time
deadline, and stops a child whose lease this worker could not renew in time (Redis
unreachable, the host cut off) *before* the lease can run out on the server and another
worker take the run over: so a command never runs on two hosts at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from swarm.domain.stop import StopEvent
from swarm.store.ledger import Ledger, Progress

log = logging.getLogger(__name__)

#: Seconds between checks: how soon a cancel or a wall-time limit stops a running command.
POLL = 0.5
#: Seconds between writes of the children's progress (and flushes of their Flower events).
FLUSH = 0.2
#: Seconds between writes of the tokens they spent (the swarm's count, without a budget:
#: a swarm with a budget counts each model call at once), unless a child settles first.
TOKENS_EVERY = 1.0


@dataclass(eq=False)
class Watched:
    """One running child, as the supervisor sees it."""

    run_id: str
    agent_id: str
    token: str
    """The run's lease token ("" for a child without a lease to renew)."""
    limit: float
    """Wall-time limit in seconds, counted from ``start``."""
    event: StopEvent = field(default_factory=StopEvent)
    """Set on cancel, at the deadline, or when the lease is lost: kills a running command
    and aborts a model call in flight."""
    start: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the run began (earlier claims of it included)."""
    timed_out: bool = False
    lease_lost: bool = False
    valid_until: float = float("inf")
    """``time.monotonic()`` by which the lease must be renewed again (set by the
    supervisor from the time each renewal was sent, so it ends before the server's)."""


class Supervisor:
    """Cancel flags, deadlines and lease renewals of a process's running children."""

    def __init__(self, redis_: redis.Redis, lease: float, poll: float = POLL,
                 flush_every: float = FLUSH, tokens_every: float = TOKENS_EVERY) -> None:
        """``lease`` is the lease's length in seconds; a child is stopped when it has gone
        unrenewed for ``lease - margin`` (:meth:`margin`)."""
        self.redis = redis_
        self.ledger = Ledger(redis_)
        self.lease = lease
        self.poll = poll
        self.flush_every = flush_every
        self.tokens_every = tokens_every
        self.flush_hooks: list[Callable[[], None]] = []
        """Called after each write of progress (e.g. to send buffered Flower events)."""
        self._children: set[Watched] = set()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._next_check = 0.0
        self._next_renewal = 0.0
        self._progress: list[Progress] = []
        self._tokens: Counter[str] = Counter()

    @property
    def margin(self) -> float:
        """Seconds before the lease's end at which an unrenewed child is stopped: time to
        kill its command, at least one poll, at most a third of the lease."""
        return min(self.lease / 3, max(2 * self.poll, 1.0))

    def watch(self, child: Watched, claimed_at: float | None = None) -> Watched:
        """Start watching ``child``, whose lease was claimed by a call sent at
        ``claimed_at`` (``time.monotonic()``; default now), and start the threads on
        first use."""
        if child.token:
            sent = time.monotonic() if claimed_at is None else claimed_at
            child.valid_until = sent + self.lease - self.margin
        with self._lock:
            self._children.add(child)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="swarm-supervisor")
                self._thread.start()
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(target=self._watch_clock, daemon=True,
                                                  name="swarm-watchdog")
                self._watchdog.start()
        return child

    def forget(self, child: Watched) -> None:
        with self._lock:
            self._children.discard(child)

    # -- progress ---------------------------------------------------------------------------

    def progress(self, swarm_id: str, agent_id: str, *, last: str, turns: int,
                 tool: str) -> None:
        """A child started a tool: recorded in the ledger at the next flush."""
        with self._lock:
            self._progress.append(Progress(swarm_id, agent_id, last, turns, tool, time.time()))

    def add_tokens(self, swarm_id: str, tokens: int) -> None:
        """Tokens a child spent: added to the swarm's count at the next flush."""
        if tokens:
            with self._lock:
                self._tokens[swarm_id] += tokens

    def flush(self, tokens: bool = True) -> None:
        """Write the pending progress now, in one pipeline, and the tokens spent (unless
        ``tokens`` is False: they wait for a later flush), then run the flush hooks.

        A settling child calls this first, so its ``tool`` events precede its ``settled``
        event. Progress is best effort: what a Redis failure loses is not retried, except
        the token counts."""
        with self._flush_lock:
            with self._lock:
                progress, self._progress = self._progress, []
                spent: Counter[str] = Counter()
                if tokens:
                    spent, self._tokens = self._tokens, Counter()
            try:
                self.ledger.report(progress, dict(spent))
            except redis.RedisError as exc:
                log.debug("progress not recorded: %s", exc)
                with self._lock:
                    self._tokens.update(spent)
            for hook in self.flush_hooks:
                hook()

    # -- the thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        next_tokens = 0.0
        while True:
            time.sleep(self.flush_every)
            try:
                now = time.monotonic()
                self.flush(tokens=now >= next_tokens)
                if now >= next_tokens:
                    next_tokens = now + self.tokens_every
                if now < self._next_check:
                    continue
                self._next_check = now + self.poll
                with self._lock:
                    children = list(self._children)
                if children:
                    self.check(children)
            except redis.RedisError as exc:  # Redis restarting: try again next pass
                log.warning("supervisor: %s", exc)
            except Exception:  # the thread must outlive a bug in a hook
                log.exception("supervisor pass failed")

    def _watch_clock(self) -> None:
        while True:
            time.sleep(self.poll / 2)
            with self._lock:
                children = list(self._children)
            self.expire(children)

    def expire(self, children: list[Watched]) -> None:
        """Stop the children past their wall-time deadline or their lease (no Redis)."""
        now = time.monotonic()
        for child in children:
            if child.event.is_set():
                continue
            if now - child.start >= child.limit:
                child.timed_out = True
                child.event.set()
            elif now >= child.valid_until:
                log.warning("run %s: lease not renewed for %.1f s (Redis unreachable?); "
                            "stopping its commands before another worker takes it over",
                            child.run_id, self.lease - self.margin)
                child.lease_lost = True
                child.event.set()

    def check(self, children: list[Watched]) -> None:
        """One pass over ``children``: deadlines, cancel flags, and leases when due."""
        self.expire(children)
        now = time.monotonic()
        live = [child for child in children if not child.event.is_set()]
        if not live:
            return
        flags = self.ledger.cancelled([c.agent_id for c in live])
        for child, flag in zip(live, flags, strict=True):
            if flag:
                child.event.set()
        if now >= self._next_renewal:
            self._next_renewal = now + self.lease / 3
            self.renew([c for c in live if c.token and not c.event.is_set()])

    def renew(self, children: list[Watched]) -> None:
        if not children:
            return
        sent = time.monotonic()
        renewed = self.ledger.renew_all([(c.run_id, c.token) for c in children], self.lease)
        for child, ok in zip(children, renewed, strict=True):
            if ok:
                child.valid_until = sent + self.lease - self.margin
            else:
                # Another worker took the run over (this one was too slow to renew).
                log.warning("run %s: lease lost to another worker; stopping", child.run_id)
                child.lease_lost = True
                child.event.set()
