"""The swarm as an MCP server: other agents (Claude Code, Codex, ...) hand it jobs.

The tools do what the HTTP API does, through the same :class:`~swarm.serve.service.Service`:
submit a job, its status tree, its answer, cancel it, list the pending approvals and answer
one. Waiting for a job (``wait_seconds``) sends an MCP progress notification per event
of the job, and returns early when an approval waits for an answer, so the calling agent
can answer it and wait again. ``swarm mcp`` serves these tools over stdio
(:func:`stdio_runner`); ``swarm serve`` over Streamable HTTP at ``/mcp``
(:class:`McpEndpoint`, behind the API's bearer tokens, stateless: any replica answers).
Over HTTP a user token's tools see the jobs it submitted only, as its HTTP calls do; over
stdio the agent that starts the server is trusted with every job.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from contextlib import aclosing
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
import redis
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import ToolAnnotations
from pydantic import Field, ValidationError

from swarm import __version__
from swarm.domain.approval import Decision
from swarm.errors import RequestError, StoreError
from swarm.runtime.root import describe
from swarm.serve.auth import LOCAL, UNAUTHORIZED, Authenticator, Caller
from swarm.serve.models import (
    ID_PATTERN,
    MAX_TASK,
    Approval,
    ApprovalDone,
    CancelResult,
    Job,
    JobAnswer,
    JobRequest,
    JobStatus,
    Limits,
    MessageSent,
)
from swarm.serve.service import Service

log = logging.getLogger(__name__)

#: Longest a tool call waits for a job, in seconds.
MAX_WAIT = 3600
#: The JSON-RPC error code of a request /mcp refuses before the MCP server sees it (no
#: token, no Redis): one of the codes JSON-RPC leaves to servers.
REFUSED = -32001
#: Where /mcp puts the request's :class:`Caller` in the ASGI scope, for the tools to read.
CALLER = "swarm.caller"

INSTRUCTIONS = """\
swarm runs a task as a tree of LLM agents working in a shell, spread over worker processes:
hand it wide jobs (many files, many independent checks or fixes). submit_job queues one and
returns its id; with wait_seconds it waits (sending progress) until the job settles, an
approval needs an answer, or the time is up; job_answer waits again. With approve="ask",
tool calls the swarm's policies ask about wait in list_approvals until answer_approval
answers them (or they are denied after a timeout). job_status shows the tree of agents;
say_to_agent tells a running agent of it something (it reads it at its next turn)."""

JobIdArg = Annotated[str, Field(pattern=ID_PATTERN, description="the job's id (from submit_job)")]
WaitArg = Annotated[int, Field(
    ge=0, le=MAX_WAIT, description="seconds to wait for the job to settle, with progress "
    "notifications; the wait ends early when an approval waits for an answer (or the server "
    "stops). 0: do not wait")]

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def draw(job: Job) -> str:
    """The job's agents as an indented tree: id, state, label; the root's line first."""
    children: dict[str, list[Any]] = {}
    for agent in job.agents:
        children.setdefault(agent.parent, []).append(agent)
    lines = [f"job {job.id}: {job.state}"]
    todo = [(a, 1) for a in reversed(children.get("", []))]
    while todo:
        agent, depth = todo.pop()
        label = f"  {agent.label}" if agent.label else ""
        lines.append(f"{'  ' * depth}{agent.id} {agent.state}{label}")
        todo.extend((c, depth + 1) for c in reversed(children.get(agent.id, [])))
    return "\n".join(lines)


@contextlib.contextmanager
def tool_errors() -> Iterator[None]:
    """Refusals and a lost Redis as tool errors the calling model reads (the SDK hides the
    text of any other exception)."""
    try:
        yield
    except RequestError as exc:
        raise ToolError(str(exc)) from None
    except (redis.RedisError, StoreError) as exc:
        log.error("MCP tool call failed on the store: %s", exc)
        raise ToolError("the swarm's Redis is unavailable; try again later") from None


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread (the service blocks on Redis), its errors as tool errors."""
    with tool_errors():
        return await anyio.to_thread.run_sync(fn, *args)


