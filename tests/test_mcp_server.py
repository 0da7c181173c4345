"""The swarm as an MCP server, driven by the MCP SDK's own client: ``swarm mcp`` as a real
process over stdio (on its own SWARM_HOME: the embedded server, a local coordinator and a
worker start with it and stop with it), and ``/mcp`` of ``swarm serve``'s app over real
HTTP, with and without the bearer token. Each goes through a whole job with an approval
(submit, progress, the pending approval listed and answered, the answer collected) and
cancels a running one; the model is the scripted one over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import httpx2  # the MCP SDK's HTTP client
import pytest
import redis as redis_lib
import uvicorn
from celery import Celery
from click.testing import CliRunner
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult

from swarm.broker.app import QUEUE
from swarm.cli import main
from swarm.config import Settings
from swarm.serve.app import create_app
from swarm.serve.auth import Authenticator, TokenStore
from swarm.serve.service import Service
from swarm.store import keys
from swarm.store.approvals import ApprovalQueue
from swarm.store.connection import connect
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until
from tests.test_serve import ask_in_thread
from tests.test_serve_process import processes_of

with warnings.catch_warnings():  # Starlette's TestClient warns about httpx on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from fastapi.testclient import TestClient

TOKEN = "mcp-test-token-7c1d"
SCRIPTS = {
    "MCPASK": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo approved-run"})]),
               lambda r: Reply(content="saw: " + tool_results(r)[0].split("\n")[0])],
    "MCPSLOW": [Reply(tool_calls=[ToolCall("run_cli", {"command": "sleep 30"})]),
                Reply(content="should not get here")],
}

Session = Callable[[], AbstractAsyncContextManager[ClientSession]]


@pytest.fixture(scope="module")
def model() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        server.responder = ByTask(SCRIPTS)
        yield server


def structured(result: CallToolResult) -> Any:
    assert not result.is_error, result.content
    return result.structured_content


def error_text(result: CallToolResult) -> str:
    assert result.is_error, result.structured_content
    return " ".join(getattr(c, "text", "") for c in result.content)


# -- the scenarios, the same over both transports -----------------------------------------


async def whole_job_with_an_approval(session: ClientSession) -> None:
    """Submit and wait: progress comes until the approval waits; it is listed, answered
    (a second answer refused), and waiting again collects the answer."""
    seen: list[tuple[float, str]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, message or ""))

    tools = {t.name: t for t in (await session.list_tools()).tools}
    assert set(tools) == {"submit_job", "job_answer", "job_status", "cancel_job",
                          "list_approvals", "answer_approval", "say_to_agent"}
    assert tools["job_status"].annotations and tools["job_status"].annotations.read_only_hint

    started = time.monotonic()
    waited = structured(await session.call_tool(
        "submit_job", {"task": "MCPASK check it", "approve": "ask", "wait_seconds": 60},
        progress_callback=on_progress))
    job = waited["id"]
    assert waited["state"] == "running", waited
    assert time.monotonic() - started < 30  # the wait ended when the approval came
    (approval,) = waited["approvals"]
    assert approval["job"] == job and approval["tool"] == "run_cli"
    assert "echo approved-run" in approval["summary"]
    values = [v for v, _ in seen]
    assert len(values) >= 2 and values == sorted(set(values)), seen
    assert "queued" in seen[0][1]
    assert approval["id"] in seen[-1][1], seen  # the last one names what to answer

    listed = structured(await session.call_tool("list_approvals", {"job_id": job}))
    assert [a["id"] for a in listed["result"]] == [approval["id"]]
    everywhere = structured(await session.call_tool("list_approvals", {}))
    assert approval["id"] in [a["id"] for a in everywhere["result"]]

    answered = structured(await session.call_tool(
        "answer_approval", {"approval_id": approval["id"], "decision": "approve"}))
    assert answered == {"id": approval["id"], "job": job, "decision": "approve"}
    twice = await session.call_tool("answer_approval",
                                    {"approval_id": approval["id"], "decision": "deny"})
    assert "answered already" in error_text(twice)

    seen.clear()
    final = structured(await session.call_tool(
        "job_answer", {"job_id": job, "wait_seconds": 60}, progress_callback=on_progress))
    assert final["state"] == "done" and final["answer"] == "saw: approved-run", final
    assert final["approvals"] == []
    assert any("done" in m for _, m in seen), seen

    status = structured(await session.call_tool("job_status", {"job_id": job}))
    assert status["state"] == "done" and status["agents"][0]["id"] == job
    assert status["tree"].splitlines()[0] == f"job {job}: done"
    assert status["usage"]["total_tokens"] > 0
    unknown = await session.call_tool("job_status", {"job_id": "snope"})
    assert "no job 'snope'" in error_text(unknown)
    late = await session.call_tool("say_to_agent", {"job_id": job, "agent_id": job,
                                                    "text": "too late"})
    assert f"agent {job} has settled (done)" in error_text(late)


async def cancel_a_running_job(session: ClientSession) -> None:
    """While one call waits on the job, another cancels it; the wait ends cancelled."""
    job = structured(await session.call_tool(
        "submit_job", {"task": "MCPSLOW", "approve": "all"}))["id"]
    sleeping = anyio.Event()
    got: dict[str, Any] = {}

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        if "sleep 30" in (message or ""):
            sleeping.set()

    async def wait() -> None:
        got["final"] = structured(await session.call_tool(
            "job_answer", {"job_id": job, "wait_seconds": 60}, progress_callback=on_progress))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        with anyio.fail_after(30):
            await sleeping.wait()
        told = structured(await session.call_tool(
            "say_to_agent", {"job_id": job, "agent_id": job, "text": "stop soon"}))
        assert told["job"] == job and told["agent"] == job and told["id"]
        started = time.monotonic()
        cancelled = structured(await session.call_tool("cancel_job", {"job_id": job}))
        assert cancelled["flagged"] == [job]
    assert got["final"]["state"] == "cancelled", got
    assert time.monotonic() - started < 15
    again = structured(await session.call_tool("cancel_job", {"job_id": job}))
    assert again["flagged"] == []


def run(session: Session, *scenarios: Callable[[ClientSession], Awaitable[None]]) -> None:
    async def main() -> None:
        async with session() as client:
            await client.initialize()
            for scenario in scenarios:
                await scenario(client)

    anyio.run(main)


# -- swarm mcp over stdio -----------------------------------------------------------------


def test_swarm_mcp_help_says_how_to_register_it() -> None:
    result = CliRunner().invoke(main, ["mcp", "-h"])
    assert result.exit_code == 0
    assert "claude mcp add swarm" in result.stdout and "[mcp_servers.swarm]" in result.stdout


def test_swarm_mcp_errors_are_messages(tmp_path: Path) -> None:
    env = {"SWARM_HOME": str(tmp_path), "SWARM_REDIS_URL": "redis://127.0.0.1:1/0"}
    unreachable = CliRunner().invoke(main, ["mcp"], env=env)
    assert unreachable.exit_code == 1, unreachable.output
    assert "cannot reach Redis" in unreachable.output
    assert "Traceback" not in unreachable.output
    missing = CliRunner().invoke(main, ["mcp", "--workspace", str(tmp_path / "nope")], env=env)
    assert missing.exit_code == 2 and "does not exist" in missing.output


@pytest.mark.slow
def test_swarm_mcp_over_stdio_runs_a_job_with_an_approval_and_cancels_one(
        tmp_path: Path, model: ScriptedModelServer) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_HOME=str(home), SWARM_BASE_URL=model.base_url,
               SWARM_MODEL=model.models[0], SWARM_APPROVAL="run_cli=always")  # no Redis URL
    params = StdioServerParameters(command=sys.executable, args=["-m", "swarm", "mcp"],
                                   env=env, cwd=str(tmp_path))

    @asynccontextmanager
    async def session() -> AsyncIterator[ClientSession]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            yield client

    try:
        run(session, whole_job_with_an_approval, cancel_a_running_job)
        # The agent closed it: the embedded server, coordinator and worker stop too.
        wait_until(lambda: not processes_of(home), "swarm mcp's processes to stop",
                   timeout=30)
    finally:
        for pid in processes_of(home):  # a failed run must not leak into the next tests
            os.kill(pid, signal.SIGKILL)
    jobs = [path for path in (home / "jobs").iterdir() if path.is_dir()]
    assert len(jobs) == 2  # each job got a fresh folder under the default root


@pytest.mark.slow
def test_swarm_mcp_stopped_by_sigterm_leaves_no_process_behind(tmp_path: Path) -> None:
    """An agent may SIGTERM the server with its stdin still open: it stops gracefully and
    its embedded server, coordinator and worker stop with it."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env["SWARM_HOME"] = str(home)
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "mcp"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        said = b""
        while b"swarm mcp on stdio" not in (line := proc.stderr.readline()):
            said += line
            assert line, f"swarm mcp exited with code {proc.wait()}: {said.decode()}"
        started = processes_of(home)
        assert len(started) >= 4 and any("valkey" in a for a in started.values()), started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
        assert not processes_of(home)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_of(home):
            os.kill(pid, signal.SIGKILL)


