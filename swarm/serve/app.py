"""The ASGI app of ``swarm serve`` (FastAPI): jobs, their events, cancel, approvals.

Every route needs ``Authorization: Bearer <token>``; the OpenAPI document is at
``/openapi.json`` (behind the token too). Handlers that talk to Redis are plain
functions (FastAPI runs them in threads); the event stream reads the swarm's Redis
stream with ``XREAD BLOCK`` in a thread, one second at a time.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, cast

import redis
from celery import Celery
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request, Security
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from swarm import __version__
from swarm.config import Settings
from swarm.errors import StoreError
from swarm.runtime.jobs import job_state, submit_job
from swarm.serve.auth import Authenticator
from swarm.serve.jobs import WorkspaceError, inherited_settings, inside_root, new_job_folder
from swarm.serve.models import (
    MAX_BODY,
    MAX_TASK,
    Approval,
    ApprovalAnswer,
    ApprovalDone,
    CancelResult,
    Error,
    Job,
    JobCreated,
    JobRequest,
)
from swarm.store import keys
from swarm.store.approvals import CANCELLED, TIMED_OUT, ApprovalQueue, outcome
from swarm.store.ledger import Ledger

log = logging.getLogger(__name__)

SETTLED_JOB = ("done", "failed", "cancelled")
#: Limits where 0 means "no cap".
UNCAPPED_AT_ZERO = ("max_turns", "token_budget")
#: Seconds one XREAD blocks (a closed connection is noticed this fast).
READ_BLOCK = 1.0
#: Seconds of silence after which the event stream sends a comment, so proxies keep it.
KEEPALIVE = 15.0
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
EVENT_ID = r"^(?:[0-9]{1,20}-[0-9]{1,20})?$"

JobId = Annotated[str, PathParam(pattern=ID_PATTERN, description="a job (swarm) id")]
ApprovalId = Annotated[str, PathParam(pattern=ID_PATTERN, description="an approval id")]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(HTTPBearer(
    auto_error=False, description="SWARM_SERVE_TOKEN or a token from `swarm token create`"))]
JobFilter = Annotated[str | None, Query(pattern=ID_PATTERN, description="only this job")]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": Error} for code in codes}


@dataclass
class Service:
    """What the app works with: the store, the Celery app, the service's settings (whose
    explicit ones jobs inherit, as children inherit a ``swarm run``'s) and the jobs root."""

    redis: redis.Redis
    celery: Celery
    settings: Settings
    root: Path
    auth: Authenticator
    ledger: Ledger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.redis)
        self.root.mkdir(parents=True, exist_ok=True)

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

    def job(self, job_id: str) -> Job:
        state = job_state(self.ledger, job_id)
        if not state:
            raise HTTPException(404, f"no job {job_id!r}")
        info = self.ledger.swarm(job_id)
        return Job(**state, source=info.get("source", ""), workspace=info.get("workspace", ""),
                   task=info.get("task", ""))

    def pending(self, job: str | None) -> list[Approval]:
        if job is not None:
            if not self.ledger.swarm(job):
                raise HTTPException(404, f"no job {job!r}")
            swarm_ids = [job]
        else:
            head, tail = keys.approvals("\0").split("\0")
            swarm_ids = sorted({str(k)[len(head):-len(tail)] for k in
                                self.redis.scan_iter(match=keys.approvals("*"), count=1000)})
        out = [Approval(id=p.id, job=p.swarm, agent=p.agent, tool=p.tool, summary=p.summary,
                        reason=p.reason, created=p.created)
               for sid in swarm_ids for p in ApprovalQueue(self.redis, sid).pending()]
        return sorted(out, key=lambda a: a.created)

    def find_approval(self, approval_id: str, job: str | None) -> str:
        """The job holding the pending approval ``approval_id``; else 409 when it was
        answered (or timed out), 404 when it is unknown."""
        if job is not None:
            if self.redis.hexists(keys.approvals(job), approval_id):
                return job
        else:
            for approval in self.pending(None):
                if approval.id == approval_id:
                    return approval.job
        self.refuse_if_closed(approval_id)
        raise HTTPException(404, f"no approval {approval_id!r} is pending"
                                 + (f" in job {job!r}" if job is not None else "")
                                 + "; GET /v1/approvals lists the pending ones")

    def refuse_if_closed(self, approval_id: str) -> None:
        """409 when the approval ``approval_id`` was answered already or timed out."""
        how = outcome(self.redis, approval_id)
        if how is None:
            return
        why = {TIMED_OUT: "no one answered in time, so it was denied",
               CANCELLED: "its agent was cancelled"}.get(how, f"it was answered already ({how})")
        raise HTTPException(409, f"approval {approval_id!r} is not pending: {why}")


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413 before anything reads them."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(send, 413 if length.isdigit() else 400)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._refuse(send, 413)
                return
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, status: int) -> None:
        detail = (f"request body is over {self.limit} bytes; a task may have up to "
                  f"{MAX_TASK} characters" if status == 413 else "bad Content-Length header")
        response = JSONResponse({"detail": detail}, status_code=status)
        await send({"type": "http.response.start", "status": status,
                    "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


def known_query(request: Request) -> None:
    """Refuse query parameters the route does not take (a typo must not pass silently)."""
    route = request.scope.get("route")
    allowed = {p.alias for p in route.dependant.query_params} if isinstance(route, APIRoute) \
        else set()
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        names = ", ".join(map(repr, unknown))[:500]
        takes = ", ".join(sorted(allowed)) or "none"
        noun = "parameter" if len(unknown) == 1 else "parameters"
        raise HTTPException(422, f"unknown query {noun} {names}; this endpoint takes: {takes}")


def json_body(request: Request) -> None:
    """Refuse a body not sent as JSON with 415 (without this, a missing Content-Type ends in
    a 422 that does not say what to fix)."""
    given = request.headers.get("content-type", "")
    media = given.partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/")
                                       and media.endswith("+json")):
        return
    got = f"got Content-Type {given[:100]!r}" if given else "got no Content-Type"
    raise HTTPException(415, "send the body as JSON with the header "
                             f"`Content-Type: application/json` ({got})")


def create_app(service: Service) -> FastAPI:
    """The API on ``service``; serve it with uvicorn, test it in-process."""
    app = FastAPI(
        title="swarm", version=__version__, openapi_url=None, docs_url=None, redoc_url=None,
        description="Submit, watch, cancel and approve swarm jobs. Every request needs "
                    "`Authorization: Bearer <token>` (SWARM_SERVE_TOKEN or `swarm token "
                    "create`).")

    def authorized(credentials: Credentials) -> None:
        if credentials is None or not service.auth.check(credentials.credentials):
            raise HTTPException(
                401, "missing or wrong token: send `Authorization: Bearer <token>` with "
                     "SWARM_SERVE_TOKEN or a token from `swarm token create`",
                headers={"WWW-Authenticate": "Bearer"})

    api = APIRouter(prefix="/v1", dependencies=[Depends(authorized), Depends(known_query)],
                    responses=_errors(400, 401, 422, 503))

    @api.post("/jobs", status_code=201, response_model=JobCreated,
              responses=_errors(403, 409, 413, 415), dependencies=[Depends(json_body)],
              summary="Submit a job")
    def create_job(body: JobRequest) -> JobCreated:
        """Queue a root agent for ``task`` on the workers; returns its id at once."""
        try:
            workspace = (inside_root(service.root, body.workspace) if body.workspace
                         else new_job_folder(service.root))
        except WorkspaceError as exc:
            raise HTTPException(exc.status, str(exc)) from None
        job_id = submit_job(service.ledger, service.celery, body.task, workspace,
                            service.job_settings(body), source="api")
        log.info("job %s queued (%d characters, approve=%s)", job_id, len(body.task),
                 body.approve)
        return JobCreated(id=job_id)

    @api.get("/jobs/{job_id}", response_model=Job, responses=_errors(404), summary="A job")
    def get_job(job_id: JobId) -> Job:
        """State (queued, running, done, failed, cancelled), answer, usage and agents."""
        return service.job(job_id)

    @api.post("/jobs/{job_id}/cancel", status_code=202, response_model=CancelResult,
              responses=_errors(404), summary="Cancel a job")
    def cancel_job(job_id: JobId) -> CancelResult:
        """Cancel the job and every agent under it (idempotent); they stop within seconds."""
        job = service.job(job_id)
        flagged = service.ledger.cancel(job_id, "cancelled over the HTTP API")
        return CancelResult(id=job_id, state=job.state, flagged=flagged)

    @api.get("/jobs/{job_id}/events", summary="Follow a job's events (server-sent events)",
             responses={**_errors(404), 200: {"content": {"text/event-stream": {
                 "schema": {"type": "string"}}}, "description": "the event stream"}},
             response_class=StreamingResponse)
    async def job_events(
            job_id: JobId, request: Request,
            last_event_id: Annotated[str, Header(
                alias="Last-Event-ID", pattern=EVENT_ID,
                description="resume after this event id")] = "") -> StreamingResponse:
        """Each event has ``id:`` (its stream id), ``event:`` (its kind) and JSON ``data:``;
        the stream ends with ``event: end`` once the job has settled."""
        await run_in_threadpool(service.job, job_id)  # 404 for unknown jobs
        return StreamingResponse(_events(service, job_id, last_event_id or "0-0", request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @api.get("/approvals", response_model=list[Approval], responses=_errors(404),
             summary="Pending approvals")
    def list_approvals(job: JobFilter = None) -> list[Approval]:
        """Tool calls waiting for a person, oldest first, across jobs or of ``job``."""
        return service.pending(job)

    @api.post("/approvals/{approval_id}", response_model=ApprovalDone,
              responses=_errors(404, 409, 413, 415), dependencies=[Depends(json_body)],
              summary="Answer an approval")
    def answer_approval(approval_id: ApprovalId, body: ApprovalAnswer,
                        job: JobFilter = None) -> ApprovalDone:
        """Approve or deny a pending tool call (``always``: the tool for the whole job)."""
        job_id = service.find_approval(approval_id, job)
        if not ApprovalQueue(service.redis, job_id).answer(approval_id, body.decision):
            service.refuse_if_closed(approval_id)
            raise HTTPException(404, f"approval {approval_id!r} is no longer pending")
        return ApprovalDone(id=approval_id, job=job_id, decision=body.decision)

    app.include_router(api)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authorized)])
    def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Never echo the input back (it may be megabytes, or a secret).
        items = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
                  "type": str(e.get("type", ""))} for e in exc.errors()]
        return JSONResponse({"detail": items}, status_code=422)

    @app.exception_handler(redis.RedisError)
    @app.exception_handler(StoreError)
    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.error("store error on %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse({"detail": "the swarm's Redis is unavailable; try again later"},
                            status_code=503)

    app.add_middleware(BodyLimit)
    return app


