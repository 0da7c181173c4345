"""The ASGI app of ``swarm serve`` (FastAPI): jobs, their trees, agents and events, cancel,
approvals, the same over MCP at ``/mcp`` (:mod:`swarm.serve.mcp`), and the page at ``/``
(:mod:`swarm.serve.page`).

Every route but the page's static files needs ``Authorization: Bearer <token>``; the
OpenAPI document is at ``/openapi.json`` (behind the token too). A user token sees and
acts on the jobs it submitted only (another's is a 404); an admin token on every job
(:mod:`swarm.serve.auth`).
The routes are thin: what they do is :class:`~swarm.serve.service.Service`'s, whose
:class:`~swarm.errors.RequestError` becomes the response's status. Handlers that talk to
Redis are plain functions (FastAPI runs them in threads); the event stream reads the swarm's
Redis stream in a thread, a second at a time.
"""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import aclosing
from typing import Annotated, Any

import redis
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request, Security
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.routing import Route

from swarm import __version__
from swarm.errors import ConfigError, RequestError, StoreError
from swarm.serve.auth import UNAUTHORIZED, Caller
from swarm.serve.models import (
    ID_PATTERN,
    MAX_BODY,
    MAX_TASK,
    AgentCancelled,
    AgentDetail,
    AgentDiff,
    AgentMessage,
    Approval,
    ApprovalAnswer,
    ApprovalDone,
    CancelResult,
    Error,
    Job,
    JobCreated,
    JobRequest,
    JobSummary,
    MessageSent,
    SwarmSnapshot,
)
from swarm.serve.page import add_page
from swarm.serve.service import READ_BLOCK, Service

log = logging.getLogger(__name__)

#: Seconds of silence after which the event stream sends a comment, so proxies keep it.
KEEPALIVE = 15.0
EVENT_ID = r"^(?:[0-9]{1,20}-[0-9]{1,20})?$"

JobId = Annotated[str, PathParam(pattern=ID_PATTERN, description="a job (swarm) id")]
AgentId = Annotated[str, PathParam(pattern=ID_PATTERN, description="an agent id of the job")]
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


def the_caller(request: Request) -> Caller:
    """Who sent the request, as the token check (a dependency of every route) found."""
    caller = getattr(request.state, "caller", None)
    if not isinstance(caller, Caller):  # never: the check runs first
        raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
    return caller