# -- /mcp on swarm serve ------------------------------------------------------------------


def celery_for(url: str) -> Celery:
    app = Celery("swarm-mcp-test", set_as_current=False)
    app.conf.update(broker_url=url, result_backend=url, task_default_queue=QUEUE,
                    task_serializer="json", accept_content=["json"],
                    broker_connection_retry_on_startup=True)
    return app


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model: ScriptedModelServer
           ) -> Iterator[tuple[str, redis_lib.Redis]]:
    """``swarm serve``'s app under uvicorn (its lifespan runs the MCP session manager) on a
    local swarm; yields its URL and the swarm's Redis."""
    home = tmp_path_factory.mktemp("mcp-home")
    with local_swarm(home, concurrency=8) as url:
        client = connect(url)
        settings = Settings.from_env(env={
            "SWARM_HOME": str(home), "SWARM_BASE_URL": model.base_url,
            "SWARM_MODEL": model.models[0], "SWARM_APPROVAL": "run_cli=always"})
        app = create_app(Service(client, celery_for(url), settings, home / "jobs",
                                 Authenticator(client, TOKEN)))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                               log_level="warning", timeout_graceful_shutdown=1))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert thread.is_alive(), "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}", client
        finally:
            server.should_exit = True
            thread.join(timeout=10)