def _sse(event_id: str, kind: str, data: dict[str, Any]) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    kind = re.sub(r"[^A-Za-z0-9_.-]", "_", kind)[:40] or "event"
    return f"{head}event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(service: Service, job_id: str, last: str,
                  request: Request) -> AsyncIterator[str]:
    """The job's event stream from after ``last``, ending with ``event: end``."""
    key = keys.events(job_id)

    def read(block: float) -> list[tuple[str, dict[str, str]]]:
        got: Any = service.redis.xread({key: last}, count=200, block=int(block * 1000))
        return cast("list[tuple[str, dict[str, str]]]", got[0][1]) if got else []

    def settled() -> str:
        state = job_state(service.ledger, job_id).get("state", "")
        if state in SETTLED_JOB:
            return str(state)
        info = service.ledger.swarm(job_id)  # a `swarm run` root's swarm settles this way
        if info.get("settled"):
            return {"done": "done", "cancelled": "cancelled"}.get(info.get("state", ""), "failed")
        return ""

    final = ""
    quiet = 0.0
    yield ": swarm events of " + job_id + "\n\n"
    while True:
        if await request.is_disconnected():
            return
        draining = bool(final)  # settled before this read: this read drains the rest
        try:
            entries = await run_in_threadpool(read, 0.25 if final else READ_BLOCK)
            if not final and not entries:
                final = await run_in_threadpool(settled)
        except (redis.RedisError, StoreError) as exc:
            log.error("event stream of %s stopped: %s", job_id, exc)
            yield _sse("", "error", {"id": job_id, "detail": "the swarm's Redis is unavailable; "
                                     "reconnect with Last-Event-ID to resume"})
            return
        for entry_id, fields in entries:
            last = entry_id
            yield _sse(entry_id, fields.get("kind") or "event", dict(fields))
        if draining and not entries:
            yield _sse("", "end", {"id": job_id, "state": final})
            return
        quiet = 0.0 if entries else quiet + READ_BLOCK
        if quiet >= KEEPALIVE:
            quiet = 0.0
            yield ": keep-alive\n\n"
