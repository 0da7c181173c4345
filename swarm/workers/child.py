"""Running one child in a worker: claim its run, work, settle exactly once.

The runner only: what its swarm recorded is :mod:`swarm.workers.recorded`, where it works
:mod:`swarm.workers.placement`, its agent :mod:`swarm.workers.assembly`, its answer
:mod:`swarm.workers.answer`, its limits :mod:`swarm.workers.limits`, what it reports
:mod:`swarm.workers.progress`, its model clients :mod:`swarm.workers.models`, what it is
told :mod:`swarm.workers.prompts`.

A run is claimed with a lease in the ledger (renewed while the child works), so a
duplicate delivery of the same task does nothing while the first is alive. A child
that spawns children of its own parks: its task ends and the coordinator enqueues
``swarm.agent.resume`` when they settle.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from swarm import faults, telemetry
from swarm.agent import later, sandbox
from swarm.agent.agent_types import AgentTypes
from swarm.agent.loop import Agent
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings
from swarm.domain.records import usage_since
from swarm.errors import LeaseLost, Parked, WorkspaceElsewhere, WorkspaceError, WorkspaceLost
from swarm.errors import StoreError as SwarmStoreError
from swarm.mcp_client.config import McpConfig
from swarm.runtime.build import new_session
from swarm.store.gate import RedisRateGate
from swarm.store.ledger import SETTLED, AgentRecord, Ledger, RunRecord, Start
from swarm.store.sessions import RedisSessionStore
from swarm.store.snapshots import SnapshotStore
from swarm.workers.answer import answer
from swarm.workers.arrival import Arrival
from swarm.workers.assembly import Claimed, child_agent
from swarm.workers.limits import Control
from swarm.workers.models import ModelClients
from swarm.workers.placement import Placement, changed, run_listing
from swarm.workers.recorded import Recorded, typed_settings
from swarm.workers.supervisor import Supervisor, Watched
from swarm.workspace import homecoming, sweep, views
from swarm.workspace.listing import Listing
from swarm.workspace.seed import EMPTY, Seeds, Workspace

log = logging.getLogger(__name__)


@dataclass
class _Here:
    """What a run learnt when its workspace arrived (see ``ChildRunner._arrived``)."""

    isolation: views.Isolation | None = None
    """The mount namespace its boxes start in (a view's, sandboxed), closed as it ends."""
    before: Listing | None = None
    """Its workspace's listing as the run began (None: a view, which tells what changed)."""

#: What a child's result says when its workspace is as it was seeded.
NO_CHANGES = "none: its workspace is as it was given, nothing to merge"


@dataclass
class ChildRunner:
    """Everything a worker process needs to run children; one per process."""

    settings: Settings
    redis: redis.Redis
    host: str = socket.gethostname()

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.redis)
        self.sessions = RedisSessionStore(self.redis, ttl=self.settings.session_ttl,
                                          index=False, mail=True)
        self.supervisor = Supervisor(self.redis, self.settings.lease)
        self.models = ModelClients()
        self.snapshots = SnapshotStore(self.redis)
        self.recorded = Recorded(self.ledger)
        self.placement = Placement(self.redis, self.ledger, self.host)
        self.sandbox = sandbox.for_worker(self.settings)
        """Where this worker runs its children's commands (tried once, at the first child)."""

    def run(self, run_id: str, *, resume: bool = False,
            send: Callable[..., None] | None = None, traceparent: str = "") -> dict[str, Any]:
        """Run (or, with ``resume``, carry on) the run ``run_id``; returns a small summary.

        A run delivered again after its worker died (its lease ran out) is claimed anew and
        resumed from its last saved step.
        """
        sweep.soon(self.settings.home, self.redis)  # what finished swarms left on this host
        token = secrets.token_hex(8)
        claimed_at = time.monotonic()
        if resume:
            faults.point("worker-before-resume-claim")
        # The claim reads the run too: one round trip.
        start = self.ledger.start(run_id, token, self.settings.lease, self.host,
                                  "parked" if resume else "queued")
        if start is None:
            log.warning("run %s (or its agent) is not in the ledger; nothing to do", run_id)
            return {"run": run_id, "state": "missing"}
        if not start.claimed:
            return {"run": run_id, "state": start.state if start.state in SETTLED
                    else "skipped (another worker has it)"}
        assert start.run is not None
        run, swarm_id = start.run, start.run.swarm
        # The run's own limit (a swarm may set a shorter one) is applied in _work; its
        # wall time counts what earlier claims of it used, on any host.
        watched = self.supervisor.watch(
            Watched(run.id, run.agent, token, self.settings.child_timeout,
                    start=time.monotonic() - start.used), claimed_at)
        try:
            with telemetry.span("agent", parent=traceparent, agent_id=run.agent, run=run.id,
                                resume=resume):
                return self._work(run, start, resume, send, watched)
        except LeaseLost as exc:
            log.warning("%s", exc)  # its successor settles it; this worker writes nothing
            return {"run": run.id, "state": "lease lost"}
        except (SwarmStoreError, redis.RedisError):
            raise  # Redis went away: the lease runs out and a worker takes the run over
        except WorkspaceElsewhere as exc:
            # Its host's worker (restarted after a crash, say) carries it on with its files.
            log.warning("run %s: %s", run.id, exc)
            self.ledger.hand_back(run.id, token)
            return {"run": run.id, "state": "handed back"}
        except WorkspaceError as exc:
            # Never carry on in an empty folder: the run fails, saying why.
            log.error("run %s: %s", run.id, exc)
            reason = f"workspace lost: {exc}" if isinstance(exc, WorkspaceLost) \
                else f"workspace: {exc}"
            self.ledger.settle(run, swarm_id, "failed",
                               {"agent_id": run.agent, "error": reason}, {}, token=token)
            if start.record.kind == "job":
                self.ledger.finish_swarm(swarm_id, "failed")
            return {"run": run.id, "state": "failed"}
        except Exception as exc:
            # A bug outside the agent's loop: taking the run over would hit it again, and
            # its parent would wait forever. Settle it as failed, with the reason.
            log.exception("run %s crashed", run.id)
            self.ledger.settle(run, swarm_id, "failed",
                               {"agent_id": run.agent,
                                "error": f"internal error: {type(exc).__name__}: {exc}"},
                               {}, token=token)
            return {"run": run.id, "state": "failed"}
        finally:
            self.supervisor.forget(watched)

    def _work(self, run: RunRecord, start: Start, resume: bool,
              send: Callable[..., None] | None, watched: Watched) -> dict[str, Any]:
        """The run claimed by ``start``, of the agent whose record it read."""
        record = start.record
        swarm_id = record.swarm
        settings = self.recorded.child_settings(self.settings, swarm_id)
        kind = self.agent_types(swarm_id).get(record.type) if record.type else None
        if record.type and kind is None:
            error = (f"its agent type {record.type!r} is not among those recorded with swarm "
                     f"{swarm_id}: {self.agent_types(swarm_id).known()}")
            self.ledger.settle(run, swarm_id, "failed", {"agent_id": run.agent, "error": error},
                               {}, token=watched.token)
            return {"run": run.id, "state": "failed"}
        if kind is not None:
            settings = typed_settings(settings, kind)
        if self.sandbox.refuse and not (self.sandbox.fallback
                                        and self.ledger.unconfined(swarm_id)):
            error = f"worker {self.host} cannot sandbox commands: {self.sandbox.refuse}"
            self.ledger.settle(run, swarm_id, "failed", {"agent_id": run.agent, "error": error},
                               {}, token=watched.token)
            if record.kind == "job":
                self.ledger.finish_swarm(swarm_id, "failed")
            return {"run": run.id, "state": "failed"}
        settings = settings.with_(sandbox="bwrap" if self.sandbox.box else "none")
        seeds = Seeds(self.snapshots, self.settings.home, self.host, settings.snapshot_max,
                      settings.snapshot_swarm_max, view=self.settings.seed_view,
                      box_uid=self.sandbox.box.run_as if self.sandbox.box else None)
        arrival = self._arrival(record, swarm_id, seeds)
        if arrival.ready and not resume and run.start_index < 0:
            workspace = arrival.wait()
            if run.rebase and run.rebase not in (workspace.seed, EMPTY) and workspace.seed:
                workspace, run = self.placement.rebase(workspace, seeds, run, record)
                arrival = Arrival.there(workspace)
        claimed = Claimed(run, start, resume, send, watched, settings, kind)
        here = _Here()
        try:
            return self._work_in(claimed, arrival, seeds, here)
        finally:
            # Once made (its hook may make the run's namespace as the run ends), no box
            # starts in that namespace any more; then the view goes.
            made = arrival.settled()
            try:
                if here.isolation is not None:
                    here.isolation.close()
            finally:
                if made is not None:
                    seeds.unmount(made)  # a view is mounted while a run works in it

    def _arrival(self, record: AgentRecord, swarm_id: str, seeds: Seeds) -> Arrival:
        """The agent's workspace on this host: a new seeded child's made in a thread when
        its seed's preface lets its agent start first (:mod:`swarm.workers.arrival`)."""
        if record.workspace or record.kind != "child":
            return Arrival.there(self.placement.workspace(record, swarm_id, seeds))
        planned = seeds.plan(swarm_id, record.id, record.seed)
        if planned.preface is None:
            return Arrival.there(self.placement.made(record, seeds, planned))
        return Arrival.begin(planned.workspace,
                             lambda: self.placement.made(record, seeds, planned),
                             planned.preface)

    def _work_in(self, claimed: Claimed, arrival: Arrival, seeds: Seeds,
                 here: _Here) -> dict[str, Any]:
        run, record, swarm_id = claimed.run, claimed.record, claimed.swarm_id
        settings, watched, start = claimed.settings, claimed.watched, claimed.start
        expected = arrival.expected
        session = self.sessions.from_fields(run.agent, start.session_meta,
                                            start.session_messages) \
            or new_session(expected.path, run.agent)
        if session.parked:
            request = self.ledger.request(session.parked)
            if request is not None and request.state in ("answered", "joined"):
                # Read before the join answered it (a duplicate resume won the claim):
                # the stored session has the children's results.
                session = self.sessions.load(run.agent) or session
            elif request is not None:  # still out: the join resumes it
                self.ledger.stay_parked(run, swarm_id, watched.token)
                return {"run": run.id, "state": "parked"}
        # Its git work tree as this host made it; a job's folder (named by its submitter)
        # is found as a root's is, before its first run's commands, and kept.
        tree = expected.tree or (seeds.pinned(f"job:{run.agent}", expected.path)
                                 if record.kind == "job" else None)
        watched.limit = settings.child_timeout
        control = Control(self.redis, swarm_id, watched, settings, self.supervisor,
                          cancelled=start.cancelled, spent=start.spent)
        model = self.models.client(settings)
        model.gate = RedisRateGate(self.redis, swarm_id)
        model.stop = control.event  # a cancel aborts the model call in flight
        agent: Agent | None = None
        try:
            agent = child_agent(self, claimed, arrival, seeds, session, model, control, tree)
            arrival.hook = lambda ws: self._arrived(ws, agent, expected, run, here)
            arrival.when_made(lambda ws: self._made(ws, agent, expected, here))
            if arrival.ready:
                arrival.arrive()
            # Its children's work lands before it goes on (a check runs in its box).
            landing = homecoming.bring_home(
                seeds, session, expected.path, swarm_id, tree, arrival.arrive(),
                run_check=homecoming.checker(agent.env, settings.command_timeout),
                check=settings.land_check) if claimed.resume else None
            if landing is not None:
                self.sessions.save(session)
                self.ledger.landed(swarm_id, dict(landing.children))
            state, result = answer(agent, run, claimed.resume, self.ledger)
        except Parked:
            self.ledger.event(swarm_id, "parked", run.agent)
            return {"run": run.id, "state": "parked"}
        finally:
            self.models.close(model)
            if agent is not None:
                # Its box lasts as long as its turn here; it ends beside the settlement (its
                # commands' processes are gone already: the runner kills them after each),
                # on a thread the run's did not start (see swarm.agent.later).
                later.BOXES.soon(agent.env.close)
        workspace = arrival.arrive()  # an agent that called no tool did not wait for it
        start_usage = run.result.get("usage_at_start") or {}
        changed_files, exact = changed(workspace, seeds, here.before, record)
        result.update(agent_id=run.agent, workspace=str(workspace.path),
                      files_changed=changed_files, usage=usage_since(session.usage, start_usage))
        place = self._send_home(workspace, seeds, claimed, result,
                                bool(changed_files) or not exact)
        self.supervisor.flush()  # its progress goes before its settlement
        self.ledger.settle(run, swarm_id, state, result, session.usage, token=watched.token,
                           place=place)
        if record.kind == "job":
            self.ledger.finish_swarm(swarm_id, state)
        return {"run": run.id, "state": state}

    def _made(self, workspace: Workspace, agent: Agent, expected: Workspace,
              here: _Here) -> None:
        """A new seeded child's workspace was made while its model thinks (on the thread
        that made it): its box starts now, not at its first command."""
        self._fit(workspace, agent, expected, here)
        if isinstance(agent.env, LocalEnvironment):
            agent.env.warm()

    def _arrived(self, workspace: Workspace, agent: Agent, expected: Workspace,
                 run: RunRecord, here: _Here) -> None:
        """The run's thread has its workspace, before its first tool call."""
        self._fit(workspace, agent, expected, here)
        # A view tells what changed from its upper folder; other workspaces are compared
        # with a listing taken as the run began.
        here.before = run_listing(workspace, run) if workspace.view is None else None
        if isinstance(agent.env, LocalEnvironment):
            # Its box starts while its model thinks (a new child's workspace is there before
            # its first request): its first command does not wait for it.
            agent.env.warm()

    def _fit(self, workspace: Workspace, agent: Agent, expected: Workspace,
             here: _Here) -> None:
        """The run's environment for the workspace made (by the first hook of the two)."""
        if not isinstance(agent.env, LocalEnvironment) or here.isolation is not None:
            return
        if workspace.view != expected.view:
            # No view could be made after all: a full checkout, no view's git to bind.
            agent.env.linked = None
        if workspace.view is not None and self.sandbox.box is not None:
            # A box copies the mounts of the thread that starts it: its own are started in
            # a namespace where no other child's view is mounted.
            here.isolation = views.Isolation(self.settings.home / "workspaces", workspace.top)
            agent.env.mounts = here.isolation.entered

    def _send_home(self, workspace: Workspace, seeds: Seeds, claimed: Claimed,
                   result: dict[str, Any], changes: bool) -> dict[str, str] | None:
        """Store the workspace's changes (a workspace as it was seeded has nothing to send
        home) and say in ``result`` where they are; where the workspace is now, for its
        record (written with the settlement), when they were stored."""
        state_id = ""
        if changes:
            try:
                state_id = seeds.capture(workspace, claimed.swarm_id)
            except WorkspaceError as exc:
                result["home_error"] = f"its work could not be sent home: {exc}"
        if state_id:
            # A view is unmounted when the run ends: its files travel as the delta, even
            # to a parent on this host.
            result.update(delta=state_id, seed=workspace.seed,
                          host=self.host if workspace.view is None else "")
            return Ledger.where(str(workspace.path), self.host, state_id)
        if "home_error" not in result:
            result["changes"] = NO_CHANGES
        return None

    _changed = staticmethod(changed)

    def swarm_settings(self, swarm_id: str) -> dict[str, Any]:
        return self.recorded.swarm_settings(swarm_id)

    def mcp_servers(self, swarm_id: str) -> McpConfig:
        return self.recorded.mcp_servers(swarm_id)

    def agent_types(self, swarm_id: str) -> AgentTypes:
        return self.recorded.agent_types(swarm_id)
