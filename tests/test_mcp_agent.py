"""MCP tools in the agent loop, over real HTTP to the scripted model and real stdio pipes to
the notes server: the root agent calls them, approvals apply per tool with the server's
hints, a server that dies mid-call is an error result, and children on a real worker use
their parent's servers (started there, with the worker's own secrets, one for all)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result

from swarm.agent.approval import approve_all
from swarm.agent.loop import Observer
from swarm.cli import main
from swarm.config import Settings, parse_policies
from swarm.domain.approval import Answer, ApprovalRequest
from swarm.mcp_client import pool as pool_module
from swarm.mcp_client.config import load
from swarm.runtime.build import build_agent, new_session
from swarm.store.approvals import ApprovalQueue
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, task_of, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import MemoryHints, client_for, wait_until

NOTES = str(Path(__file__).with_name("mcp_notes_server.py"))
TOKEN = "notes-token-planted-5d1e"


@pytest.fixture(autouse=True)
def stop_servers() -> Iterator[None]:
    yield
    pool_module.shutdown()


def notes_folder(path: Path, **env: str) -> Path:
    (path / "pids").mkdir(parents=True, exist_ok=True)
    (path / ".mcp.json").write_text(json.dumps({"mcpServers": {"notes": {
        "command": sys.executable, "args": [NOTES],
        "env": {"NOTES_PIDS": str(path / "pids"), **env}}}}))
    return path


class Notices(Observer):
    def __init__(self) -> None:
        self.notices: list[str] = []

    def on_notice(self, text: str) -> None:
        self.notices.append(text)


class Recorder:
    """An approver that answers from a list and remembers what it was asked."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.asked: list[ApprovalRequest] = []

    def __call__(self, request: ApprovalRequest, /) -> Answer:
        self.asked.append(request)
        return Answer(self.answers.pop(0))  # type: ignore[arg-type]


def root_agent(server: ScriptedModelServer, workspace: Path, approval: str = "",
               approver: Any = approve_all, observer: Observer | None = None) -> Any:
    settings = Settings(base_url=server.base_url, model=server.models[0],
                        approval=parse_policies(approval), home=workspace / "home")
    return build_agent(settings, workspace, client_for(server), new_session(workspace),
                       store=None, hints=MemoryHints(), approver=approver, observer=observer,
                       mcp=load(workspace, settings.home))


def results(request: dict[str, Any]) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


def test_the_root_agent_sees_mcp_tools_and_calls_them(model_server: ScriptedModelServer,
                                                      tmp_path: Path) -> None:
    ws = notes_folder(tmp_path)
    (ws / ".swarm").mkdir()
    (ws / ".swarm" / "mcp.json").write_text(json.dumps({"mcpServers": {
        "gone": {"command": str(tmp_path / "missing-binary")}}}))
    model_server.script(
        Reply(tool_calls=[ToolCall("mcp__notes__add_note", {"text": "hello"}),
                          ToolCall("mcp__notes__count_notes", {})]),
        Reply(tool_calls=[ToolCall("mcp__notes__list_notes", {})]),
        Reply(content="noted"))
    observer = Notices()
    agent = root_agent(model_server, ws, observer=observer)
    assert agent.run("take a note") == "noted"
    offered = {t["function"]["name"]: t["function"] for t in model_server.requests[0]["tools"]}
    assert offered["mcp__notes__add_note"]["parameters"]["properties"]["text"]["type"] \
        == "string"
    assert not any(name.startswith("mcp__gone__") for name in offered)
    assert results(model_server.requests[1]) == ["added note 1: hello", "1 notes"]
    assert json.loads(results(model_server.requests[2])[-1]) == {"notes": ["hello"]}
    # Three model calls, one notice: the server that did not start is reported once.
    (notice,) = observer.notices
    assert "MCP server gone" in notice and "was not found" in notice