def http_session(url: str, headers: dict[str, str]) -> Session:
    @asynccontextmanager
    async def session() -> AsyncIterator[ClientSession]:
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(
                30.0, read=120.0)) as http, streamable_http_client(
                f"{url}/mcp", http_client=http) as streams, ClientSession(
                streams[0], streams[1]) as client:
            yield client

    return session


@pytest.mark.slow
def test_mcp_over_http_runs_a_job_with_an_approval_and_cancels_one(
        served: tuple[str, redis_lib.Redis]) -> None:
    url, _ = served
    run(http_session(url, {"Authorization": f"Bearer {TOKEN}"}),
        whole_job_with_an_approval, cancel_a_running_job)


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {},
    "clientInfo": {"name": "test", "version": "0"}}}
SUBMIT = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
    "name": "submit_job", "arguments": {"task": "MCPASK", "approve": "all"}}}


@pytest.mark.slow
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": "Bearer"}],
                         ids=["none", "wrong", "no scheme", "basic", "empty"])
def test_mcp_over_http_without_the_token_is_refused_and_queues_nothing(
        served: tuple[str, redis_lib.Redis], headers: dict[str, str]) -> None:
    url, client = served
    before = client.zcard(keys.swarms_index())
    for body in (INITIALIZE, SUBMIT):
        response = httpx.post(f"{url}/mcp", json=body, headers={
            **headers, "Accept": "application/json, text/event-stream"})
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in response.json()["error"]["message"]

    async def refused() -> None:
        async with http_session(url, headers)() as session:
            await session.initialize()

    with pytest.raises(BaseExceptionGroup) as caught:  # the SDK's task groups wrap it
        anyio.run(refused)
    (error,) = leaves(caught.value)
    assert isinstance(error, MCPError) and "missing or wrong token" in str(error), error
    assert client.zcard(keys.swarms_index()) == before


