"""What the swarm's services do with jobs and approvals, whatever speaks for them: the HTTP
API (:mod:`swarm.serve.app`) and the MCP server (:mod:`swarm.serve.mcp`) both call these.

Submit a job, look it up, cancel it, follow its events until it settles; list the pending
approvals and answer one. Each call names its :class:`~swarm.serve.auth.Caller`: a user
token's calls see the jobs it submitted only (and their approvals); any other job is a
404, worded as for a job that does not exist. A request that cannot be done raises
:class:`~swarm.errors.RequestError` with the HTTP status that fits. Everything here but
:meth:`Service.follow` is blocking (Redis): async callers run it in a thread.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio.to_thread
import redis
from celery import Celery

from swarm.cache import TTLCache
from swarm.config import Settings
from swarm.domain.approval import Decision
from swarm.errors import RequestError
from swarm.runtime.jobs import job_state, submit_job
from swarm.serve.auth import Authenticator, Caller
from swarm.serve.jobs import (
    check_job_task,
    inherited_settings,
    inside_root,
    model_context,
    new_job_folder,
)
from swarm.serve.models import Approval, ApprovalDone, CancelResult, Job, JobRequest
from swarm.store import keys
from swarm.store.approvals import ApprovalQueue, closed_because, outcome, swarm_of
from swarm.store.ledger import Ledger

SETTLED_JOB = ("done", "failed", "cancelled")
#: Limits where 0 means "no cap".
UNCAPPED_AT_ZERO = ("max_turns", "child_max_turns", "token_budget")
#: Seconds one XREAD of a job's events blocks (a gone client is noticed this fast).
READ_BLOCK = 1.0
#: Seconds the model's context length is trusted before ``/models`` is asked again.
CONTEXT_TTL = 300.0
#: Where the answer to "which approvals are pending?" is, for messages.
LIST_HINT = "GET /v1/approvals, the list_approvals tool or `swarm approve` lists the pending ones"

Entry = tuple[str, dict[str, str]]


@dataclass(frozen=True)
class Batch:
    """Events of a job read at once (maybe none); ``final`` is the job's settled state on
    the last batch, once every event before the settling was read."""

    entries: list[Entry]
    final: str = ""


@dataclass
class Service:
    """What the services work with: the store, the Celery app, the service's settings
    (whose explicit ones jobs inherit, as children inherit a ``swarm run``'s), the jobs
    root, the API's tokens (the HTTP API needs them; ``swarm mcp`` over stdio does not)
    and where jobs that name no workspace work (default: a fresh folder under the root)."""

    redis: redis.Redis
    celery: Celery
    settings: Settings
    root: Path
    auth: Authenticator | None = None
    workspace: Path | None = None
    ledger: Ledger = field(init=False)
    _context: TTLCache[str, int] = field(init=False)
    #: Set by :meth:`stop`: the server is stopping, every :meth:`follow` ends.
    stopping: bool = field(default=False, init=False)
    _reads: set[anyio.CancelScope] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.redis)
        self._context = TTLCache(CONTEXT_TTL, maxsize=1)
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()  # what workers open jobs' workspaces beneath

    # -- jobs ---------------------------------------------------------------------------------

    def job_settings(self, body: JobRequest) -> dict[str, Any]:
        """The service's explicit settings, the request's limits on top (they may only
        tighten the service's own), and ``yes`` for ``approve: all``."""
        given = inherited_settings(self.settings)
        limits = body.limits.model_dump(exclude_none=True) if body.limits is not None else {}
        for name, wanted in limits.items():
            cap = int(getattr(self.settings, name))
            if name in UNCAPPED_AT_ZERO:  # 0 means no cap
                given[name] = wanted if not cap or 0 < wanted < cap else cap
            else:
                given[name] = min(wanted, cap)
        given["yes"] = body.approve == "all"
        return given

    def context_length(self) -> int:
        """The context length of the service's model (:func:`model_context`), looked up at
        most every :data:`CONTEXT_TTL` seconds."""
        known = self._context.get("")
        if known is None:
            known = model_context(self.settings)
            self._context.put("", known)
        return known

    def submit(self, body: JobRequest, source: str, caller: Caller) -> str:
        """Queue a root agent for ``body.task`` on the workers, owned by ``caller``;
        returns the job's id. A task too large for the model's context is a 413, before
        anything is created."""
        check_job_task(body.task, self.context_length(), self.settings)
        root: Path | None = self.root
        if body.workspace:
            workspace = inside_root(self.root, body.workspace)
        elif self.workspace is not None:
            workspace, root = self.workspace, None  # the operator's folder (swarm mcp -C)
        else:
            workspace = new_job_folder(self.root)
        return submit_job(self.ledger, self.celery, body.task, workspace,
                          self.job_settings(body), source=source, owner=caller.id,
                          jobs_root=root, home=self.settings.home)

    def visible(self, job_id: str, caller: Caller) -> dict[str, str]:
        """The job's swarm record when ``caller`` may see it; else 404, the same as for a
        job that does not exist (another token's job is not told of)."""
        info = self.ledger.swarm(job_id)
        if not info or not caller.owns(info.get("owner", "")):
            raise RequestError(f"no job {job_id!r}", 404)
        return info

    def job(self, job_id: str, caller: Caller) -> Job:
        """The job as it stands; 404 when there is none ``caller`` may see."""
        info = self.visible(job_id, caller)
        state = job_state(self.ledger, job_id)
        if not state:
            raise RequestError(f"no job {job_id!r}", 404)
        return Job(**state, source=info.get("source", ""), workspace=info.get("workspace", ""),
                   task=info.get("task", ""), owner=info.get("owner", ""))

    def cancel(self, job_id: str, reason: str, caller: Caller) -> CancelResult:
        """Cancel the job and every agent under it (idempotent)."""
        job = self.job(job_id, caller)
        flagged = self.ledger.cancel(job_id, reason)
        return CancelResult(id=job_id, state=job.state, flagged=flagged)

    def settled(self, job_id: str) -> str:
        """The job's final state once it has settled, else ""."""
        state = job_state(self.ledger, job_id).get("state", "")
        if state in SETTLED_JOB:
            return str(state)
        info = self.ledger.swarm(job_id)  # a `swarm run` root's swarm settles this way
        if info.get("settled"):
            return {"done": "done", "cancelled": "cancelled"}.get(info.get("state", ""), "failed")
        return ""

    def stop(self) -> None:
        """The server is stopping: every :meth:`follow` ends now, without the batch of a
        settled state (call it in their event loop)."""
        self.stopping = True
        for scope in self._reads:
            scope.cancel()

    async def follow(self, job_id: str, last: str = "0-0") -> AsyncGenerator[Batch, None]:
        """The job's events after ``last`` ("0-0": all), a batch per read of at most
        :data:`READ_BLOCK` seconds (empty when nothing came), until the batch that carries
        the settled state, or until :meth:`stop`. Redis errors propagate."""
        key = keys.events(job_id)

        def read(block: float) -> list[Entry]:
            got: Any = self.redis.xread({key: last}, count=200, block=int(block * 1000))
            return cast("list[Entry]", got[0][1]) if got else []

        final = ""
        while not self.stopping:
            draining = bool(final)  # settled before this read: this read drains the rest
            with anyio.CancelScope() as scope:
                # stop() does not wait for the blocked read: its thread ends on its own.
                self._reads.add(scope)
                try:
                    entries = await anyio.to_thread.run_sync(
                        read, 0.25 if final else READ_BLOCK, abandon_on_cancel=True)
                finally:
                    self._reads.discard(scope)
            if scope.cancelled_caught:
                return
            if not final and not entries:
                final = await anyio.to_thread.run_sync(self.settled, job_id)
            if entries:
                last = entries[-1][0]
            if draining and not entries:
                yield Batch([], final)
                return
            yield Batch(entries)

    # -- approvals ----------------------------------------------------------------------------

    def pending(self, job: str | None, caller: Caller) -> list[Approval]:
        """Tool calls waiting for a person, oldest first, across the jobs ``caller`` may
        see or of ``job``."""
        if job is not None:
            self.visible(job, caller)
            swarm_ids = [job]
        else:
            head, tail = keys.approvals("\0").split("\0")
            swarm_ids = sorted({str(k)[len(head):-len(tail)] for k in
                                self.redis.scan_iter(match=keys.approvals("*"), count=1000)})
            if not caller.admin:
                with self.redis.pipeline(transaction=False) as pipe:
                    for sid in swarm_ids:
                        pipe.hget(keys.swarm(sid), "owner")
                    owners = pipe.execute()
                swarm_ids = [sid for sid, owner in zip(swarm_ids, owners, strict=True)
                             if caller.owns(str(owner or ""))]
        out = [Approval(id=p.id, job=p.swarm, agent=p.agent, tool=p.tool, summary=p.summary,
                        reason=p.reason, created=p.created)
               for sid in swarm_ids for p in ApprovalQueue(self.redis, sid).pending()]
        return sorted(out, key=lambda a: a.created)

    def answer(self, approval_id: str, decision: Decision, job: str | None,
               caller: Caller) -> ApprovalDone:
        """Approve or deny a pending tool call (``always``: the tool for the whole job) of
        a job ``caller`` may see."""
        job_id = self.find_approval(approval_id, job, caller)
        if not ApprovalQueue(self.redis, job_id).answer(approval_id, decision):
            self.refuse_if_closed(approval_id, caller)
            raise RequestError(f"approval {approval_id!r} is no longer pending", 404)
        return ApprovalDone(id=approval_id, job=job_id, decision=decision)

    def find_approval(self, approval_id: str, job: str | None, caller: Caller) -> str:
        """The job holding the pending approval ``approval_id``; else 409 when it was
        answered (or timed out), 404 when it is unknown (or of a job ``caller`` may not
        see)."""
        if job is not None:
            if self.redis.hexists(keys.approvals(job), approval_id) and \
                    caller.owns(self.ledger.swarm(job).get("owner", "")):
                return job
        else:
            for approval in self.pending(None, caller):
                if approval.id == approval_id:
                    return approval.job
        self.refuse_if_closed(approval_id, caller)
        raise RequestError(f"no approval {approval_id!r} is pending"
                           + (f" in job {job!r}" if job is not None else "")
                           + f"; {LIST_HINT}", 404)

    def refuse_if_closed(self, approval_id: str, caller: Caller) -> None:
        """409 when the approval ``approval_id`` was answered already or timed out, told
        only to whom may see its job."""
        how = outcome(self.redis, approval_id)
        if how is None:
            return
        if not caller.admin:
            swarm_id = swarm_of(self.redis, approval_id)
            if not swarm_id or not caller.owns(self.ledger.swarm(swarm_id).get("owner", "")):
                return
        raise RequestError(f"approval {approval_id!r} is not pending: {closed_because(how)}",
                           409)
