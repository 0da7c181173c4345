"""The scripted model server on its own: the ``fan out N`` form, its ``-h``, the shipped
``--script`` examples, and a real ``swarm run`` fan-out driven by them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from swarm.agent.tools import AGENT, RUN_CLI
from swarm.cli import main
from swarm.testing.cluster import local_swarm
from swarm.testing.misbehave import MODES
from swarm.testing.server import ScriptedModelServer, parse_script
from swarm.testing.server import main as server_main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def chat(server: ScriptedModelServer, messages: list[dict[str, Any]],
         tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One non-streamed chat completion over HTTP; the assistant message."""
    body = json.dumps({"model": "m", "messages": messages, "tools": tools or [AGENT, RUN_CLI]})
    request = urllib.request.Request(server.base_url + "/chat/completions", body.encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        message: dict[str, Any] = json.load(response)["choices"][0]["message"]
    return message


def arguments(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def test_fan_out_form_calls_agent_n_times(model_server: ScriptedModelServer) -> None:
    reply = chat(model_server, [{"role": "user", "content": "fan out 3: `ls -la`"}])
    assert [c["function"]["name"] for c in reply["tool_calls"]] == ["agent"] * 3
    assert [a["message"] for a in arguments(reply)] == [
        f"child {i} of 3: run `ls -la` and report its output" for i in (1, 2, 3)]
    # Other spellings; without a command the children run pwd.
    for text in ("Fan-out to 2 children, please", "please FAN OUT: 2"):
        reply = chat(model_server, [{"role": "user", "content": text}])
        assert [a["message"] for a in arguments(reply)] == [
            f"child {i} of 2: run `pwd` and report its output" for i in (1, 2)]


def test_a_child_runs_its_command_and_never_fans_out_again(
        model_server: ScriptedModelServer) -> None:
    reply = chat(model_server, [{"role": "user",
                                 "content": "child 1 of 2: run `echo fan out 5` and report"}])
    assert arguments(reply) == [{"command": "echo fan out 5"}]
    assert reply["tool_calls"][0]["function"]["name"] == "run_cli"


def test_fan_out_refusals_are_plain_answers(model_server: ScriptedModelServer) -> None:
    no_agent = chat(model_server, [{"role": "user", "content": "fan out 3"}], [RUN_CLI])
    assert not no_agent.get("tool_calls") and "agent" in no_agent["content"]
    too_many = chat(model_server, [{"role": "user", "content": "fan out 201"}])
    assert not too_many.get("tool_calls") and "1 to 200" in too_many["content"]


def test_fan_in_sums_up_the_childrens_results(model_server: ScriptedModelServer) -> None:
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "agent", "arguments": "{}"}} for i in range(3)]
    results = [{"agent_id": "a1", "state": "done",
                "answer": "Done. Output:\n/w/a1\n[exit code: 0]"},
               {"agent_id": "a2", "state": "failed", "error": "ModelError: gave up"},
               {"agent_id": "", "state": "refused", "error": "children limit reached"}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "fan out 3"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": f"c{i}", "content": json.dumps(r)}
          for i, r in enumerate(results))]
    assert chat(model_server, messages)["content"] == (
        "3 children: 1 done, 1 failed, 1 refused.\n"
        "- a1 done: Done. Output: /w/a1 [exit code: 0]\n"
        "- a2 failed: ModelError: gave up\n"
        "- - refused: children limit reached")
    # A run_cli result is still reported as its output.
    messages[1]["tool_calls"] = [{**calls[0], "function": {"name": "run_cli",
                                                           "arguments": "{}"}}]
    del messages[3:]
    messages[2]["content"] = "hi\n[exit code: 0]"
    assert chat(model_server, messages)["content"] == "Done. Output:\nhi\n[exit code: 0]"


def test_recurse_form_always_calls_agent_whatever_comes_back(
        model_server: ScriptedModelServer) -> None:
    asked = [{"role": "user", "content": "please recurse 3"}]
    first = chat(model_server, asked)
    calls = [f"recurse 3: child {i} of 3; do as your parent did" for i in (1, 2, 3)]
    assert [a["message"] for a in arguments(first)] == calls
    refused = json.dumps({"state": "refused", "error": "depth limit reached"})
    again = chat(model_server, [*asked, first, *({"role": "tool", "tool_call_id": c["id"],
                                                  "content": refused}
                                                 for c in first["tool_calls"])])
    assert [a["message"] for a in arguments(again)] == calls  # the same calls, again
    # A swarm's bracketed note does not stop it; backticks and a missing tool do.
    noted = chat(model_server, [*asked, {"role": "user", "content": "[time limit: wrap up]"}])
    assert len(arguments(noted)) == 3
    quoted = chat(model_server, [{"role": "user", "content": "run `echo recurse 2`"}])
    assert arguments(quoted) == [{"command": "echo recurse 2"}]
    plain = chat(model_server, asked, [RUN_CLI])
    assert not plain.get("tool_calls") and "agent" in plain["content"]
    # --recurse N: every conversation recurses.
    model_server.recurse = 2
    assert [a["message"] for a in arguments(chat(model_server, [
        {"role": "user", "content": "hello"}]))] == [
        f"recurse 2: child {i} of 2; do as your parent did" for i in (1, 2)]


