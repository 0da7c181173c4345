"""One thread per worker process that watches every child the process runs.

Each pass (every :data:`POLL` seconds) asks Redis in one round trip which children were
cancelled (``swarm cancel``), checks their wall-time limits, and every ``lease / 3``
seconds renews all their leases in one more round trip. A child whose lease was taken
over by another worker is told to stop. With one thread and two pipelines per process,
the cost no longer grows by two threads and a command a second per child.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import redis

from swarm.store import keys
from swarm.store.ledger import Ledger

log = logging.getLogger(__name__)

#: Seconds between passes: how soon a cancel or a wall-time limit stops a running command.
POLL = 0.5


@dataclass(eq=False)
class Watched:
    """One running child, as the supervisor sees it."""

    run_id: str
    agent_id: str
    token: str
    """The run's lease token ("" for a child without a lease to renew)."""
    limit: float
    """Wall-time limit in seconds, counted from ``start``."""
    event: threading.Event = field(default_factory=threading.Event)
    """Set on cancel, at the deadline, or when the lease is lost: kills a running command."""
    start: float = field(default_factory=time.monotonic)
    timed_out: bool = False
    lost: bool = False
    """Another worker took the run over (this one was too slow to renew its lease)."""


class Supervisor:
    """Cancel flags, deadlines and lease renewals of a process's running children."""

    def __init__(self, redis_: redis.Redis, lease: float, poll: float = POLL) -> None:
        self.redis = redis_
        self.ledger = Ledger(redis_)
        self.lease = lease
        self.poll = poll
        self._children: set[Watched] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._next_renewal = 0.0

    def watch(self, child: Watched) -> Watched:
        """Start watching ``child`` (and start the thread on first use)."""
        with self._lock:
            self._children.add(child)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="swarm-supervisor")
                self._thread.start()
        return child

    def forget(self, child: Watched) -> None:
        with self._lock:
            self._children.discard(child)

    def _loop(self) -> None:
        while True:
            time.sleep(self.poll)
            with self._lock:
                children = list(self._children)
            if not children:
                continue
            try:
                self.check(children)
            except redis.RedisError as exc:  # Redis restarting: try again next pass
                log.warning("supervisor: %s", exc)

    def check(self, children: list[Watched]) -> None:
        """One pass over ``children``: deadlines, cancel flags, and leases when due."""
        now = time.monotonic()
        live = []
        for child in children:
            if not child.event.is_set() and now - child.start >= child.limit:
                child.timed_out = True
                child.event.set()
            if not child.event.is_set():
                live.append(child)
        if not live:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for child in live:
                pipe.exists(keys.cancel(child.agent_id))
            flags = pipe.execute()
        for child, flag in zip(live, flags, strict=True):
            if flag:
                child.event.set()
        if now >= self._next_renewal:
            self._next_renewal = now + self.lease / 3
            self.renew([c for c in live if c.token and not c.event.is_set()])

    def renew(self, children: list[Watched]) -> None:
        if not children:
            return
        until = time.time() + self.lease
        with self.redis.pipeline(transaction=False) as pipe:
            for child in children:
                self.ledger.renew(child.run_id, child.token, self.lease, client=pipe,
                                  until=until)
            renewed = pipe.execute()
        for child, ok in zip(children, renewed, strict=True):
            if not ok:
                log.warning("run %s: lease lost to another worker; stopping", child.run_id)
                child.lost = True
                child.event.set()