def tool_call(client: Any, token: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One tools/call on /mcp (stateless: no session needed), its JSON-RPC result."""
    response = client.post("/mcp", headers={
        "Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"},
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
              "params": {"name": name, "arguments": arguments}})
    assert response.status_code == 200, response.text
    (data,) = [json.loads(line[5:]) for line in response.text.splitlines()
               if line.startswith("data:")]
    return cast("dict[str, Any]", data["result"])


def test_mcp_tools_of_a_user_token_see_its_own_jobs_only(
        redis: redis_lib.Redis, redis_server: str, tmp_path: Path) -> None:
    """Over /mcp as over the HTTP API: Bob's tools find nothing of Alice's job (the same
    error as for no job), Alice's and the admin's do; the job records Alice's token id."""
    store = TokenStore(redis)
    alice, alice_info = store.create("alice")
    bob, _ = store.create("bob")
    settings = Settings.from_env(env={"SWARM_HOME": str(tmp_path)})
    app = create_app(Service(redis, celery_for(redis_server), settings, tmp_path / "jobs",
                             Authenticator(redis, TOKEN)))
    with TestClient(app) as client:
        submitted = tool_call(client, alice, "submit_job", {"task": "MCPALICE"})
        job = submitted["structuredContent"]["id"]
        assert redis.hget(keys.swarm(job), "owner") == alice_info.id
        thread, got = ask_in_thread(redis, job, timeout=30)
        wait_until(lambda: ApprovalQueue(redis, job).pending(), "Alice's approval")
        (approval,) = ApprovalQueue(redis, job).pending()

        for name, arguments in [("job_status", {"job_id": job}),
                                ("job_answer", {"job_id": job}),
                                ("job_answer", {"job_id": job, "wait_seconds": 5}),
                                ("cancel_job", {"job_id": job}),
                                ("list_approvals", {"job_id": job})]:
            refused = tool_call(client, bob, name, arguments)
            assert refused["isError"], (name, refused)
            assert refused["content"][0]["text"].endswith(f": no job {job!r}"), (name, refused)
        listed = tool_call(client, bob, "list_approvals", {})
        assert listed["structuredContent"]["result"] == []
        for arguments in ({}, {"job_id": job}):
            answer = tool_call(client, bob, "answer_approval", {
                "approval_id": approval.id, "decision": "approve", **arguments})
            assert answer["isError"] and "no approval" in answer["content"][0]["text"]
        assert not redis.exists(keys.cancel(job))

        for token in (alice, TOKEN):
            status = tool_call(client, token, "job_status", {"job_id": job})
            assert status["structuredContent"]["owner"] == alice_info.id, status
            mine = tool_call(client, token, "list_approvals", {})["structuredContent"]
            assert [a["id"] for a in mine["result"]] == [approval.id]
        done = tool_call(client, alice, "answer_approval",
                         {"approval_id": approval.id, "decision": "approve"})
        assert done["structuredContent"]["job"] == job, done
        thread.join(timeout=10)
        assert got == [("approve", "answered by a person")]
        twice = tool_call(client, bob, "answer_approval",
                          {"approval_id": approval.id, "decision": "deny"})
        assert "answered already" not in twice["content"][0]["text"]
        cancelled = tool_call(client, alice, "cancel_job", {"job_id": job})
        assert cancelled["structuredContent"]["flagged"] == [job]


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]
