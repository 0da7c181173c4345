"""MCP server configurations: the three files, ``${VAR}`` expansion, what is skipped and
why, tool names, and approval policies for MCP tools (globs, annotations)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.agent.approval import ApprovalGate
from swarm.config import Settings
from swarm.domain.approval import Answer, ApprovalRequest
from swarm.errors import ConfigError
from swarm.mcp_client.config import McpConfig, ServerSpec, load
from swarm.mcp_client.tools import tool_name


def write(path: Path, servers: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"mcpServers": servers}))


def test_three_files_merge_later_ones_replace_by_name(tmp_path: Path) -> None:
    home, ws = tmp_path / "home", tmp_path / "ws"
    write(home / "mcp.json", {"mine": {"command": "user-server"},
                              "shared": {"command": "from-home"}})
    write(ws / ".mcp.json", {"shared": {"command": "from-project", "args": ["-x"]},
                             "docs": {"type": "http", "url": "https://d.example/mcp",
                                      "headers": {"Authorization": "Bearer ${DOCS_TOKEN}"}}})
    write(ws / ".swarm" / "mcp.json", {"docs": {"url": "https://local.example/mcp"}})
    config = load(ws, home)
    assert config.problems == () and config.cwd == ws
    by_name = {s.name: s for s in config.servers}
    assert set(by_name) == {"mine", "shared", "docs"}
    assert by_name["shared"] == ServerSpec("shared", "stdio", command="from-project",
                                           args=("-x",))
    assert by_name["docs"].transport == "http"
    assert by_name["docs"].url == "https://local.example/mcp"
    assert by_name["docs"].headers == ()


def test_references_travel_unexpanded_and_expand_at_start(tmp_path: Path) -> None:
    write(tmp_path / ".mcp.json", {
        "gh": {"command": "${BIN:-npx}", "args": ["--token=${TOKEN}"],
               "env": {"GITHUB_TOKEN": "${TOKEN}", "EMPTY": "${UNSET:-}"}}})
    config = load(tmp_path, tmp_path / "nohome")
    recorded = json.dumps(config.to_json())
    assert "${TOKEN}" in recorded and "s3cret" not in recorded
    again = McpConfig.from_json(json.loads(recorded))
    assert again.servers == config.servers and again.cwd is None
    (spec,) = again.servers
    expanded = spec.expand({"TOKEN": "s3cret"})
    assert expanded.command == "npx"
    assert expanded.args == ("--token=s3cret",)
    assert dict(expanded.env) == {"GITHUB_TOKEN": "s3cret", "EMPTY": ""}
    with pytest.raises(ConfigError, match=r"\$\{TOKEN\} is not set.*set TOKEN"):
        spec.expand({})


def test_entries_that_cannot_work_are_skipped_with_the_reason(tmp_path: Path) -> None:
    write(tmp_path / ".mcp.json", {
        "ok": {"command": "server"},
        "old": {"type": "sse", "url": "https://x.example/sse"},
        "nocommand": {"args": ["a"]},
        "badargs": {"command": "x", "args": "a b"},
        "noturl": {"type": "http"},
        "weird": {"type": "websocket", "url": "ws://x"},
    })
    (tmp_path / ".swarm").mkdir()
    (tmp_path / ".swarm" / "mcp.json").write_text("{not json")
    config = load(tmp_path, tmp_path / "nohome")
    assert [s.name for s in config.servers] == ["ok"]
    text = "\n".join(config.problems)
    assert "old skipped: the old SSE transport is not supported" in text
    assert "nocommand skipped: it needs a \"command\"" in text
    assert "badargs skipped: \"args\" must be a list of strings" in text
    assert "noturl skipped: \"type\": \"http\" needs a \"url\"" in text
    assert "weird skipped: unknown type 'websocket'" in text
    assert ".swarm/mcp.json skipped: it is not readable JSON" in text
    assert McpConfig.from_json({"servers": {}}).problems[0].startswith(
        "the swarm's record skipped: it has no \"mcpServers\" object")


def test_a_field_of_the_wrong_type_is_named_with_the_type_it_must_be(tmp_path: Path) -> None:
    write(tmp_path / ".mcp.json", {
        "numurl": {"url": 5},
        "httpnum": {"type": "http", "url": ["https://x.example/mcp"]},
        "numtype": {"type": 1, "command": "x"},
        "listcommand": {"command": ["npx", "-y", "server"]},
        "argsstr": {"command": "x", "args": "a b"},
        "argsnum": {"command": "x", "args": ["a", 2]},
        "envlist": {"command": "x", "env": ["A=1"]},
        "envnum": {"command": "x", "env": {"PORT": 8080}},
        "headersbool": {"type": "http", "url": "https://x.example/mcp",
                        "headers": {"X-Debug": True}},
        "entry": "npx server",
    })
    config = load(tmp_path, None)
    assert not config.servers
    text = "\n".join(config.problems)
    assert 'numurl skipped: "url" must be a string, the server\'s Streamable HTTP endpoint ' \
        '(e.g. "https://example.com/mcp"), not a number' in text
    assert 'httpnum skipped: "url" must be a string' in text and "not a list" in text
    assert 'numtype skipped: "type" must be a string, "stdio" (a command) or "http" (a URL), ' \
        "not a number" in text
    assert 'listcommand skipped: "command" must be a string, the program to run, not a list ' \
        '(its arguments go in "args")' in text
    assert 'argsstr skipped: "args" must be a list of strings, not a string' in text
    assert 'argsnum skipped: "args" must be a list of strings; item 2 is a number' in text
    assert 'envlist skipped: "env" must be an object mapping names to strings, not a list' \
        in text
    assert 'envnum skipped: "env" must map names to strings; "PORT" is a number' in text
    assert 'headersbool skipped: "headers" must map names to strings; "X-Debug" is a boolean' \
        in text
    assert "entry skipped: its entry must be an object, not a string" in text
    assert "needs a" not in text


def test_an_http_url_must_be_http_once_expanded() -> None:
    spec = ServerSpec("api", "http", url="${API_URL}")
    assert spec.expand({"API_URL": "https://api.example/mcp"}).url == "https://api.example/mcp"
    with pytest.raises(ConfigError, match="not an http"):
        spec.expand({"API_URL": "ftp://api.example"})


def test_tool_names_fit_what_endpoints_accept() -> None:
    assert tool_name("github", "create_issue") == "mcp__github__create_issue"
    assert tool_name("my.server", "get/thing v2") == "mcp__my_server__get_thing_v2"
    long_a = tool_name("s", "x" * 80 + "a")
    long_b = tool_name("s", "x" * 80 + "b")
    assert len(long_a) == len(long_b) == 64 and long_a != long_b


def test_policies_match_mcp_tools_by_glob() -> None:
    settings = Settings.from_env({"SWARM_APPROVAL": "mcp__github__*=always,mcp__*=review,"
                                                    "mcp__github__get_me=never,*=once"})
    assert settings.policy_for("mcp__github__create_issue") == "always"
    assert settings.policy_for("mcp__github__get_me") == "never"
    assert settings.policy_for("mcp__notes__add_note") == "review"
    assert settings.policy_for("run_cli") == "review"
    assert settings.policy_for("my_tool") == "once"
    assert Settings.from_env({}).policy_for("mcp__x__y") == "once"


class Asked:
    def __init__(self) -> None:
        self.requests: list[ApprovalRequest] = []

    def __call__(self, request: ApprovalRequest, /) -> Answer:
        self.requests.append(request)
        return Answer("deny")


def test_review_uses_the_servers_annotations_not_the_llm_reviewer() -> None:
    asked, reviewed = Asked(), []
    gate = ApprovalGate(lambda tool: "review", asked,
                        reviewer=lambda summary: bool(reviewed.append(summary)) or True)
    read = gate.check(ApprovalRequest("mcp__n__count", {}, "count()", read_only=True))
    assert read.allowed and read.reason == "its server marks it read-only"
    gone = gate.check(ApprovalRequest("mcp__n__delete", {}, "delete()", read_only=False,
                                      destructive=True))
    added = gate.check(ApprovalRequest("mcp__n__add", {}, "add()", read_only=False))
    assert not gone.allowed and not added.allowed
    assert [r.reason for r in asked.requests] == ["its server marks it destructive",
                                                  "its server does not mark it read-only"]
    assert reviewed == []  # the shell reviewer is for commands, not MCP tools
    assert gate.check(ApprovalRequest("run_cli", {}, "ls")).allowed
    assert reviewed == ["ls"]


def test_processes_without_mcp_servers_do_not_load_the_sdk() -> None:
    """The SDK takes seconds to import: the CLI, workers and the API load it only for an
    agent that has servers."""
    code = ("import sys, swarm.cli, swarm.workers.tasks, swarm.serve.app, swarm.runtime.build; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'mcp_types')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("var", ["SWARM_API_KEY", "OPENAI_API_KEY", "EVA_API_KEY",
                                 "SWARM_REDIS_URL", "SWARM_SERVE_TOKEN"])
def test_no_server_is_given_the_swarms_own_credentials(var: str) -> None:
    environ = {var: "the-secret", "MINE": "fine"}
    for spec in (ServerSpec("gh", "stdio", command="npx", env=(("TOKEN", f"${{{var}}}"),)),
                 ServerSpec("gh", "stdio", command="npx", args=(f"--key=${{{var}}}",)),
                 ServerSpec("docs", "http", url="https://d.example/mcp",
                            headers=(("Authorization", f"Bearer ${{{var}:-x}}"),))):
        with pytest.raises(ConfigError) as refused:
            spec.expand(environ)
        assert "the swarm's own credentials" in str(refused.value)
        assert "the-secret" not in str(refused.value)
    mine = ServerSpec("gh", "stdio", command="npx", env=(("TOKEN", "${MINE}"),))
    assert mine.expand(environ).env == (("TOKEN", "fine"),)