Who = Annotated[Caller, Depends(the_caller)]


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
    """The API on ``service`` (with the MCP server at ``/mcp``); serve it with uvicorn, test
    it in-process."""
    auth = service.auth
    if auth is None:
        raise ConfigError("the HTTP API needs its tokens: build the Service with an "
                          "Authenticator")
    # The SDK takes a while to import: only a process that builds the app pays for it.
    from swarm.serve.mcp import McpEndpoint

    mcp = McpEndpoint(service, auth)
    app = FastAPI(
        title="swarm", version=__version__, openapi_url=None, docs_url=None, redoc_url=None,
        lifespan=lambda _: mcp.running(),
        description="Submit, watch, cancel and approve swarm jobs. Every request needs "
                    "`Authorization: Bearer <token>` (SWARM_SERVE_TOKEN or `swarm token "
                    "create`). A user token sees and acts on the jobs it submitted only "
                    "(another token's job is a 404); an admin token (SWARM_SERVE_TOKEN, "
                    "`swarm token create --admin`) on every job. The same over MCP "
                    "(Streamable HTTP): `/mcp`.")

    def authorized(request: Request, credentials: Credentials) -> None:
        caller = auth.check(credentials.credentials) if credentials is not None else None
        if caller is None:
            raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
        request.state.caller = caller

    api = APIRouter(prefix="/v1", dependencies=[Depends(authorized), Depends(known_query)],
                    responses=_errors(400, 401, 422, 503))

    @api.post("/jobs", status_code=201, response_model=JobCreated,
              responses=_errors(403, 409, 413, 415), dependencies=[Depends(json_body)],
              summary="Submit a job")
    def create_job(body: JobRequest, caller: Who) -> JobCreated:
        """Queue a root agent for ``task`` on the workers; returns its id at once. The job
        is the token's: a user token sees only the jobs it submitted. A task too large for
        the model's context is a 413 that says its size and the context; nothing is
        queued."""
        job_id = service.submit(body, "api", caller)
        log.info("job %s queued (%d characters, approve=%s)", job_id, len(body.task),
                 body.approve)
        return JobCreated(id=job_id)

    @api.get("/jobs", response_model=list[JobSummary], summary="Jobs and swarms")
    def list_jobs(caller: Who, limit: Annotated[int, Query(
            ge=1, le=1000, description="at most this many, newest first")] = 100
                  ) -> list[JobSummary]:
        """The jobs the token may see, newest first (an admin token's: every job, and the
        swarms of roots in a terminal)."""
        return service.jobs(caller, limit)

    @api.get("/jobs/{job_id}", response_model=Job, responses=_errors(404), summary="A job")
    def get_job(job_id: JobId, caller: Who) -> Job:
        """State (queued, running, done, failed, cancelled), answer, usage and agents."""
        return service.job(job_id, caller)

    @api.post("/jobs/{job_id}/cancel", status_code=202, response_model=CancelResult,
              responses=_errors(404), summary="Cancel a job")
    def cancel_job(job_id: JobId, caller: Who) -> CancelResult:
        """Cancel the job and every agent under it (idempotent); they stop within seconds."""
        return service.cancel(job_id, "cancelled over the HTTP API", caller)

    @api.get("/jobs/{job_id}/events", summary="Follow a job's events (server-sent events)",
             responses={**_errors(404), 200: {"content": {"text/event-stream": {
                 "schema": {"type": "string"}}}, "description": "the event stream"}},
             response_class=StreamingResponse)
    async def job_events(
            job_id: JobId, request: Request, caller: Who,
            last_event_id: Annotated[str, Header(
                alias="Last-Event-ID", pattern=EVENT_ID,
                description="resume after this event id")] = "") -> StreamingResponse:
        """Each event has ``id:`` (its stream id), ``event:`` (its kind) and JSON ``data:``;
        the stream ends with ``event: end``: ``reason`` "settled" (with the job's ``state``)
        once the job has settled, "server stopping" when the service stops (the job goes
        on; reconnect with ``Last-Event-ID``)."""
        await run_in_threadpool(service.job, job_id, caller)  # 404 for unknown jobs
        return StreamingResponse(_events(service, job_id, last_event_id or "0-0", request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @api.get("/jobs/{job_id}/snapshot", response_model=SwarmSnapshot, responses=_errors(404),
             summary="A job's tree of agents")
    def job_snapshot(job_id: JobId, caller: Who) -> SwarmSnapshot:
        """Every agent of the job in tree order with its state, depth, times, tokens, cost,
        last action, answer or error and landing (what `swarm status --json` prints), and
        the id of the last event before it was read (follow the events from there)."""
        return service.snapshot(job_id, caller)

    @api.get("/jobs/{job_id}/agents/{agent_id}", response_model=AgentDetail,
             responses=_errors(404), summary="An agent of a job")
    def job_agent(job_id: JobId, agent_id: AgentId, caller: Who,
                  tail: Annotated[int, Query(ge=1, le=500, description=(
                      "entries of the conversation, from its end"))] = 50) -> AgentDetail:
        """The agent's record, the end of its conversation (task, commands with their
        output, what it said; each text capped at its head and tail) and its result."""
        return service.agent(job_id, agent_id, caller, tail)

    @api.get("/jobs/{job_id}/agents/{agent_id}/diff", response_model=AgentDiff,
             responses=_errors(404), summary="The changes of an agent's work")
    def job_agent_diff(job_id: JobId, agent_id: AgentId, caller: Who) -> AgentDiff:
        """What the agent's settled work changed in the files it started from (as `swarm
        land AGENT --show` prints it), capped."""
        return service.diff(job_id, agent_id, caller)

    @api.post("/jobs/{job_id}/agents/{agent_id}/cancel", status_code=202,
              response_model=AgentCancelled, responses=_errors(404),
              summary="Cancel an agent and its subtree")
    def cancel_agent(job_id: JobId, agent_id: AgentId, caller: Who) -> AgentCancelled:
        """Cancel the agent and every agent under it (idempotent); its parent goes on with
        the others."""
        return service.cancel_agent(job_id, agent_id, "cancelled over the HTTP API", caller)

    @api.post("/jobs/{job_id}/agents/{agent_id}/messages", status_code=202,
              response_model=MessageSent, responses=_errors(404, 409, 413, 415),
              dependencies=[Depends(json_body)], summary="Tell a running agent something")
    def say_to_agent(job_id: JobId, agent_id: AgentId, body: AgentMessage,
                     caller: Who) -> MessageSent:
        """Queue a message for the agent: it reads it at its next turn boundary (after the
        command or model call in flight; a parent waiting for its children, after their
        results) as a user message, and the job's events show it (``message``). A settled
        agent refuses it with 409."""
        return service.say(job_id, agent_id, body.text, "api", caller)

    @api.get("/approvals", response_model=list[Approval], responses=_errors(404),
             summary="Pending approvals")
    def list_approvals(caller: Who, job: JobFilter = None) -> list[Approval]:
        """Tool calls waiting for a person, oldest first, across the token's jobs (an
        admin's: every job's) or of ``job``."""
        return service.pending(job, caller)

    @api.post("/approvals/{approval_id}", response_model=ApprovalDone,
              responses=_errors(404, 409, 413, 415), dependencies=[Depends(json_body)],
              summary="Answer an approval")
    def answer_approval(approval_id: ApprovalId, body: ApprovalAnswer, caller: Who,
                        job: JobFilter = None) -> ApprovalDone:
        """Approve or deny a pending tool call (``always``: the tool for the whole job)."""
        return service.answer(approval_id, body.decision, job, caller)

    app.include_router(api)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authorized)])
    def openapi() -> dict[str, Any]:
        return app.openapi()

    app.router.routes.append(Route("/mcp", mcp, methods=["GET", "POST", "DELETE"]))
    add_page(app)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

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


