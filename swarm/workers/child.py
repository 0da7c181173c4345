"""Running one child in a worker: claim its run, work, settle exactly once.

The runner only: its limits are :mod:`swarm.workers.limits`, what it reports
:mod:`swarm.workers.progress`, its model clients :mod:`swarm.workers.models`, what it is
told :mod:`swarm.workers.prompts`, and a structured answer's check
:mod:`swarm.agent.output`.

A run is claimed with a lease in the ledger (renewed while the child works), so a
duplicate delivery of the same task does nothing while the first is alive. A child
that spawns children of its own parks: its task ends and the coordinator enqueues
``swarm.agent.resume`` when they settle.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from swarm import faults, telemetry
from swarm.agent import grants, sandbox
from swarm.agent.agent_types import AgentType, AgentTypes
from swarm.agent.loop import Agent
from swarm.agent.output import ask_for, check_output, retry_message
from swarm.cache import TTLCache
from swarm.config import Settings
from swarm.domain.history import repair
from swarm.domain.records import usage_since
from swarm.domain.session import Session
from swarm.errors import (
    AgentStopped,
    Cancelled,
    LeaseLost,
    ModelError,
    Parked,
    PathRefused,
    WorkspaceElsewhere,
    WorkspaceError,
    WorkspaceLost,
)
from swarm.errors import StoreError as SwarmStoreError
from swarm.mcp_client.config import McpConfig
from swarm.runtime.build import build_agent, new_session
from swarm.runtime.spawner import RedisSpawner, limits_of
from swarm.store import keys
from swarm.store.approvals import ApprovalQueue, QueueApprover
from swarm.store.gate import RedisRateGate
from swarm.store.hints import HomeHints, SwarmHints
from swarm.store.ledger import SETTLED, AgentRecord, Ledger, RunRecord, Start
from swarm.store.mailbox import Mailbox
from swarm.store.sessions import RedisSessionStore
from swarm.store.snapshots import SnapshotStore
from swarm.workers.limits import Control
from swarm.workers.models import ModelClients
from swarm.workers.progress import ProgressReporter
from swarm.workers.prompts import RESUMED, role_prompt
from swarm.workers.supervisor import Supervisor, Watched
from swarm.workspace import homecoming, parked, sweep, views
from swarm.workspace.listing import LISTING_LIMIT, Listing, changed_files, listing
from swarm.workspace.seed import EMPTY, Seeds, Workspace, upper

log = logging.getLogger(__name__)

#: Seconds a worker trusts what it read of a swarm's settings (they never change).
SETTINGS_TTL = 30.0

#: What a child's result says when its workspace is as it was seeded.
NO_CHANGES = "none: its workspace is as it was given, nothing to merge"

#: Settings of the model endpoint: from the worker's environment when it has them.
ENDPOINT = frozenset({"base_url", "model"})


def typed_settings(settings: Settings, kind: AgentType) -> Settings:
    """``settings`` for a child of type ``kind``: its model and endpoint (the key stays the
    worker's), its approval policies and its turn limit, where it gives them."""
    return settings.with_(model=kind.model or None, base_url=kind.base_url or None,
                          approval=kind.policies(), child_max_turns=kind.max_turns or None)


@dataclass
class ChildRunner:
    """Everything a worker process needs to run children; one per process."""

    settings: Settings
    redis: redis.Redis
    host: str = socket.gethostname()

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.redis)
        self.sessions = RedisSessionStore(self.redis, ttl=self.settings.session_ttl, index=False)
        self.supervisor = Supervisor(self.redis, self.settings.lease)
        self.models = ModelClients()
        self.snapshots = SnapshotStore(self.redis)
        self._settings: TTLCache[str, dict[str, Any]] = TTLCache(SETTINGS_TTL)
        self._mcp: TTLCache[str, McpConfig] = TTLCache(SETTINGS_TTL)
        self._types: TTLCache[str, AgentTypes] = TTLCache(SETTINGS_TTL)
        self.sandbox = sandbox.for_worker(self.settings)
        """Where this worker runs its children's commands (tried once, at the first child)."""

    def run(self, run_id: str, *, resume: bool = False,
            send: Callable[..., None] | None = None, traceparent: str = "") -> dict[str, Any]:
        """Run (or, with ``resume``, carry on) the run ``run_id``; returns a small summary.

        A run delivered again after its worker died (its lease ran out) is claimed anew and
        resumed from its last saved step.
        """
        sweep.soon(self.settings.home, self.redis)  # what finished swarms left on this host
        run = self.ledger.run(run_id)
        if run is None:
            log.warning("run %s is not in the ledger; nothing to do", run_id)
            return {"run": run_id, "state": "missing"}
        if run.state in SETTLED:
            return {"run": run_id, "state": run.state}
        token = secrets.token_hex(8)
        swarm_id = run.swarm
        if run.agent and not swarm_id:  # a record from before runs carried their swarm
            swarm_id = (self.ledger.agent(run.agent) or AgentRecord("", "")).swarm
        claimed_at = time.monotonic()
        if resume:
            faults.point("worker-before-resume-claim")
        start = self.ledger.start(run, swarm_id, token, self.settings.lease, self.host,
                                  "parked" if resume else "queued") \
            if run.agent and swarm_id else None
        if start is None:
            log.warning("run %s has no agent in the ledger; nothing to do", run_id)
            return {"run": run_id, "state": "missing"}
        if not start.claimed:
            return {"run": run_id, "state": "skipped (another worker has it)"}
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
        settings = self.settings.with_(**{
            k: v for k, v in self.swarm_settings(swarm_id).items()
            # A worker configured with its own endpoint keeps it (a deployment's workers);
            # one without (local workers, the demo) uses the root's.
            if not (k in ENDPOINT and ENDPOINT & self.settings.explicit)})
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
        if "stream" not in settings.explicit:
            # Nobody watches a child's tokens arrive: whole answers cost the worker less than
            # half the CPU of a parsed stream (and one read instead of one per chunk).
            settings = dataclasses.replace(settings, stream=False)
        seeds = Seeds(self.snapshots, self.settings.home, self.host, settings.snapshot_max,
                      settings.snapshot_swarm_max, view=self.settings.seed_view,
                      box_uid=self.sandbox.box.run_as if self.sandbox.box else None)
        workspace = self._workspace(record, swarm_id, seeds)
        if run.rebase and run.rebase not in (workspace.seed, EMPTY) and workspace.seed \
                and not resume and run.start_index < 0:
            workspace, run = self._rebase(workspace, seeds, run, record)
        # Its boxes copy its thread's mounts: there, no other child's view.
        isolated = workspace.view is not None and self.sandbox.box is not None and \
            views.isolate(self.settings.home / "workspaces", workspace.top)
        try:
            return self._work_in(workspace, seeds, settings, run, start, resume, send, watched,
                                 kind)
        finally:
            try:
                if isolated:
                    views.rejoin()
            finally:
                seeds.unmount(workspace)  # a view is mounted while a run works in it

    def _work_in(self, workspace: Workspace, seeds: Seeds, settings: Settings,
                 run: RunRecord, start: Start, resume: bool,
                 send: Callable[..., None] | None, watched: Watched,
                 kind: AgentType | None) -> dict[str, Any]:
        record = start.record
        swarm_id = record.swarm
        session = self.sessions.from_fields(run.agent, start.session_meta,
                                            start.session_messages) \
            or new_session(workspace.path, run.agent)
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
        tree = workspace.tree or (seeds.pinned(f"job:{run.agent}", workspace.path)
                                  if record.kind == "job" else None)
        # A view tells what changed from its upper folder; other workspaces are compared
        # with a listing taken as the run began.
        before = self._listing(workspace, run) if workspace.view is None else None
        watched.limit = settings.child_timeout
        control = Control(self.redis, swarm_id, watched, settings, self.supervisor,
                          cancelled=start.cancelled, spent=start.spent)
        model = self.models.client(settings)
        model.gate = RedisRateGate(self.redis, swarm_id)
        model.stop = control.event  # a cancel aborts the model call in flight
        queue = ApprovalQueue(self.redis, swarm_id, run=run.id, lease=watched.token)
        agent: Agent | None = None

        def land_taken(taken: Session) -> None:
            """Background children's results it took (agent_join): their work lands now."""
            assert agent is not None
            landing = homecoming.bring_home(
                seeds, taken, workspace.path, swarm_id, tree, workspace,
                run_check=homecoming.checker(agent.env, settings.command_timeout),
                check=settings.land_check)
            if landing is not None:
                self.ledger.landed(swarm_id, dict(landing.children))

        try:
            agent = build_agent(
                settings, workspace.path, model, session, store=self.sessions,
                hints=SwarmHints(self.redis, swarm_id, HomeHints(self.redis, settings.home),
                                 agent_id=run.agent),
                approver=QueueApprover(queue, settings.approval_timeout, control.cancelled),
                observer=ProgressReporter(self.supervisor, swarm_id, run.agent, send, control),
                spawner=RedisSpawner(self.ledger, run.agent, swarm_id, run.id,
                                     token=watched.token,
                                     seeder=lambda: seeds.take(workspace.path, swarm_id,
                                                               base=workspace.seed,
                                                               tree_of=tree, own=workspace),
                                     keeper=parked.state,
                                     host=self.host, keep_state=True,
                                     limits=limits_of(settings), lander=land_taken,
                                     sessions=self.sessions),
                extra_prompt=role_prompt(record.kind, run.agent, record.depth,
                                         workspace.path, record.type),
                agent_id=run.agent,
                cancel=control.event,
                guard=control.check_lease,
                before_step=control.before_step,
                mailbox=Mailbox(self.redis, run.agent),
                mcp=self.mcp_servers(swarm_id),
                types=self.agent_types(swarm_id),
                agent_type=kind,
                # Its repository borrows the objects of the one its seed is in.
                read_only=(workspace.odb / "objects",) if workspace.odb is not None else (),
                die_with_runner=True,
                linked=upper(workspace.view) if workspace.view is not None else None,
                beneath=self._jobs_root(swarm_id) if record.kind == "job" else None,
                boxed_mcp=True,
                kind=record.kind,
                # Its parent's folder (its .env, whatever seeding left out) stays out of
                # reach even where the box shows what holds it (/opt, SWARM_SANDBOX_SHOW).
                hidden=(Path(record.parent_workspace),)
                if record.parent_workspace and record.parent_host == self.host else (),
            )
            # Its children's work lands before it goes on (a check runs in its box).
            landing = homecoming.bring_home(
                seeds, session, workspace.path, swarm_id, tree, workspace,
                run_check=homecoming.checker(agent.env, settings.command_timeout),
                check=settings.land_check) if resume else None
            if landing is not None:
                self.sessions.save(session)
                self.ledger.landed(swarm_id, dict(landing.children))
            state, result = self._answer(agent, run, resume)
        except Parked:
            self.ledger.event(swarm_id, "parked", run.agent)
            return {"run": run.id, "state": "parked"}
        finally:
            self.models.close(model)
            if agent is not None:
                agent.env.close()  # its box lasts as long as its turn here
        start_usage = run.result.get("usage_at_start") or {}
        changed, exact = self._changed(workspace, seeds, before, record)
        result.update(agent_id=run.agent, workspace=str(workspace.path), files_changed=changed,
                      usage=usage_since(session.usage, start_usage))
        state_id = ""
        if changed or not exact:  # a workspace as it was seeded has nothing to send home
            try:
                state_id = seeds.capture(workspace, swarm_id)
            except WorkspaceError as exc:
                result["home_error"] = f"its work could not be sent home: {exc}"
        if state_id:
            # A view is unmounted when the run ends: its files travel as the delta, even
            # to a parent on this host.
            result.update(delta=state_id, seed=workspace.seed,
                          host=self.host if workspace.view is None else "")
            self.ledger.place(run.agent, str(workspace.path), self.host, state_id)
        elif "home_error" not in result:
            result["changes"] = NO_CHANGES
        self.supervisor.flush()  # its progress goes before its settlement
        self.ledger.settle(run, swarm_id, state, result, session.usage, token=watched.token)
        if record.kind == "job":
            self.ledger.finish_swarm(swarm_id, state)
        return {"run": run.id, "state": state}

    @staticmethod
    def _changed(workspace: Workspace, seeds: Seeds, before: Listing | None,
                 record: AgentRecord) -> tuple[list[str], bool]:
        """The files the agent changed, and whether that list is exact about the
        workspace against its seed (nothing in it: nothing to send home). A view's upper
        folder is; a listing is when it was taken at the seed (the agent never parked or
        settled with changes, whose listing may be on another host) and was complete."""
        if before is None:
            found = seeds.changed(workspace, LISTING_LIMIT)
            return (found, True) if found is not None else ([], False)
        after = listing(workspace.path)
        complete = max(len(before), len(after)) < LISTING_LIMIT
        return changed_files(before, after), complete and not record.ws_state

    def _listing(self, workspace: Workspace, run: RunRecord) -> Listing:
        """The workspace as it was when this run began (kept on disk across resumes)."""
        # Named before "listing" was: a run parked across an upgrade still finds its own.
        path = workspace.top.parent / f".{run.agent}.{run.id}.snapshot.json"
        try:
            return {k: (v[0], v[1]) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError):
            found = listing(workspace.path)
            path.write_text(json.dumps(found))
            return found

    def _answer(self, agent: Agent, run: RunRecord, resume: bool) -> tuple[str, dict[str, Any]]:
        """Work to a final answer; check it against the run's output schema (one retry)."""
        session = agent.session
        try:
            if resume:
                answer = agent.resume(since_turn=run.start_turn)
            elif 0 <= run.start_index < len(session.messages):
                # A worker died mid-run: carry on from the last saved step.
                agent.run_start = run.start_turn
                if session.parked:  # its spawn request never went out: answer the calls
                    session.messages = repair(session.messages)
                    session.parked = ""
                agent.messages.append({"role": "user", "content": RESUMED})
                agent.save()
                answer = agent.resume(since_turn=run.start_turn)
            else:
                self.ledger.begin(run.id, session.turns, len(session.messages), session.usage)
                # Unsaved until the model answers: a worker that dies first leaves the
                # session at start_index, so the run starts again from its message.
                answer = agent.run(ask_for(run.message, run.output_schema), save_task=False)
            if not run.output_schema:
                return "done", {"answer": answer}
            value, problem = check_output(answer, run.output_schema)
            if problem:
                answer = agent.run(retry_message(problem))
                value, problem = check_output(answer, run.output_schema)
            if problem:
                return "failed", {"answer": answer,
                                  "error": f"the answer did not match output_schema: {problem}"}
            return "done", {"answer": answer, "output": value}
        except (Parked, LeaseLost):
            raise
        except Cancelled as exc:
            return exc.state, {"error": str(exc)}
        except (AgentStopped, ModelError) as exc:
            return "failed", {"error": f"{type(exc).__name__}: {exc}"}
        except (SwarmStoreError, redis.RedisError):
            raise  # Redis went away: the task fails, the lease runs out, a worker takes over
        except Exception as exc:  # a bug must not leave the parent waiting forever
            log.exception("child %s crashed", run.agent)
            return "failed", {"error": f"internal error: {type(exc).__name__}: {exc}"}

    def swarm_settings(self, swarm_id: str) -> dict[str, Any]:
        """The swarm's settings (written once, when it was created), read at most every
        :data:`SETTINGS_TTL` seconds per swarm: a fan-out's siblings share one read."""
        return self._settings.get_or_load(swarm_id,
                                          lambda: self.ledger.swarm_settings(swarm_id))

    def mcp_servers(self, swarm_id: str) -> McpConfig:
        """The MCP servers recorded with the swarm when it was started or submitted (as
        configured, ``${VAR}`` unexpanded: they expand from this worker's environment).
        Never read from a workspace: its commands write it (a ``.mcp.json`` planted there
        would have this worker start a program of their choosing)."""
        cached = self._mcp.get(swarm_id)
        if cached is not None:
            return cached
        raw = self.ledger.swarm_mcp(swarm_id)
        if raw is None:  # a swarm from before swarms (and jobs) recorded their MCP servers
            log.warning("swarm %s has no MCP configuration recorded: its agents get no MCP "
                        "servers", swarm_id)
            raw = {"mcpServers": {}}
        config = McpConfig.from_json(raw)
        self._mcp.put(swarm_id, config)
        return config

    def agent_types(self, swarm_id: str) -> AgentTypes:
        """The agent types recorded with the swarm when it was started or submitted. Never
        read from a workspace: its commands write it, and a type file planted there would
        give a child the instructions, tools and model of their choosing."""
        return self._types.get_or_load(
            swarm_id, lambda: AgentTypes.from_json(self.ledger.swarm_types(swarm_id)))

    def _rebase(self, workspace: Workspace, seeds: Seeds, run: RunRecord,
                record: AgentRecord) -> tuple[Workspace, RunRecord]:
        """A continued child's workspace brought up to its parent's as the parent called it
        again (``run.rebase``), its own earlier changes re-applied where they still fit;
        the run's message says where they did not."""
        workspace, kept = homecoming.rebase(seeds, workspace, run.rebase, record.swarm,
                                            record.id)
        self.ledger.reseed(record.id, run.rebase)
        note = ("[Your workspace now holds your parent's files as they are now; your earlier "
                "changes were applied over them"
                + (f", except in {', '.join(kept[:20])}, where your parent's version is kept"
                   if kept else "") + ".]\n\n")
        return workspace, dataclasses.replace(run, message=note + run.message)

    def _workspace(self, record: AgentRecord, swarm_id: str, seeds: Seeds) -> Workspace:
        """The agent's workspace on this host: found where it was made, restored from the
        snapshot taken as it parked or settled elsewhere, or made from its parent's
        snapshot. :class:`WorkspaceLost` when it must be restored and cannot be."""
        if record.workspace:
            path = Path(record.workspace)
            here = record.ws_host in ("", self.host)
            root = self._jobs_root(swarm_id) if record.kind == "job" and here else None
            if root is not None:
                self._open_job_workspace(path, root, create=not record.ws_state)
            if here and path.is_dir():
                return seeds.found(path, swarm_id, record.id, record.seed)
            if record.kind == "job" and not record.ws_state and not path.exists():
                # A job's folder is named by its submitter, on the worker's own disk.
                path.mkdir(parents=True)
                return seeds.found(path, swarm_id, record.id, record.seed)
            if not record.ws_state and not here and \
                    self.redis.exists(keys.worker_host(record.ws_host)):
                raise WorkspaceElsewhere(f"the workspace of {record.id} is on {record.ws_host}, "
                                         "where a worker runs: handed back for it")
            if not record.ws_state:
                where = f"on {record.ws_host}" if not here else f"at {path}"
                raise WorkspaceLost(f"the workspace of {record.id} was {where} and no "
                                    "snapshot of it was taken")
            workspace = parked.restore(seeds, swarm_id, record.id, record.seed,
                                       record.ws_state)
            self.ledger.place(record.id, str(workspace.path), self.host)
            return workspace
        workspace = seeds.child(swarm_id, record.id, record.seed)
        self.ledger.place(record.id, str(workspace.path), self.host)
        return workspace

    def _jobs_root(self, swarm_id: str) -> Path | None:
        """The folder a job's workspace was checked to lie in when it was submitted
        (``SWARM_SERVE_ROOT``); None for a job that records none (a schedule's folder,
        ``swarm mcp --workspace``, a job from before jobs recorded it)."""
        raw = self.ledger.jobs_root(swarm_id)
        return Path(raw) if raw else None

    @staticmethod
    def _open_job_workspace(path: Path, root: Path, create: bool) -> None:
        """Open the job's workspace as it is now, from its jobs root down following no
        symbolic link (made there when missing, with ``create``): :class:`PathRefused` when
        it is not the folder the API checked (swapped for a link since, say)."""
        if create:
            root.mkdir(parents=True, exist_ok=True)  # the operator's (a worker's own disk)
        try:
            os.close(grants.open_beneath(path, root, create=create))
        except PathRefused as exc:
            raise PathRefused(f"{path} is refused: {exc}; it was a folder inside the jobs "
                              "root (SWARM_SERVE_ROOT) when the job was submitted, so nothing "
                              "runs in it") from None
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not create:
                return  # gone: restored from its snapshot, or lost (see _workspace)
            raise WorkspaceError(f"{path} cannot be opened: {exc.strerror or exc}") from None


