"""What the swarm's services do with jobs and approvals, whatever speaks for them: the HTTP
API (:mod:`swarm.serve.app`) and the MCP server (:mod:`swarm.serve.mcp`) both call these.

Submit a job, look it up, cancel it, follow its events until it settles; list the pending
approvals and answer one. Each call names its :class:`~swarm.serve.auth.Caller`: a user
token's calls see the jobs it submitted only (and their approvals); any other job is a
404, worded as for a job that does not exist. A request that cannot be done raises
:class:`~swarm.errors.RequestError` with the HTTP status that fits. Everything here but
:meth:`Service.follow` is blocking (Redis): async callers run it in a thread.

Over 400 lines because it is one idea, the operations the two front ends share; split by
operation, each part would repeat the caller's scoping (what a user token may see) that
every call here applies.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
import redis
from celery import Celery

from swarm.cache import TTLCache
from swarm.config import Settings
from swarm.domain.approval import Decision
from swarm.domain.records import AgentRecord
from swarm.errors import ConfigError, RequestError, WorkspaceError
from swarm.report import conversation
from swarm.report.display import Prices
from swarm.report.view import AgentView, SwarmReader, model_of
from swarm.runtime.jobs import job_run_id, job_state, job_state_name, submit_job
from swarm.serve.auth import Authenticator, Caller
from swarm.serve.jobs import (
    check_job_task,
    inherited_settings,
    inside_root,
    model_context,
    new_job_folder,
)
from swarm.serve.models import (
    AgentCancelled,
    AgentDetail,
    AgentDiff,
    Approval,
    ApprovalDone,
    CancelResult,
    ConversationEntry,
    Job,
    JobRequest,
    JobSummary,
    MessageSent,
    SwarmSnapshot,
)
from swarm.store import keys
from swarm.store.approvals import ApprovalQueue, closed_because, outcome, swarm_of
from swarm.store.ledger import Ledger
from swarm.store.mailbox import Mailbox
from swarm.store.reads import Reads
from swarm.store.sessions import RedisSessionStore
from swarm.store.snapshots import SnapshotStore
from swarm.workspace import gitstate as g
from swarm.workspace.seed import EMPTY, Seeds

SETTLED_JOB = ("done", "failed", "cancelled")
#: Limits where 0 means "no cap".
UNCAPPED_AT_ZERO = ("max_turns", "child_max_turns", "token_budget")
#: Seconds one XREAD of a job's events blocks (a gone client is noticed this fast).
READ_BLOCK = 1.0
#: Seconds the model's context length is trusted before ``/models`` is asked again.
CONTEXT_TTL = 300.0
#: Where the answer to "which approvals are pending?" is, for messages.
LIST_HINT = "GET /v1/approvals, the list_approvals tool or `swarm approve` lists the pending ones"
#: Swarms whose snapshot reader (it keeps what settled runs left) a service keeps.
READERS = 64
#: Characters of one text of a conversation (a message, a command's output) an agent's
#: detail carries: its head and tail.
TEXT_CAP = 4000
#: Bytes of an agent's diff its detail carries.
DIFF_CAP = 256 * 1024
#: Swarms of the index a listing reads at most, looking for those the caller may see.
LIST_SCAN = 5000

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
    reads: Reads = field(init=False)
    _context: TTLCache[str, int] = field(init=False)
    #: Set by :meth:`stop`: the server is stopping, every :meth:`follow` ends.
    stopping: bool = field(default=False, init=False)
    _reads: set[anyio.CancelScope] = field(default_factory=set, init=False, repr=False)
    prices: Prices = field(default_factory=Prices.from_env_or_none)
    _readers: OrderedDict[str, SwarmReader] = field(init=False, default_factory=OrderedDict)
    _readers_lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.redis)
        self.reads = Reads(self.redis)
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
        try:
            return submit_job(self.ledger, self.celery, body.task, workspace,
                              self.job_settings(body), source=source, owner=caller.id,
                              jobs_root=root, home=self.settings.home)
        except ConfigError as exc:  # an agent type's file is wrong: nothing was queued
            raise RequestError(str(exc), 400) from None

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
        def read(block: float) -> list[Entry]:
            return self.ledger.events_since(job_id, last, count=200, block_ms=int(block * 1000))

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

    def jobs(self, caller: Caller, limit: int = 100) -> list[JobSummary]:
        """The latest ``limit`` jobs and swarms ``caller`` may see, newest first (a user
        token's own jobs; an admin's every job and every swarm of a terminal)."""
        out: list[JobSummary] = []
        names = ["root", "task", "state", "created", "settled", "source", "owner"]
        for start in range(0, LIST_SCAN, 500):
            ids = self.reads.swarm_ids(start, start + 499)
            rows = self.reads.swarm_fields(ids, names)
            mine = [(sid, row) for sid, row in zip(ids, rows, strict=True)
                    if "created" in row and caller.owns(row.get("owner", ""))]
            jobs = self.reads.jobs([sid for sid, _ in mine],
                                   [job_run_id(sid) for sid, _ in mine])
            for (sid, row), (run_state, count) in zip(mine, jobs, strict=True):
                out.append(JobSummary(
                    id=sid, kind="job" if run_state is not None else "swarm",
                    source=row.get("source", ""), task=row.get("task", ""),
                    state=job_state_name(run_state) if run_state is not None
                    else row.get("state") or "?",
                    created=float(row.get("created") or 0),
                    settled=float(row["settled"]) if row.get("settled") else None,
                    agents=count, owner=row.get("owner", "")))
                if len(out) >= limit:
                    return out
            if len(ids) < 500:
                break
        return out

    def reader(self, job_id: str) -> SwarmReader:
        """The snapshot reader of ``job_id`` (kept for the latest :data:`READERS` swarms)."""
        with self._readers_lock:
            reader = self._readers.pop(job_id, None) or SwarmReader(self.redis)
            self._readers[job_id] = reader
            while len(self._readers) > READERS:
                self._readers.popitem(last=False)
            return reader

    def snapshot(self, job_id: str, caller: Caller) -> SwarmSnapshot:
        """The job's swarm now (what `swarm status --json` prints) and the id of its last
        event before it was read, to follow its events from."""
        self.visible(job_id, caller)
        last = self.reads.last_event(job_id)
        snapshot = self.reader(job_id).load(job_id)
        if snapshot is None:
            raise RequestError(f"no job {job_id!r}", 404)
        return SwarmSnapshot(**snapshot.to_json(self.prices),
                             last_event=last)

    def agent_record(self, job_id: str, agent_id: str, caller: Caller) -> AgentRecord:
        """The agent ``agent_id`` of the job; 404 when the job is not ``caller``'s to see
        or has no such agent."""
        self.visible(job_id, caller)
        record = self.ledger.agent(agent_id)
        if record is None or record.swarm != job_id:
            raise RequestError(f"no agent {agent_id!r} in job {job_id!r}", 404)
        return record

    def agent(self, job_id: str, agent_id: str, caller: Caller, tail: int = 50) -> AgentDetail:
        """The agent's record, the last ``tail`` entries of its conversation (each text
        capped at :data:`TEXT_CAP` characters) and its latest run's result."""
        record = self.agent_record(job_id, agent_id, caller)
        run = self.ledger.run(record.run) if record.run else None
        session = RedisSessionStore(self.redis, index=False).load(record.session_id)
        shown, earlier = conversation.entries(session.messages if session else [], tail=tail,
                                              text_cap=TEXT_CAP)
        view = AgentView.from_record(record)
        view.task = run.message if run is not None and record.kind != "root" else \
            self.ledger.swarm(job_id).get("task", "")
        result: dict[str, Any] | None = None
        if run is not None and run.state in ("done", "failed", "cancelled", "timed_out",
                                             "refused"):
            result = {k: v for k, v in run.result.items() if k != "usage_at_start"}
            result["state"] = run.state
        elif run is None and view.is_settled:  # a root in a terminal keeps its own
            result = {"state": view.state, "answer": view.answer or None,
                      "error": view.error or None}
        for name in ("answer", "error", "output"):
            if result is not None and isinstance(result.get(name), str):
                result[name] = conversation.cap(result[name], TEXT_CAP * 4)
        return AgentDetail(agent={**view.to_json(time.time()),
                                  "cost": self.prices.cost(
                                      view.usage, model_of(self.ledger.swarm(job_id),
                                                           view.type))},
                           conversation=[ConversationEntry(**e) for e in shown],
                           earlier=earlier, result=result)

    def diff(self, job_id: str, agent_id: str, caller: Caller) -> AgentDiff:
        """What the agent's work changed in the files it started from (its settled run's
        changes, as `swarm land AGENT --show` prints them), at most :data:`DIFF_CAP`
        bytes; fetched from the store into this host's cache as a worker would."""
        record = self.agent_record(job_id, agent_id, caller)
        run = self.ledger.run(record.run) if record.run else None
        result = run.result if run is not None else {}

        def none(note: str) -> AgentDiff:
            return AgentDiff(agent=agent_id, diff="", stat="", truncated=False, note=note)

        delta = str(result.get("delta") or "")
        if run is None or run.state not in ("done", "failed", "cancelled", "timed_out"):
            return none("its work is shown once it has settled")
        if not delta:
            return none(str(result.get("home_error") or "it changed no file"))
        seed = str(result.get("seed") or "")
        base = seed if seed and seed != EMPTY else g.EMPTY_TREE
        seeds = Seeds(SnapshotStore(self.redis), self.settings.home, socket.gethostname())
        try:
            repo = seeds.cache
            seeds.fetch(delta, repo)
            stat = g.git("diff", "--shortstat", base, delta, repo=repo)
            text, more = g.git_head("diff", "--no-ext-diff", "--no-textconv", "--no-color",
                                    base, delta, repo=repo, limit=DIFF_CAP)
        except WorkspaceError as exc:
            return none(f"its work cannot be read: {exc}")
        return AgentDiff(agent=agent_id, diff=text, stat=stat, truncated=more,
                         note="" if text else "it changed no file")

    def cancel_agent(self, job_id: str, agent_id: str, reason: str,
                     caller: Caller) -> AgentCancelled:
        """Cancel the agent and everything under it (idempotent)."""
        self.agent_record(job_id, agent_id, caller)
        return AgentCancelled(id=agent_id, job=job_id,
                              flagged=self.ledger.cancel(agent_id, reason))

    def say(self, job_id: str, agent_id: str, text: str, source: str,
            caller: Caller) -> MessageSent:
        """Tell a running agent of the job ``text`` at its next turn boundary: 404 as for
        its other calls, 409 once it has settled, 413 for a message too large for the
        model's context (as a task would be)."""
        self.agent_record(job_id, agent_id, caller)
        check_job_task(text, self.context_length(), self.settings)
        sent = Mailbox(self.redis, agent_id).send(text, source)
        return MessageSent(id=sent, job=job_id, agent=agent_id)

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
                owners = self.reads.swarm_fields(swarm_ids, ["owner"])
                swarm_ids = [sid for sid, row in zip(swarm_ids, owners, strict=True)
                             if caller.owns(row.get("owner", ""))]
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