def test_swarm_run_reports_a_server_whose_command_is_missing_once(
        model_server: ScriptedModelServer, redis_server: str, tmp_path: Path) -> None:
    """The missing command was told twice on stderr: the pool's warning and the notice."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / ".mcp.json").write_text(json.dumps({"mcpServers": {
        "ghost": {"command": str(tmp_path / "no-such-server")}}}))
    model_server.script(Reply(content="done"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model_server.base_url, SWARM_MODEL=model_server.models[0],
               SWARM_REDIS_URL=redis_server, SWARM_HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-m", "swarm", "run", "--yes", "-C", str(ws), "hi"],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    told = [line for line in done.stderr.splitlines() if "ghost" in line]
    assert len(told) == 1 and "was not found" in told[0], done.stderr


def test_approvals_apply_per_mcp_tool_with_the_servers_hints(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    ws = notes_folder(tmp_path)
    calls = [ToolCall("mcp__notes__count_notes", {}),
             ToolCall("mcp__notes__add_note", {"text": "x"}),
             ToolCall("mcp__notes__delete_notes", {})]
    model_server.script(Reply(tool_calls=calls), Reply(content="reviewed"))
    ask = Recorder("approve", "deny")
    agent = root_agent(model_server, ws, "mcp__notes__*=review", ask)
    assert agent.run("notes") == "reviewed"
    count, add, delete = results(model_server.requests[1])
    assert count == "0 notes"  # read-only: the review policy lets it run unasked
    assert add == "added note 1: x"
    assert delete.startswith("denied: this call was not allowed")
    assert [(r.tool, r.reason) for r in ask.asked] == [
        ("mcp__notes__add_note", "its server does not mark it read-only"),
        ("mcp__notes__delete_notes", "its server marks it destructive")]

    model_server.script(Reply(tool_calls=calls[:2]), Reply(content="again"))
    ask = Recorder("deny")
    agent = root_agent(model_server, ws,
                       "mcp__notes__count_notes=always,mcp__notes__*=never", ask)
    assert agent.run("notes again") == "again"
    count, add = results(model_server.requests[-1])
    assert count.startswith("denied") and add == "added note 2: x"
    assert [r.tool for r in ask.asked] == ["mcp__notes__count_notes"]


def test_a_server_that_dies_mid_call_is_an_error_result_and_the_loop_goes_on(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    ws = notes_folder(tmp_path)
    model_server.script(
        Reply(tool_calls=[ToolCall("mcp__notes__add_note", {"text": "lost"})]),
        Reply(tool_calls=[ToolCall("mcp__notes__crash", {})]),
        Reply(tool_calls=[ToolCall("mcp__notes__count_notes", {})]),
        Reply(content="recovered"))
    agent = root_agent(model_server, ws)
    assert agent.run("crash it") == "recovered"
    (crashed,) = results(model_server.requests[2])[-1:]
    assert crashed.startswith("error: MCP server notes went away during the call")
    assert results(model_server.requests[3])[-1] == "0 notes"
    assert len(list((ws / "pids").iterdir())) == 2


# -- children on a real worker ----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("mcp-home")
    # The secret is in the worker's environment only, as in a deployment. Unconfined: the
    # notes server needs this python's MCP SDK, which a box need not see (it may lie under
    # the worker's home), and it writes its pid where the tests look; a worker's box for
    # its servers is tests/test_mcp_box.py's.
    with local_swarm(home, env={"MCP_NOTES_TOKEN": TOKEN, "SWARM_SANDBOX": "none"}) as url:
        yield url, home


@pytest.fixture(scope="module")
def model(cluster: tuple[str, Path]) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


def swarm_run(cluster: tuple[str, Path], model: ScriptedModelServer, workspace: Path,
              task: str, *flags: str, **env: str) -> Result:
    url, home = cluster
    base: dict[str, str | None] = {k: "" for k in os.environ
                                   if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
                SWARM_API_KEY="k", SWARM_RETRIES="1", MCP_NOTES_TOKEN=None)
    base.update(env)
    return CliRunner().invoke(main, ["run", *flags, "--workers", "0", "-C", str(workspace),
                                     task], env=base, catch_exceptions=False)


def children(n: int, word: str) -> Reply:
    return Reply(tool_calls=[ToolCall("agent", {"message": f"{word} {i}"}, id=f"c{i}")
                             for i in range(n)])


def relay(request: dict[str, Any]) -> Reply:
    return Reply(content=" | ".join(json.loads(r).get("answer", json.loads(r).get("error", "?"))
                                    for r in tool_results(request)))


def redis_text(url: str) -> str:
    """Every value in Redis as text (binary ones, such as workspace snapshots, with their
    undecodable bytes replaced): what a secret must not be found in."""
    dump = []
    with redis_lib.Redis.from_url(url) as client:  # raw bytes: not every value is text
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            if kind == b"string":
                values: Any = [client.get(key)]
            elif kind == b"hash":
                values = [x for kv in client.hgetall(key).items() for x in kv]
            elif kind == b"list":
                values = client.lrange(key, 0, -1)
            elif kind == b"set":
                values = list(client.smembers(key))
            elif kind == b"zset":
                values = client.zrange(key, 0, -1)
            elif kind == b"stream":
                values = [x for _, fields in client.xrange(key) for kv in fields.items()
                          for x in kv]
            else:
                values = []
            dump.extend(v.decode("utf-8", "replace") for v in values if v is not None)
    return "\n".join(dump)


@pytest.mark.slow
def test_children_on_a_worker_use_the_parents_servers_with_the_workers_secrets(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    ws = notes_folder(tmp_path, NOTES_TOKEN="${MCP_NOTES_TOKEN}")
    model.responder = ByTask({
        "MCPROOT": [children(3, "MCPKID"), relay],
        "MCPKID": [Reply(tool_calls=[ToolCall("mcp__notes__token_digest", {})]),
                   lambda r: Reply(content=tool_results(r)[0])],
    })
    result = swarm_run(cluster, model, ws, "MCPROOT use the notes", "--yes")
    assert result.exit_code == 0, result.stderr
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()[:16]
    assert result.stdout.strip() == " | ".join([digest] * 3)
    # The root's process has no MCP_NOTES_TOKEN: its own server was skipped, and said why.
    assert "${MCP_NOTES_TOKEN} is not set" in result.stderr
    root = next(r for r in model.requests if task_of(r) == "MCPROOT use the notes")
    assert not any(t["function"]["name"].startswith("mcp__") for t in root["tools"])
    # One server on the worker for its three children.
    assert len(list((ws / "pids").iterdir())) == 1
    text = redis_text(cluster[0])
    assert "${MCP_NOTES_TOKEN}" in text and "mcp_notes_server.py" in text
    assert TOKEN not in text


@pytest.mark.slow
def test_a_childs_mcp_call_waits_for_a_person_by_its_policy(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    ws = notes_folder(tmp_path)
    model.responder = ByTask({
        "ASKROOT": [children(1, "ASKKID"), relay],
        "ASKKID": [Reply(tool_calls=[ToolCall("mcp__notes__count_notes", {}),
                                     ToolCall("mcp__notes__delete_notes", {})]),
                   lambda r: Reply(content=" / ".join(tool_results(r)))],
    })
    client = connect(cluster[0])
    ledger = Ledger(client)
    before = ledger.latest_swarm()
    out: list[Result] = []
    thread = threading.Thread(target=lambda: out.append(swarm_run(
        cluster, model, ws, "ASKROOT review the notes",
        SWARM_APPROVAL="mcp__notes__*=review", SWARM_APPROVAL_TIMEOUT="60")))
    thread.start()

    def asked() -> list[Any]:
        swarm_id = ledger.latest_swarm()
        if swarm_id in (None, before):
            return []
        return [(swarm_id, p) for p in ApprovalQueue(client, swarm_id).pending()]

    ((swarm_id, pending),) = wait_until(asked, "the child's approval request")
    assert pending.tool == "mcp__notes__delete_notes"
    assert pending.reason == "its server marks it destructive"
    assert ApprovalQueue(client, swarm_id).answer(pending.id, "deny")
    thread.join(timeout=60)
    (result,) = out
    assert result.exit_code == 0, result.stderr
    count, delete = result.stdout.strip().split(" / ")
    assert count == "0 notes"  # read-only: not asked
    assert delete.startswith("denied: this call was not allowed")


@pytest.mark.slow
def test_a_jobs_root_gets_its_folders_servers_and_its_children_inherit_them(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    from swarm.broker.app import configure
    from swarm.runtime.jobs import job_state, submit_job

    ws = notes_folder(tmp_path)
    model.responder = ByTask({
        "JOBMCP": [Reply(tool_calls=[ToolCall("mcp__notes__add_note", {"text": "by the root"})]),
                   children(1, "NOTEKID"), relay],
        "NOTEKID": [Reply(tool_calls=[ToolCall("mcp__notes__list_notes", {})]),
                      lambda r: Reply(content=tool_results(r)[0])],
    })
    ledger = Ledger(connect(cluster[0]))
    settings = {"base_url": model.base_url, "model": model.models[0], "yes": True}
    swarm_id = submit_job(ledger, configure(cluster[0]), "JOBMCP take notes", ws, settings)

    def settled() -> dict[str, Any]:
        job = job_state(ledger, swarm_id)
        return job if job["state"] not in ("queued", "running") else {}

    job = wait_until(settled, "the job to settle")
    assert job["state"] == "done", job
    # The child's server is the root's (one process on the worker): it has the root's note.
    assert json.loads(job["answer"]) == {"notes": ["by the root"]}
    assert len(list((ws / "pids").iterdir())) == 1
    assert "mcp_notes_server.py" in json.dumps(ledger.swarm_mcp(swarm_id))
