"""Messages people read: counts agree with their nouns ("1 model call", "2 lines"), and a
model server's error is quoted without a doubled period."""

from __future__ import annotations

import ast
import io
import re
from pathlib import Path

import pytest

from swarm.agent.tools import Call
from swarm.cli.render import SHOWN_LINES, TerminalView
from swarm.config import Secret
from swarm.errors import ModelHTTPError, TurnLimitReached
from swarm.llm.client import LLMClient
from swarm.report.display import Prices
from swarm.report.html import render_html
from swarm.report.view import AgentView, SwarmView
from swarm.runtime.root import describe
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from swarm.text import plural
from tests.helpers import make_agent

PACKAGE = Path(__file__).resolve().parent.parent / "swarm"


def test_plural() -> None:
    assert [plural(n, "line") for n in (0, 1, 2)] == ["0 lines", "1 line", "2 lines"]
    assert plural(1, "child", "children") == "1 child"
    assert plural(3, "child", "children") == "3 children"


def test_no_count_is_followed_by_a_noun_with_s_or_ren_in_brackets() -> None:
    """``f"{n} worker(s)"`` reads badly for every n; :func:`plural` says it right."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                for before, after in zip(node.values, node.values[1:], strict=False):
                    if isinstance(before, ast.FormattedValue) and isinstance(after, ast.Constant) \
                            and re.match(r"\s+\w+\((?:s|ren|es)\)", str(after.value)):
                        found.append(f"{path.name}:{node.lineno}")
    assert not found, f"counts with (s)-nouns: {found}"


def test_the_turn_limit_says_1_model_call(model_server: ScriptedModelServer,
                                          tmp_path: Path) -> None:
    model_server.script(*[Reply(tool_calls=[ToolCall("run_cli", {"command": "true"})])] * 2)
    agent = make_agent(model_server, tmp_path, max_turns=1)
    with pytest.raises(TurnLimitReached, match=r"stopped after 1 model call \(--max-turns 1\)"):
        agent.run("loop forever")


def test_progress_lines_count_in_words() -> None:
    assert describe({"agent": "a1", "kind": "spawn", "children": "1"}) == "[a1] asked for 1 child"
    assert describe({"agent": "a1", "kind": "dispatched", "children": "200", "refused": "800"}
                    ) == "[a1] dispatched 200 children, 800 refused"
    assert describe({"agent": "a1", "kind": "joined", "children": "3"}) == "[a1] joined 3 children"


def test_command_output_and_summaries_say_1_more_line_and_1_agent() -> None:
    err = io.StringIO()
    view = TerminalView(err=err, out=io.StringIO(), color=False)
    view.on_tool_result(Call("c1", "run_cli", {}),
                        "\n".join(f"line {i}" for i in range(SHOWN_LINES + 1)))
    assert "(1 more line)" in err.getvalue()
    alone = SwarmView("s1", {"state": "done"}, [AgentView("s1", state="done", turns=1)], 0.0)
    assert " 1 agent: 1 done " in alone.summary(Prices())
    assert "1 turn," in render_html(alone, Prices())


def test_a_refused_key_is_quoted_without_a_double_period(model_server: ScriptedModelServer
                                                         ) -> None:
    model_server.require_key = "the-right-key"
    client = LLMClient(model_server.base_url, model="scripted-model", api_key=Secret("wrong"),
                       retries=1, sleep=lambda _: None)
    with client, pytest.raises(ModelHTTPError) as info:
        client.chat([{"role": "user", "content": "hi"}])
    message = str(info.value)
    assert "Incorrect API key provided. Check SWARM_API_KEY" in message, message
    assert ".." not in message
