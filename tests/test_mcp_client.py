"""The MCP client against real servers: the SDK-built notes server over real stdio pipes
and over Streamable HTTP, and ``mcp-server-time`` from PyPI; results, errors, a server that
dies in the middle of a call, one that does not start, and one server shared by agents."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.errors import McpServerError
from swarm.mcp_client import pool as pool_module
from swarm.mcp_client.config import McpConfig, ServerSpec, load
from swarm.mcp_client.tools import McpTools
from tests.helpers import wait_until

NOTES = str(Path(__file__).with_name("mcp_notes_server.py"))


@pytest.fixture(autouse=True)
def stop_servers() -> Iterator[None]:
    yield
    pool_module.shutdown()


def notes_folder(tmp_path: Path, env: dict[str, str] | None = None) -> Path:
    """A workspace whose ``.mcp.json`` runs the notes server; it writes its pid to pids/."""
    (tmp_path / "pids").mkdir(exist_ok=True)
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"notes": {
        "command": sys.executable, "args": [NOTES],
        "env": {"NOTES_PIDS": str(tmp_path / "pids"), **(env or {})}}}}))
    return tmp_path


def tools_for(config: McpConfig, tmp_path: Path, **kw: object) -> McpTools:
    return McpTools(config, log_dir=tmp_path / "logs", **kw)  # type: ignore[arg-type]


def pids(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "pids").iterdir())


def test_stdio_tools_schemas_hints_and_results(tmp_path: Path) -> None:
    ws = notes_folder(tmp_path)
    mcp = tools_for(load(ws, tmp_path / "home"), tmp_path)
    tools = mcp.tools()
    assert set(tools) == {f"mcp__notes__{t}" for t in (
        "count_notes", "list_notes", "add_note", "delete_notes", "token_digest", "picture",
        "wait", "fail", "crash")}
    add = tools["mcp__notes__add_note"].schema["function"]
    assert add["parameters"]["required"] == ["text"]
    assert add["description"] == "Add a note."
    assert (tools["mcp__notes__count_notes"].read_only,
            tools["mcp__notes__count_notes"].destructive) == (True, False)
    assert (tools["mcp__notes__add_note"].read_only,
            tools["mcp__notes__add_note"].destructive) == (False, False)
    assert tools["mcp__notes__delete_notes"].destructive
    assert tools["mcp__notes__crash"].destructive  # no hints: it may destroy
    assert mcp.call("mcp__notes__add_note", {"text": "first"}) == "added note 1: first"
    assert mcp.call("mcp__notes__count_notes", {}) == "1 notes"
    assert json.loads(mcp.call("mcp__notes__list_notes", {})) == {"notes": ["first"]}
    assert mcp.call("mcp__notes__picture", {}) == "[image image/png, 66 bytes: not shown]"
    with pytest.raises(McpServerError, match=r"fail failed on MCP server notes: .*"
                                             r"failed on purpose: because"):
        mcp.call("mcp__notes__fail", {"why": "because"})
    assert mcp.notices() == []


def test_results_are_capped_head_and_tail(tmp_path: Path) -> None:
    mcp = tools_for(load(notes_folder(tmp_path), tmp_path / "home"), tmp_path,
                    output_cap=200)
    mcp.call("mcp__notes__add_note", {"text": "A" * 500 + "THE-END"})
    listed = mcp.call("mcp__notes__list_notes", {})
    assert len(listed) < 260
    head, cut, tail = listed.partition(" characters cut ...]")
    assert cut and head.startswith("{") and "AAAA" in head
    assert "THE-END" in tail and tail.rstrip().endswith("}")


def test_a_cancelled_agent_abandons_its_call_and_the_server_goes_on(tmp_path: Path) -> None:
    cancel = threading.Event()
    mcp = tools_for(load(notes_folder(tmp_path), tmp_path / "home"), tmp_path, cancel=cancel)
    mcp.tools()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    began = time.monotonic()
    with pytest.raises(McpServerError, match="call to MCP server notes was abandoned: "
                                             "cancelled"):
        mcp.call("mcp__notes__wait", {"seconds": 60})
    assert time.monotonic() - began < 10
    cancel.clear()
    assert mcp.call("mcp__notes__wait", {"seconds": 0}) == "waited 0 s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http_notes(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, NOTES, "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        assert proc.poll() is None, "the HTTP notes server exited"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(listening, "the HTTP notes server to listen")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_streamable_http_server(http_notes: str, tmp_path: Path) -> None:
    config = McpConfig((ServerSpec("web", "http", url="${NOTES_URL}",
                                   headers=(("X-Trace", "${TRACE:-none}"),)),))
    mcp = tools_for(config, tmp_path, environ={"NOTES_URL": http_notes})
    assert "mcp__web__add_note" in mcp.tools()
    assert mcp.call("mcp__web__add_note", {"text": "over http"}) == "added note 1: over http"
    assert mcp.call("mcp__web__count_notes", {}) == "1 notes"
    assert mcp.notices() == []


def test_a_server_that_dies_mid_call_is_an_error_then_starts_again(tmp_path: Path) -> None:
    ws = notes_folder(tmp_path)
    mcp = tools_for(load(ws, tmp_path / "home"), tmp_path)
    mcp.call("mcp__notes__add_note", {"text": "before"})
    first = pids(ws)
    with pytest.raises(McpServerError, match=r"went away during the call .*started again at "
                                             r"the next call"):
        mcp.call("mcp__notes__crash", {})
    # The next call starts a new process (its notes are gone with the old one).
    assert mcp.call("mcp__notes__count_notes", {}) == "0 notes"
    assert len(first) == 1 and len(pids(ws)) == 2


def test_a_server_that_does_not_start_is_reported_once_and_skipped(tmp_path: Path) -> None:
    ws = notes_folder(tmp_path)
    config = load(ws, tmp_path / "home")
    broken = ServerSpec("broken", "stdio", command=str(tmp_path / "no-such-server"))
    mcp = tools_for(McpConfig((*config.servers, broken), cwd=ws), tmp_path)
    assert "mcp__notes__count_notes" in mcp.tools()
    assert not any(name.startswith("mcp__broken__") for name in mcp.tools())
    (notice,) = mcp.notices()
    assert notice.startswith("MCP server broken (") and "was not found" in notice
    assert mcp.notices() == []
    assert mcp.call("mcp__notes__count_notes", {}) == "0 notes"


def test_references_expand_from_this_processs_environment(tmp_path: Path) -> None:
    ws = notes_folder(tmp_path, env={"NOTES_TOKEN": "${MCP_TEST_TOKEN}"})
    config = load(ws, tmp_path / "home")
    with_token = tools_for(config, tmp_path, environ={"MCP_TEST_TOKEN": "tok-123"})
    assert with_token.call("mcp__notes__token_digest", {}) == \
        hashlib.sha256(b"tok-123").hexdigest()[:16]
    without = tools_for(config, tmp_path, environ={})
    assert without.tools() == {}
    (notice,) = without.notices()
    assert "${MCP_TEST_TOKEN} is not set" in notice and "its tools are not offered" in notice


def test_agents_of_one_process_share_one_server(tmp_path: Path) -> None:
    ws = notes_folder(tmp_path)
    config = load(ws, tmp_path / "home")
    first, second = tools_for(config, tmp_path), tools_for(config, tmp_path)
    first.call("mcp__notes__add_note", {"text": "from the first"})
    assert second.call("mcp__notes__count_notes", {}) == "1 notes"
    assert len(pids(ws)) == 1


@pytest.mark.skipif(importlib.util.find_spec("mcp_server_time") is None,
                    reason="mcp-server-time (PyPI) is not installed: pip install -e '.[dev]'")
def test_a_server_someone_else_wrote(tmp_path: Path) -> None:
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"time": {
        "command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone",
                                            "UTC"]}}}))
    mcp = tools_for(load(tmp_path, tmp_path / "home"), tmp_path)
    tools = mcp.tools()
    assert {"mcp__time__get_current_time", "mcp__time__convert_time"} <= set(tools)
    assert tools["mcp__time__get_current_time"].read_only
    now = json.loads(mcp.call("mcp__time__get_current_time", {"timezone": "Europe/Paris"}))
    assert now["timezone"] == "Europe/Paris" and now["datetime"][:2] == "20"