def test_a_long_answer_is_cut_on_its_summary_line_with_a_marker(
        model_server: ScriptedModelServer) -> None:
    call = {"id": "c0", "type": "function", "function": {"name": "agent", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "fan out 1"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0",
         "content": json.dumps({"agent_id": "a1", "state": "done", "answer": "y" * 1000})}]
    assert chat(model_server, messages)["content"] == (
        "1 child: 1 done.\n- a1 done: " + "y" * 300 + " [... 700 characters cut]")


def test_help_explains_the_forms_and_the_examples() -> None:
    done = subprocess.run([sys.executable, "-m", "swarm.testing.server", "-h"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    for words in ("fan out N: `COMMAND`", "calls the agent tool N times", "--script FILE",
                  "recurse N", "--recurse N",
                  "examples/", "default: 8099", "SWARM_BASE_URL=http://127.0.0.1:8099/v1",
                  "answers with its output, whole", "[... N characters cut]",
                  "--misbehave MODE", "misbehave: MODE", *(f"  {mode} " for mode in MODES)):
        assert words in done.stdout, words


def test_a_busy_port_or_a_bad_script_is_a_clear_error(
        model_server: ScriptedModelServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as busy:
        server_main(["--port", str(model_server.port)])
    assert busy.value.code == 2
    assert f"cannot listen on 127.0.0.1:{model_server.port}" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"content": "not a list"}')
    with pytest.raises(SystemExit):
        server_main(["--port", "0", "--script", str(bad)])
    assert "not a JSON list" in capsys.readouterr().err


def test_every_example_parses_and_has_a_readme_line() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    scripts = sorted(EXAMPLES.glob("*.json"))
    assert scripts
    for script in scripts:
        assert parse_script(json.loads(script.read_text())), script.name
        assert re.search(rf"^- `{re.escape(script.name)}`: ", readme, re.M), script.name
    listed = set(re.findall(r"^- `([^`]+)`: ", readme, re.M))
    assert listed == {s.name for s in scripts}


# -- a real swarm -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("scripted-home")
    with local_swarm(home, concurrency=8) as url:
        yield url, home


def swarm_run(swarm: tuple[str, Path], model: ScriptedModelServer, workspace: Path,
              *args: str, **env: str) -> Result:
    url, home = swarm
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
                SWARM_RETRIES="5", SWARM_BACKOFF_MAX="0.05")
    base.update(env)
    return CliRunner().invoke(main, ["run", "--workers", "0", "-C", str(workspace), *args],
                              env=base, catch_exceptions=False)


@pytest.mark.slow
def test_fan_out_form_drives_a_real_swarm(swarm_url: tuple[str, Path], tmp_path: Path) -> None:
    with ScriptedModelServer() as model:
        # No --yes: the children's `pwd` passes the scripted safety review.
        result = swarm_run(swarm_url, model, tmp_path, "fan out 3: `pwd`")
        reviews = len(model.review_requests)
    assert result.exit_code == 0, result.stderr
    head, *rows = result.stdout.strip().splitlines()
    assert head == "3 children: 3 done."
    workspaces = swarm_url[1] / "workspaces"
    agents = set()
    for row in rows:
        match = re.fullmatch(r"- (a[0-9a-f]{15}) done: Done\. Output: (\S+) \[exit code: 0\]", row)
        assert match, row
        # Each child ran in its own workspace, under the worker's SWARM_HOME.
        assert Path(match[2]) == workspaces / Path(match[2]).parent.name / match[1]
        agents.add(match[1])
    assert len(agents) == 3 and reviews == 3


@pytest.mark.slow
def test_fan_out_form_reports_refused_children(swarm_url: tuple[str, Path],
                                               tmp_path: Path) -> None:
    with ScriptedModelServer() as model:
        result = swarm_run(swarm_url, model, tmp_path, "--yes", "fan out 3",
                           SWARM_MAX_CHILDREN="2")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "3 children: 2 done, 1 refused."
    assert lines[3].startswith("- - refused: children limit reached")


EXPECTED = {
    "fan-out.json": [r"3 children: 3 done\.", r"- a\w+ done: Done\. Output: /\S+ \[exit code: 0\]",
                     r"- a\w+ done: Done\. Output: total \d+ .*\[exit code: 0\]",
                     r"- a\w+ done: Done\. Output: hello from a child \[exit code: 0\]"],
    "output-schema.json": [r"1 child: 1 done\.", r'- a\w+ done: \{"files": 0\}'],
    "flaky-model.json": [r"Answered after a 429, a 503 and a stream cut short\."],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_scripts_run(swarm_url: tuple[str, Path], tmp_path: Path, name: str) -> None:
    assert {p.name for p in EXAMPLES.glob("*.json")} == set(EXPECTED)
    with ScriptedModelServer() as model:
        model.script(*parse_script(json.loads((EXAMPLES / name).read_text())))
        result = swarm_run(swarm_url, model, tmp_path, "--yes", "run the example")
        assert model.pending == 0
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(EXPECTED[name]), result.stdout
    for line, pattern in zip(lines, EXPECTED[name], strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)