async def wait_for(service: Service, job_id: str, seconds: int, ctx: Context[Any, Any],
                   caller: Caller) -> JobAnswer:
    """Follow the job for up to ``seconds``, a progress notification per event; stop when it
    settles, an approval of it waits for an answer or the service stops. Returns where it
    stands."""
    seen = 0
    with anyio.move_on_after(seconds), tool_errors():
        async with aclosing(service.follow(job_id)) as batches:
            async for batch in batches:
                waiting: list[Approval] = []
                for _, fields in batch.entries:
                    seen += 1
                    message = describe(fields)
                    if fields.get("kind") == "approval":
                        message = f"{message}: {fields.get('text', '')}"
                        waiting = await call(service.pending, job_id, caller)
                        if waiting:
                            message += "; waiting for answer_approval: " + ", ".join(
                                a.id for a in waiting)
                    await ctx.report_progress(seen, None, message)
                if batch.final or waiting:
                    break
    answer: JobAnswer = await call(answer_of, service, job_id, caller)
    return answer


def answer_of(service: Service, job_id: str, caller: Caller) -> JobAnswer:
    job = service.job(job_id, caller)
    pending = [] if job.state in ("done", "failed", "cancelled") \
        else service.pending(job_id, caller)
    return JobAnswer(id=job.id, state=job.state, answer=job.answer, error=job.error,
                     approvals=pending)


def build_server(service: Service, trusted: Caller | None = None) -> MCPServer[Any]:
    """An MCP server whose tools act on ``service``'s jobs and approvals: as the caller
    :class:`McpEndpoint` found for the request, else as ``trusted`` (stdio); with neither,
    every tool call is refused."""
    server: MCPServer[Any] = MCPServer("swarm", instructions=INSTRUCTIONS, version=__version__,
                                       log_level="WARNING")

    def who(ctx: Context[Any, Any]) -> Caller:
        scope = getattr(ctx.request_context.request, "scope", None)
        found = scope.get(CALLER) if isinstance(scope, MutableMapping) else None
        if isinstance(found, Caller):
            return found
        if trusted is not None and scope is None:
            return trusted
        raise ToolError(UNAUTHORIZED)

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False,
                                             open_world_hint=True))
    async def submit_job(
        task: Annotated[str, Field(description=f"what the swarm should do (at most {MAX_TASK} "
                                               "characters, and well within the model's "
                                               "context: put large material in a file in the "
                                               "workspace and say where)")],
        ctx: Context[Any, Any],
        approve: Annotated[Literal["all", "ask"], Field(
            description="all: approve every tool call of the job; ask: the swarm's approval "
                        "policies apply and their requests wait in list_approvals")] = "ask",
        workspace: Annotated[str | None, Field(
            description="a folder inside the server's jobs root to work in; default: the "
                        "server's (a fresh folder, or the one `swarm mcp --workspace` names)")
        ] = None,
        limits: Annotated[Limits | None, Field(
            description="limits of this job; each may only tighten the server's own")] = None,
        wait_seconds: WaitArg = 0,
    ) -> JobAnswer:
        """Hand a task to the swarm: a root agent on the workers, which may split it across
        children. Returns the job's id and state (queued), or with wait_seconds where it
        stands after waiting: its answer once settled."""
        try:
            body = JobRequest.model_validate({
                "task": task, "approve": approve, "workspace": workspace,
                "limits": limits.model_dump(exclude_none=True) if limits else None})
        except ValidationError as exc:  # the input is not echoed back
            raise ToolError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                      for e in exc.errors())) from None
        caller = who(ctx)
        job_id: str = await call(service.submit, body, "mcp", caller)
        if not wait_seconds:
            return JobAnswer(id=job_id, state="queued")
        return await wait_for(service, job_id, wait_seconds, ctx, caller)

    @server.tool(annotations=READ_ONLY)
    async def job_answer(job_id: JobIdArg, ctx: Context[Any, Any],
                         wait_seconds: WaitArg = 0) -> JobAnswer:
        """A job's state and, once settled, its answer (or error), with the approvals that
        wait for an answer; wait_seconds waits for it to settle first."""
        caller = who(ctx)
        if not wait_seconds:
            answer: JobAnswer = await call(answer_of, service, job_id, caller)
            return answer
        await call(service.job, job_id, caller)  # unknown: an error at once
        return await wait_for(service, job_id, wait_seconds, ctx, caller)

    @server.tool(annotations=READ_ONLY)
    async def job_status(job_id: JobIdArg, ctx: Context[Any, Any]) -> JobStatus:
        """A job's tree of agents (state, depth, label each), token usage, answer or error."""
        job: Job = await call(service.job, job_id, who(ctx))
        return JobStatus(**job.model_dump(), tree=draw(job))

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True,
                                             idempotent_hint=True, open_world_hint=False))
    async def cancel_job(job_id: JobIdArg, ctx: Context[Any, Any]) -> CancelResult:
        """Cancel a job and every agent under it; they stop within seconds."""
        result: CancelResult = await call(service.cancel, job_id, "cancelled over MCP",
                                          who(ctx))
        return result

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False,
                                             open_world_hint=False))
    async def say_to_agent(
        job_id: JobIdArg,
        agent_id: Annotated[str, Field(pattern=ID_PATTERN,
                                       description="the agent's id (job_status; the job's "
                                                   "id for its root)")],
        text: Annotated[str, Field(description=f"what to tell it (at most {MAX_TASK} "
                                               "characters)")],
        ctx: Context[Any, Any],
    ) -> MessageSent:
        """Tell a running agent of a job something (a correction, a hint): it reads it at
        its next turn boundary, as a message from a person. A settled agent refuses it."""
        if not text.strip() or len(text) > MAX_TASK:
            raise ToolError(f"text must be 1 to {MAX_TASK} characters, not blank")
        sent: MessageSent = await call(service.say, job_id, agent_id, text, "mcp", who(ctx))
        return sent

    @server.tool(annotations=READ_ONLY)
    async def list_approvals(ctx: Context[Any, Any], job_id: Annotated[str | None, Field(
            pattern=ID_PATTERN, description="only this job's; default: every job's")] = None
                             ) -> list[Approval]:
        """Tool calls of the swarm's agents that wait for an answer, oldest first."""
        pending: list[Approval] = await call(service.pending, job_id, who(ctx))
        return pending

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True,
                                             open_world_hint=False))
    async def answer_approval(
        approval_id: Annotated[str, Field(pattern=ID_PATTERN,
                                          description="the approval's id (list_approvals)")],
        decision: Annotated[Decision, Field(
            description="approve or deny this call; always: approve it and the same tool "
                        "for the rest of the job")],
        ctx: Context[Any, Any],
        job_id: Annotated[str | None, Field(pattern=ID_PATTERN,
                                            description="its job (optional)")] = None,
    ) -> ApprovalDone:
        """Answer a tool call that waits for approval."""
        done: ApprovalDone = await call(service.answer, approval_id, decision, job_id,
                                        who(ctx))
        return done

    return server


