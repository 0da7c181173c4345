"""The coordinator: turns spawn requests into children, and settled children into results.

It reads two Redis streams with a consumer group, so several coordinators can run:

- ``spawn``: a parent's ``agent`` calls. For each: check the limits (depth, children per
  swarm), write the child and its run into the ledger, then enqueue ``swarm.agent.run``
  — or hold it while the swarm has ``max_parallel`` children in flight.
- ``settle``: a run finished. Release held runs, and when every run of the request has
  settled, append all results of the parent's response to its session in call order and
  resume the parent (``swarm.agent.resume``, or a wake-up for the root in a terminal).

Every step is idempotent, so an entry handled twice (after a crash) changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, cast

import redis
from celery import Celery
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from kombu.exceptions import OperationalError

from swarm import faults
from swarm.broker.events import BufferedEvents, SentEvents
from swarm.config import Settings
from swarm.runtime.jobs import job_run_id
from swarm.store import keys
from swarm.store.ledger import SETTLED, Ledger, NewRun, Run, derive_id, label_of
from swarm.store.sessions import RedisSessionStore

log = logging.getLogger(__name__)

BLOCK_MS = 1000
BATCH = 64
#: Seconds between passes over dead coordinators' entries and dead workers' runs.
REAP_EVERY = 2.0
#: Seconds a re-sent run has to be claimed before it is re-sent again.
TAKEOVER_GRACE = 60.0
#: The largest task message a child accepts; bigger material belongs in a file.
MAX_MESSAGE = 256 * 1024
#: Seconds a swarm's limits are remembered (they are fixed when the swarm is created).
LIMITS_TTL = 5.0


def check_call(call: dict[str, Any]) -> str:
    """Why an ``agent`` call cannot be run as it is, or ""."""
    size = len(str(call.get("message", "")).encode())
    if size > MAX_MESSAGE:
        return (f"the message is {size / 1024:.0f} KiB; the limit is {MAX_MESSAGE // 1024} KiB. "
                "Write the material to a file the child can read and pass its path instead")
    schema = call.get("output_schema")
    if schema:
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            return f"output_schema is not a valid JSON Schema: {exc.message}"
    return ""


def root_task_id(swarm_id: str) -> str:
    """The Celery ``root_id`` of every task of a swarm: the task of its root. A job's root
    runs as that task; a root in a terminal runs as no task, and its swarm is still grouped
    under the same id in Flower (its depth-1 children name it as their ``parent_id`` too)."""
    return job_run_id(swarm_id)


def result_text(run: Run | None, call_id: str) -> str:
    """What the parent's model sees for one ``agent`` call."""
    if run is None:
        return json.dumps({"state": "failed", "error": f"no run was recorded for call {call_id}"})
    body: dict[str, Any] = {"agent_id": run.result.get("agent_id", run.agent), "state": run.state}
    for name in ("error", "output", "answer", "workspace", "git_branch", "diffstat",
                 "files_changed", "usage"):
        if run.result.get(name) not in (None, "", [], {}):
            body[name] = run.result[name]
    if "output" in body:
        body.pop("answer", None)
    return json.dumps(body, ensure_ascii=False, indent=1)


