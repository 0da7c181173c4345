"""The coordinator: turns spawn requests into children, and settled children into results.

A thin loop over the ledger's inbox (two Redis streams read with a consumer group, so
several coordinators can run); every state change is a :class:`~swarm.store.ledger.Ledger`
transition, and this module adds the policy (which calls are refused) and the Celery
tasks:

- ``spawn``: a parent's ``agent`` calls, admitted (or refused) by the parent as it
  parked (:mod:`swarm.runtime.spawner`). One ledger transition claims the request,
  holding runs over the swarm's in-flight limit; the rest are sent as
  ``swarm.agent.run`` tasks.
- ``settle``: a run finished. Held runs are released (if its swarm held any as it
  settled: the entry says so, and names the run's request), and when every run of the
  request has settled the ledger answers the parent's calls in its session; the parent is woken
  (a root in a terminal) or resumed (``swarm.agent.resume``). A background run's parent
  is answered only if it waits on it (``agent_join``), once the wait is met.
- every :data:`REAP_EVERY` seconds: entries of dead coordinators are taken over, runs
  of dead workers (their lease ran out) are re-sent, and parents whose resume task was not
  claimed within ``SWARM_TAKEOVER_GRACE`` (it was lost with its worker) are resumed again.

Every step is idempotent, so an entry handled twice (after a crash) changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from swarm import faults
from swarm.broker import names
from swarm.broker.app import host_queue
from swarm.broker.events import BufferedEvents, SentEvents
from swarm.cache import TTLCache
from swarm.config import Settings
from swarm.runtime.jobs import job_run_id
from swarm.store import keys
from swarm.store.ledger import Joined, Ledger, NewRun, derive_id

log = logging.getLogger(__name__)

BLOCK_MS = 1000
BATCH = 64
#: Seconds between passes over dead coordinators' entries and dead workers' runs.
REAP_EVERY = 2.0
#: Seconds between the coordinator's heartbeats (its key lives ``keys.HEARTBEAT_TTL``).
BEAT_EVERY = 1.0
#: Seconds a swarm's limits are remembered (they are fixed when the swarm is created).
LIMITS_TTL = 5.0


def root_task_id(swarm_id: str) -> str:
    """The Celery ``root_id`` of every task of a swarm: the task of its root. A job's root
    runs as that task; a root in a terminal runs as no task, and its swarm is still grouped
    under the same id in Flower (its depth-1 children name it as their ``parent_id`` too)."""
    return job_run_id(swarm_id)


class Coordinator:
    """One coordinator process (or thread); ``run()`` until ``stop`` is set."""

    def __init__(self, redis_: redis.Redis, app: Celery, settings: Settings,
                 name: str | None = None) -> None:
        self.redis = redis_
        self.app = app
        self.settings = settings
        self.name = name or f"{socket.gethostname()}-{id(self):x}"
        self.ledger = Ledger(redis_, grace=settings.takeover_grace)
        self.stop = threading.Event()
        self._limits: TTLCache[str, Settings] = TTLCache(LIMITS_TTL)
        self.events = BufferedEvents(app)

    def run(self) -> None:
        """Serve until :attr:`stop` is set."""
        self.ledger.open_inbox()
        last_reclaim = last_beat = 0.0
        while not self.stop.is_set():
            try:
                # A pass per batch handled: under load, many a second; one beat a second does.
                if time.monotonic() - last_beat >= BEAT_EVERY:
                    self.redis.set(keys.heartbeat("coordinator", self.name), time.time(),
                                   ex=keys.HEARTBEAT_TTL)
                    last_beat = time.monotonic()
                if time.monotonic() - last_reclaim > REAP_EVERY:
                    self.reclaim()
                    self.reap()
                    last_reclaim = time.monotonic()
                self.poll()
            except (redis.RedisError, OperationalError) as exc:
                # Entries being handled stay pending and are claimed again; a Redis that
                # restarted without its streams needs the groups made again.
                log.warning("coordinator: Redis or the broker failed (%s); retrying", exc)
                self.stop.wait(1.0)
                with contextlib.suppress(redis.RedisError):
                    self.ledger.open_inbox()

    def poll(self, block_ms: int = BLOCK_MS) -> int:
        """Handle what arrived on both streams; returns how many entries were handled."""
        entries = self.ledger.read_inbox(self.name, BATCH, block_ms)
        self.handle_all(entries)
        return len(entries)

    def reclaim(self) -> None:
        """Take over entries another coordinator read but never acknowledged (it died)."""
        self.handle_all(self.ledger.reclaim_inbox(
            self.name, self.settings.reclaim_idle * 1000, BATCH))

    def handle_all(self, entries: list[tuple[str, str, dict[str, str]]]) -> None:
        """Handle ``entries`` in order, then acknowledge those handled in one round trip
        (an entry handled but not acknowledged when a coordinator dies is handled again,
        which changes nothing)."""
        handled: list[tuple[str, str]] = []
        try:
            for stream, entry_id, fields in entries:
                self.handle(stream, entry_id, fields)
                handled.append((stream, entry_id))
        finally:
            self.ledger.ack(handled)

    def reap(self) -> int:
        """Re-send runs whose lease ran out: their worker died (or froze) mid-run. The
        next worker to claim one resumes it from its last saved step. A parked parent
        among them had its request joined but its resume task was never claimed: it is
        sent again."""
        runs = self.ledger.reap()
        for new in runs:
            if new.run.state == "parked":
                log.warning("run %s: its resume was not claimed; sending it again", new.run.id)
                self.send_resume(new.run.id, new.run.agent, new.depth, new.run.swarm,
                                 parent_id=new.run.id)
                continue
            log.warning("run %s: lease expired; handing it to another worker", new.run.id)
            self.send_runs([new], new.run.swarm)
        return len(runs)

    def handle(self, stream: str, entry_id: str, fields: dict[str, str]) -> None:
        try:
            if stream == keys.spawn_stream():
                self.spawn(fields["request"])
            elif "freed" in fields:  # a resumed parent parked again: its slot is free
                self.release(fields["freed"])
            else:
                self.settled(fields["run"], fields.get("request"), fields.get("held") != "0")
        except (redis.ConnectionError, redis.TimeoutError, OperationalError):
            raise  # left pending: handled again (here or by another coordinator)
        except Exception:
            log.exception("coordinator: %s entry %s failed", stream, entry_id)

    # -- spawn -------------------------------------------------------------------------------

    def limits(self, swarm_id: str) -> Settings:
        """The swarm's depth, children, parallel and token limits and its output cap (read
        at most every few seconds: they are fixed when the swarm is created)."""
        return self._limits.get_or_load(swarm_id, lambda: self.settings.with_(**{
            k: v for k, v in self.ledger.swarm_settings(swarm_id).items()
            if k in ("max_depth", "max_children", "max_parallel", "token_budget",
                     "output_cap")}))

    def spawn(self, request_id: str) -> None:
        """Claim the request (its calls were admitted as the parent parked), send its
        runs, mark it dispatched; join it if every run settled already (all refused, say).
        A replay (a coordinator died mid-way) re-sends what is not going yet (a task sent
        twice is claimed once), or joins, or resumes its parent again."""
        claim = self.ledger.dispatch(request_id)
        if claim is None:
            return
        self.send_runs(claim.send, claim.swarm_id)
        complete = claim.complete
        if claim.state == "dispatching":
            # Only now: a coordinator that dies while sending leaves it dispatching.
            complete = self.ledger.dispatched(request_id)
        if complete:
            self.join(request_id, swarm_id=claim.swarm_id)

    def send_runs(self, runs: list[NewRun], swarm_id: str) -> None:
        """Send ``swarm.agent.run`` for each run, on one producer, as a child of its parent
        agent's task (the swarm's root task where the parent runs as none)."""
        if not runs:
            return
        root = root_task_id(swarm_id) if swarm_id else None
        # Their task-sent events (for Flower) go after the batch, as one message: sent one
        # by one they were half of the coordinator's CPU per run.
        sent = SentEvents(self.events)
        try:
            with self.app.producer_or_acquire() as producer:
                for i, new in enumerate(runs):
                    self.send_run(new, producer, sent, parent_id=new.parent_run or root,
                                  root_id=root)
                    if i == 0:
                        faults.point("coordinator-after-first-dispatch")
        finally:
            sent.flush()

    def send_run(self, new: NewRun, producer: Any = None, sent: SentEvents | None = None, *,
                 parent_id: str | None = None, root_id: str | None = None) -> None:
        """Send one run's task; ``parent_id`` and ``root_id`` go in Celery's headers of the
        same names (and its task events), so Flower links the task to its parent and root."""
        run = new.run
        shadow = f"agent {run.agent} depth {new.depth}: {new.label}"[:200]
        # A child whose folder is on a host with a live worker goes to that host's queue:
        # any other worker would hand it back. A host gone for good: anyone's (to fail it
        # with "workspace lost").
        queue = host_queue(new.host) if new.host and self.redis.exists(
            keys.worker_host(new.host)) else None
        if sent is not None:
            sent.name(run.id, shadow)
        self.app.send_task(
            names.RUN, args=[run.id], task_id=run.id, shadow=shadow,
            argsrepr=repr((run.id,)), kwargsrepr="{}",
            headers={"traceparent": new.traceparent} if new.traceparent else None,
            parent_id=parent_id, root_id=root_id, queue=queue,
            producer=producer, event_dispatcher=sent, ignore_result=True)

    # -- settle and fan-in ---------------------------------------------------------------------

    def settled(self, run_id: str, request_id: str | None = None, held: bool = True) -> None:
        """Run ``run_id`` of request ``request_id`` (None: read from the run) settled;
        ``held``: runs of its swarm were held as it settled (False: none to release)."""
        request_id, head = self.ledger.request_of(run_id, request_id)
        if head.get("swarm"):
            if held:
                self.release(head["swarm"])
            if head.get("kind") == "background":
                self.answer_wait(self.ledger.waiter_of(run_id), head["swarm"])
            else:
                self.join(request_id, head)

    def answer_wait(self, wait_id: str, swarm_id: str) -> None:
        """A background run settled: if its parent waits on it (``agent_join``, or a final
        answer given while it ran) and the wait is met, the ledger answers the parent,
        which is woken (a root) or resumed here."""
        if not wait_id:
            return
        joined = self.ledger.answer_wait(wait_id, session_ttl=self.settings.session_ttl,
                                         cap=self.limits(swarm_id).output_cap)
        if joined is not None and joined.resume:
            self.resume(joined)

    def release(self, swarm_id: str) -> None:
        """Send held-back runs while the swarm has fewer than ``max_parallel`` in flight."""
        self.send_runs(self.ledger.release(swarm_id, self.limits(swarm_id).max_parallel),
                       swarm_id)

    def join(self, request_id: str, head: dict[str, str] | None = None,
             swarm_id: str = "") -> None:
        """When every run of the request has settled, the ledger answers the parent (and
        wakes a root), each child's answer within the swarm's output cap; a parent in a
        worker is resumed here."""
        swarm_id = swarm_id or (head or {}).get("swarm", "")
        cap = self.limits(swarm_id).output_cap if swarm_id else self.settings.output_cap
        joined = self.ledger.join(request_id, head, session_ttl=self.settings.session_ttl,
                                  cap=cap)
        if joined is not None and joined.resume:
            self.resume(joined)

    def resume(self, joined: Joined) -> None:
        """Send the resume task of a parent in a worker (a duplicate resume is a no-op),
        then mark the request joined."""
        parent = joined.parent
        # In Flower the resume is a child of the run it carries on.
        self.send_resume(parent.run, parent.id, parent.depth, joined.swarm_id,
                         task_id=derive_id("m", joined.request_id),
                         parent_id=parent.run or None)
        self.ledger.resumed(joined.request_id)

    def send_resume(self, run_id: str, agent_id: str, depth: int | str, swarm_id: str,
                    task_id: str | None = None, parent_id: str | None = None) -> None:
        """Send ``swarm.agent.resume`` for the parked run ``run_id`` (a second one is a
        no-op: one claim from parked wins)."""
        self.app.send_task(
            names.RESUME, args=[run_id], task_id=task_id,
            shadow=f"resume agent {agent_id} depth {depth}",
            argsrepr=repr((run_id,)), kwargsrepr="{}", ignore_result=True,
            parent_id=parent_id, root_id=root_task_id(swarm_id))