def stdio_runner(service: Service) -> Callable[[], None]:
    """Build the tools' server now and return what serves them on stdin/stdout until the
    client closes them. (Building takes pydantic's schemas: an interrupt raised in there
    comes out as a ``SchemaError``, so it is done before a stop is expected.)"""
    server = build_server(service, trusted=LOCAL)
    return lambda: anyio.run(server.run_stdio_async)


class McpEndpoint:
    """``/mcp`` of ``swarm serve``: the tools over Streamable HTTP, for bearer tokens only.

    Stateless (each request stands alone, so it works behind a load balancer across
    replicas); a call's progress notifications stream back on its own response.
    :meth:`running` is the app's lifespan: the SDK's session manager runs once per start.
    """

    def __init__(self, service: Service, auth: Authenticator) -> None:
        self.service = service
        self.auth = auth
        self.app: ASGIApp | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        server = build_server(self.service)
        # Host and Origin checks guard tokenless local servers against DNS rebinding;
        # here every request needs a token, and the service runs under any host name.
        self.app = server.streamable_http_app(
            streamable_http_path="/mcp", stateless_http=True,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        try:
            async with server.session_manager.run():
                yield
        finally:
            self.app = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            caller = await call(self._caller, scope)
        except (redis.RedisError, StoreError):
            await _reply(send, 503, "the swarm's Redis is unavailable; try again later")
            return
        if caller is None:
            await _reply(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
        elif self.app is None:
            await _reply(send, 503, "the MCP server is not running (the app's lifespan did "
                                    "not start)")
        else:
            await self.app({**scope, CALLER: caller}, receive, send)

    def _caller(self, scope: Scope) -> Caller | None:
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return self.auth.check(token.strip()) if scheme.lower() == "bearer" else None


async def _reply(send: Send, status: int, detail: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A refusal as a JSON-RPC error, so MCP clients show ``detail`` (not just a status)."""
    body = json.dumps({"jsonrpc": "2.0", "id": None,
                       "error": {"code": REFUSED, "message": detail}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