class Server(uvicorn.Server):
    """uvicorn's server for ``service``: as it starts to shut down, every event stream (and
    MCP call waiting for a job) ends, each with its last event, before it waits for the
    connections to close (else it waited for its graceful timeout, then cancelled them)."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.service.stop()
        await super().shutdown(sockets)


def _sse(event_id: str, kind: str, data: dict[str, Any]) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    kind = re.sub(r"[^A-Za-z0-9_.-]", "_", kind)[:40] or "event"
    return f"{head}event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(service: Service, job_id: str, last: str,
                  request: Request) -> AsyncIterator[str]:
    """The job's event stream from after ``last``, ending with ``event: end`` (when the
    job settles or the service stops)."""
    quiet = 0.0
    yield ": swarm events of " + job_id + "\n\n"
    try:
        async with aclosing(service.follow(job_id, last)) as batches:
            async for batch in batches:
                for entry_id, fields in batch.entries:
                    yield _sse(entry_id, fields.get("kind") or "event", dict(fields))
                if batch.final:
                    yield _sse("", "end", {"id": job_id, "state": batch.final,
                                           "reason": "settled"})
                    return
                if await request.is_disconnected():
                    return
                quiet = 0.0 if batch.entries else quiet + READ_BLOCK
                if quiet >= KEEPALIVE:
                    quiet = 0.0
                    yield ": keep-alive\n\n"
        # The batches end unsettled only when the service stops.
        yield _sse("", "end", {"id": job_id, "reason": "server stopping",
                               "detail": "the job goes on; reconnect with Last-Event-ID to "
                                         "follow it"})
    except (redis.RedisError, StoreError) as exc:
        log.error("event stream of %s stopped: %s", job_id, exc)
        yield _sse("", "error", {"id": job_id, "detail": "the swarm's Redis is unavailable; "
                                 "reconnect with Last-Event-ID to resume"})