class Coordinator:
    """One coordinator process (or thread); ``run()`` until ``stop`` is set."""

    def __init__(self, redis_: redis.Redis, app: Celery, settings: Settings,
                 name: str | None = None) -> None:
        self.redis = redis_
        self.app = app
        self.settings = settings
        self.name = name or f"{socket.gethostname()}-{id(self):x}"
        self.ledger = Ledger(redis_)
        self.stop = threading.Event()
        self._limits: dict[str, tuple[float, Settings]] = {}
        self.events = BufferedEvents(app)

    def setup(self) -> None:
        for stream in (keys.spawn_stream(), keys.settle_stream()):
            try:
                self.redis.xgroup_create(stream, keys.COORDINATORS, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def run(self) -> None:
        """Serve until :attr:`stop` is set."""
        self.setup()
        last_reclaim = 0.0
        while not self.stop.is_set():
            try:
                self.redis.set(keys.heartbeat("coordinator", self.name), time.time(),
                               ex=keys.HEARTBEAT_TTL)
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
                    self.setup()

    def poll(self, block_ms: int = BLOCK_MS) -> int:
        """Handle what arrived on both streams; returns how many entries were handled."""
        streams = {keys.spawn_stream(): ">", keys.settle_stream(): ">"}
        got = self.redis.xreadgroup(keys.COORDINATORS, self.name, streams,  # type: ignore[arg-type]
                                    count=BATCH, block=block_ms)
        handled = 0
        for stream, entries in cast("list[tuple[str, list[tuple[str, dict[str, str]]]]]",
                                    got or []):
            for entry_id, fields in entries:
                self.handle(stream, entry_id, fields)
                handled += 1
        return handled

    def reclaim(self) -> None:
        """Take over entries another coordinator read but never acknowledged (it died)."""
        for stream in (keys.spawn_stream(), keys.settle_stream()):
            reply: list[Any] = self.redis.xautoclaim(
                stream, keys.COORDINATORS, self.name, self.settings.reclaim_idle * 1000, "0-0",
                count=BATCH)
            entries = reply[1]
            for entry_id, fields in entries:
                if fields:
                    self.handle(stream, entry_id, fields)

    def reap(self) -> int:
        """Re-enqueue runs whose lease ran out: their worker died (or froze) mid-run. The
        next worker to claim one resumes it from its last saved step."""
        count = 0
        for run_id in self.ledger.expired_leases():
            # Push the lease forward first, so this run is not re-sent on every pass while
            # its task waits in the queue; a claim replaces the lease anyway.
            self.redis.zadd(keys.leases(), {run_id: time.time() + TAKEOVER_GRACE})
            run = self.ledger.run(run_id)
            if run is None or run.state != "running":
                self.redis.zrem(keys.leases(), run_id)
                continue
            log.warning("run %s: lease expired; handing it to another worker", run_id)
            record = self.ledger.agent(run.agent)
            self.ledger.event(record.get("swarm", ""), "takeover", run.agent)
            self.send_runs([NewRun.of(run, record)], record.get("swarm", ""),
                           self.parent_tasks([run], [record]))
            count += 1
        return count

    def handle(self, stream: str, entry_id: str, fields: dict[str, str]) -> None:
        try:
            if stream == keys.spawn_stream():
                self.spawn(fields["request"])
            else:
                self.settled(fields["run"])
        except (redis.ConnectionError, redis.TimeoutError, OperationalError):
            raise  # left pending: handled again (here or by another coordinator)
        except Exception:
            log.exception("coordinator: %s entry %s failed", stream, entry_id)
        self.redis.xack(stream, keys.COORDINATORS, entry_id)

    # -- spawn -------------------------------------------------------------------------------

    def limits(self, swarm_id: str) -> Settings:
        """The swarm's depth, children and parallel limits (read at most every few seconds:
        they are fixed when the swarm is created)."""
        now = time.monotonic()
        cached = self._limits.get(swarm_id)
        if cached is not None and now - cached[0] < LIMITS_TTL:
            return cached[1]
        if len(self._limits) > 1000:
            self._limits.clear()
        limits = self.settings.with_(**{
            k: v for k, v in self.ledger.swarm_settings(swarm_id).items()
            if k in ("max_depth", "max_children", "max_parallel")})
        self._limits[swarm_id] = (now, limits)
        return limits

    def spawn(self, request_id: str) -> None:
        req = self.ledger.request(request_id)
        if req.get("state") == "dispatched":
            self.maybe_join(request_id)  # a replay after a crash between the two
            return
        if not req or req.get("state") not in ("new", "dispatching"):
            return
        self.ledger.set_request(request_id, state="dispatching")
        swarm_id, parent_id, turn = req["swarm"], req["parent"], int(req["turn"])
        parent = self.ledger.agent(parent_id)
        runs = {call["call_id"]: derive_id("r", parent_id, turn, call["call_id"])
                for call in req["calls"]}
        existing = self.ledger.existing_runs(list(runs.values()))
        fresh = []
        for call in req["calls"]:
            run_id = runs[call["call_id"]]
            if run_id in existing:
                self.redispatch(run_id, swarm_id)
            else:
                fresh.append((run_id, call))
        if fresh:
            self.dispatch(fresh, request_id, swarm_id, parent, turn)
        self.ledger.set_request(request_id, runs=runs, count=len(runs), state="dispatched")
        self.ledger.event(swarm_id, "dispatched", parent_id, children=len(runs))
        self.release_waiting(swarm_id)  # the parked parent gave its slot back
        self.maybe_join(request_id)

    def redispatch(self, run_id: str, swarm_id: str) -> None:
        """A replayed request (a coordinator died mid-way): the run exists; make sure it was
        settled (refused) or enqueued. A second delivery of a run that is going is a no-op."""
        run = self.ledger.run(run_id)
        if run is None:
            return
        if run.state == "queued" and not run.agent:
            self.ledger.settle(run, swarm_id, "refused", run.result or {"error": "refused"}, {})
        elif run.state == "queued" and self.redis.lpos(keys.swarm_waiting(swarm_id),
                                                       run_id) is None:
            self.enqueue([run_id], swarm_id)

    def dispatch(self, fresh: list[tuple[str, dict[str, Any]]], request_id: str,
                 swarm_id: str, parent: dict[str, str], req_turn: int) -> None:
        """Check the limits for each new call, then write every accepted child into the
        ledger in one transaction before any of them is enqueued (a crash in between is
        redone by :meth:`redispatch`)."""
        limits = self.limits(swarm_id)
        depth = int(parent.get("depth") or 0) + 1
        cancelled = bool(self.redis.exists(keys.cancel(parent["id"])))
        children = int(self.redis.hget(keys.swarm_counters(swarm_id), "children") or 0)
        accepted: list[NewRun] = []
        for run_id, call in fresh:
            target = call.get("agent_id") or ""
            refusal = check_call(call)
            if not refusal and cancelled:
                refusal = "the parent was cancelled"
            agent_id, label = "", ""
            if refusal:
                pass  # refused before looking at the target
            elif target:
                existing = self.ledger.agent(target)
                if not existing or existing.get("swarm") != swarm_id:
                    refusal = f"no agent {target!r} in this swarm; omit agent_id to start a new one"
                elif existing.get("parent") != parent["id"]:
                    refusal = f"agent {target!r} is not your child; only its parent can continue it"
                elif existing.get("state") not in SETTLED:
                    refusal = f"agent {target!r} is still {existing.get('state')}; wait for it"
                agent_id, label = target, existing.get("label", "")
            elif depth > limits.max_depth:
                refusal = (f"depth limit reached: a child here would be at depth {depth}, "
                           f"the limit is {limits.max_depth} (SWARM_MAX_DEPTH); do this part "
                           "yourself")
            elif children >= limits.max_children:
                refusal = (f"children limit reached: this swarm has spawned {children} of "
                           f"{limits.max_children} (SWARM_MAX_CHILDREN); do this part yourself")
            else:
                agent_id = derive_id("a", parent["id"], req_turn, call["call_id"])
                children += 1
            run = Run(id=run_id, agent="" if refusal else agent_id, request=request_id,
                      call_id=call["call_id"], message=call["message"], state="queued",
                      output_schema=call.get("output_schema") or None)
            if refusal:
                run.result = {"error": refusal}
                self.ledger.add_run(run)
                self.ledger.settle(run, swarm_id, "refused", {"error": refusal}, {})
                continue
            accepted.append(NewRun(run, new_agent=not target, depth=depth,
                                   label=label or label_of(call["message"]),
                                   traceparent=str(call.get("traceparent") or "")))
        if not accepted:
            return
        self.ledger.add_children(swarm_id, parent, accepted)
        free = limits.max_parallel - int(self.redis.scard(keys.swarm_inflight(swarm_id)))
        now, later = accepted[:max(0, free)], accepted[max(0, free):]
        with self.redis.pipeline() as pipe:
            if now:
                pipe.sadd(keys.swarm_inflight(swarm_id), *(n.run.id for n in now))
                pipe.expire(keys.swarm_inflight(swarm_id), keys.LEDGER_TTL)
            if later:
                pipe.rpush(keys.swarm_waiting(swarm_id), *(n.run.id for n in later))
                pipe.expire(keys.swarm_waiting(swarm_id), keys.LEDGER_TTL)
                for n in later:
                    pipe.hset(keys.agent(n.run.agent), "state", "waiting")
            pipe.execute()
        parent_task = parent.get("run") or root_task_id(swarm_id)
        self.send_runs(now, swarm_id, {n.run.id: parent_task for n in now})

    def enqueue(self, run_ids: list[str], swarm_id: str) -> None:
        """Mark runs in flight and send their tasks (runs taken off the waiting list, or
        re-sent after a crash)."""
        runs = [r for r in self.ledger.runs(run_ids) if r is not None]
        if not runs:
            return
        records = self.ledger.agents_by_id([r.agent for r in runs])
        with self.redis.pipeline() as pipe:
            pipe.sadd(keys.swarm_inflight(swarm_id), *(r.id for r in runs))
            pipe.expire(keys.swarm_inflight(swarm_id), keys.LEDGER_TTL)
            for run, record in zip(runs, records, strict=True):
                if record.get("state") == "waiting":
                    pipe.hset(keys.agent(run.agent), "state", "queued")
            pipe.execute()
        self.send_runs([NewRun.of(run, record) for run, record in zip(runs, records,
                                                                        strict=True)],
                       swarm_id, self.parent_tasks(runs, records))

    def parent_tasks(self, runs: list[Run], records: list[dict[str, str]]) -> dict[str, str]:
        """The task of each run's parent agent by run id: the parent's current run (it is
        parked on the run's request), or none for a root in a terminal."""
        parents = sorted({r.get("parent", "") for r in records} - {""})
        with self.redis.pipeline(transaction=False) as pipe:
            for parent_id in parents:
                pipe.hget(keys.agent(parent_id), "run")
            tasks = dict(zip(parents, pipe.execute(), strict=True))
        return {run.id: str(tasks.get(record.get("parent", "")) or "")
                for run, record in zip(runs, records, strict=True)}

    def send_runs(self, runs: list[NewRun], swarm_id: str,
                  parent_tasks: Mapping[str, str]) -> None:
        """Send ``swarm.agent.run`` for each run, on one producer, as a child of its parent
        agent's task (``parent_tasks`` by run id; the root's task where there is none)."""
        if not runs:
            return
        root = root_task_id(swarm_id) if swarm_id else None
        # Their task-sent events (for Flower) go after the batch, as one message: sent one
        # by one they were half of the coordinator's CPU per run.
        sent = SentEvents(self.events)
        try:
            with self.app.producer_or_acquire() as producer:
                for i, new in enumerate(runs):
                    self.send_run(new.run, new.depth, new.label, new.traceparent, producer,
                                  sent, parent_id=parent_tasks.get(new.run.id) or root,
                                  root_id=root)
                    if i == 0:
                        faults.point("coordinator-after-first-dispatch")
        finally:
            sent.flush()

    def send_run(self, run: Run, depth: int | str, label: str, traceparent: str,
                 producer: Any = None, sent: SentEvents | None = None, *,
                 parent_id: str | None = None, root_id: str | None = None) -> None:
        """Send one run's task; ``parent_id`` and ``root_id`` go in Celery's headers of the
        same names (and its task events), so Flower links the task to its parent and root."""
        shadow = f"agent {run.agent} depth {depth}: {label}"[:200]
        if sent is not None:
            sent.name(run.id, shadow)
        self.app.send_task(
            "swarm.agent.run", args=[run.id], task_id=run.id, shadow=shadow,
            argsrepr=repr((run.id,)), kwargsrepr="{}",
            headers={"traceparent": traceparent} if traceparent else None,
            parent_id=parent_id, root_id=root_id,
            producer=producer, event_dispatcher=sent, ignore_result=True)

    # -- settle and fan-in ---------------------------------------------------------------------

    def settled(self, run_id: str) -> None:
        request_id = cast("str | None", self.redis.hget(keys.run(run_id), "request"))
        if not request_id:
            return
        head = self.ledger.request_head(request_id)
        if head.get("swarm"):
            self.release_waiting(head["swarm"])
            self.maybe_join(request_id, head)

    def release_waiting(self, swarm_id: str) -> None:
        """Enqueue held-back runs while the swarm has fewer than ``max_parallel`` in flight."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.llen(keys.swarm_waiting(swarm_id))
            pipe.scard(keys.swarm_inflight(swarm_id))
            waiting, inflight = (int(n) for n in pipe.execute())
        if not waiting:
            return
        free = self.limits(swarm_id).max_parallel - inflight
        if free <= 0:
            return
        run_ids = cast("list[str] | None", self.redis.lpop(keys.swarm_waiting(swarm_id), free))
        if run_ids:
            self.enqueue(run_ids, swarm_id)

    def maybe_join(self, request_id: str, head: dict[str, str] | None = None) -> None:
        """When every run of the request has settled, answer the parent and wake it.

        ``head`` (state, settled and count of the request) spares reading the whole
        request on every settlement but the last."""
        if head is not None and (head.get("state") != "dispatched" or (
                head.get("count") and int(head.get("settled") or 0) < int(head["count"]))):
            return
        req = self.ledger.request(request_id)
        if not req or req.get("state") != "dispatched":
            return
        if int(req.get("settled") or 0) < len(req["runs"]):
            return  # the runs are read once, when all are in
        runs = {cid: self.ledger.run(rid) for cid, rid in req["runs"].items()}
        if any(r is None or r.state not in SETTLED for r in runs.values()):
            return
        parent = self.ledger.agent(req["parent"])
        is_root = parent.get("kind") == "root"
        sessions = RedisSessionStore(self.redis, ttl=self.settings.session_ttl, index=is_root)
        session_id = parent.get("session") or parent["id"]
        session = sessions.load(session_id)
        if session is not None and not session.parked:
            # Joined before, but the coordinator died before waking the parent: wake it.
            self.wake(parent, request_id, req["swarm"])
            self.ledger.set_request(request_id, state="joined")
            return
        if session is None or session.parked != request_id:
            log.warning("request %s: parent %s is not parked on it; not joined", request_id,
                        parent.get("id"))
            return
        assistant = next((m for m in reversed(session.messages) if m.get("role") == "assistant"),
                         None)
        answered = {m.get("tool_call_id") for m in session.messages if m.get("role") == "tool"}
        for call in (assistant or {}).get("tool_calls") or []:
            cid = call.get("id")
            if cid in answered:
                continue
            content = (result_text(runs[cid], cid) if cid in runs
                       else req["results"].get(cid, "[no result was recorded for this call]"))
            session.messages.append({"role": "tool", "tool_call_id": cid, "content": content})
        session.parked = ""
        session.updated = time.time()
        sessions.save(session)
        self.ledger.event(req["swarm"], "joined", parent["id"], children=len(runs))
        # Wake before marking joined: a crash in between is redone on replay (above).
        self.wake(parent, request_id, req["swarm"])
        self.ledger.set_request(request_id, state="joined")

    def wake(self, parent: dict[str, str], request_id: str, swarm_id: str) -> None:
        """Let a parent whose children all settled go on: a root in a terminal is woken,
        a parent in a worker resumed (a duplicate resume is a no-op)."""
        if parent.get("kind") == "root":
            with self.redis.pipeline() as pipe:
                pipe.rpush(keys.wake(parent["id"]), request_id)
                pipe.expire(keys.wake(parent["id"]), keys.LEDGER_TTL)
                pipe.execute()
            return
        parent_run = parent.get("run", "")
        # In Flower the resume is a child of the run it carries on.
        self.app.send_task(
            "swarm.agent.resume", args=[parent_run], task_id=derive_id("m", request_id),
            shadow=f"resume agent {parent['id']} depth {parent.get('depth', '?')}",
            argsrepr=repr((parent_run,)), kwargsrepr="{}", ignore_result=True,
            parent_id=parent_run or None, root_id=root_task_id(swarm_id))
