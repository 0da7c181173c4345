"""Bad input from the model or the user: every case ends in a clear error (a tool result for
the model, a `refused`/`failed` result for the parent) and the swarm carries on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Fault, Garbage, Reply, ScriptedModelServer, ToolCall

from .conftest import (
    Once,
    Swarm,
    agent_call,
    answer_with_results,
    echo_result,
    requests_of,
    swarm_run,
)

pytestmark = pytest.mark.slow

EMPTY_CHOICES = {"id": "chatcmpl-empty", "object": "chat.completion", "created": 0,
                 "model": "scripted-model", "choices": [],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}}
#: The same, streamed: a usage-only chunk and [DONE], no choice at all.
EMPTY_STREAM = ('data: {"id": "chatcmpl-empty", "object": "chat.completion.chunk", "choices": [], '
                '"usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}}\n\n'
                "data: [DONE]\n\n")
OUTPUT_CAP = 20_000  # Settings.output_cap default: characters kept of a command's output


def run_swarm(swarm: Swarm, model: ScriptedModelServer, workspace: Path, task: str,
              scripts: dict[str, list[Any]]) -> list[Any]:
    """Run ``task`` with ``scripts``; the root must answer; returns its list of tool results."""
    model.responder = ByTask(scripts)
    result = swarm_run(swarm, model, workspace, task)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert isinstance(answer, list)
    return answer


def last_tool_result(model: ScriptedModelServer, key: str, call_id: str | None = None) -> str:
    """The tool result the child ``key`` sent back to the model in its last request."""
    request = requests_of(model, key)[-1]
    if call_id is not None:
        assert request["messages"][-1]["tool_call_id"] == call_id
    (text,) = tool_results(request)
    return text


def live_group_members(pgid: int) -> list[int]:
    """Processes of the group ``pgid`` that are not zombies."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.fixture
def whole_answers(model: ScriptedModelServer) -> Iterator[None]:
    """Answers as whole JSON bodies: a 1 MB tool call streamed in 1-6 character pieces
    would take the scripted server far too long."""
    model.force_stream = False
    try:
        yield
    finally:
        model.force_stream = None


# -- the model's answers ---------------------------------------------------------------------

def test_empty_choices_and_garbage_are_retried_or_fail_the_child_alone(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    results = run_swarm(swarm, model, tmp_path, "MODELFAULTS root", {
        "MODELFAULTS": [Reply(tool_calls=[
            agent_call("EMPTYONCE child", "e1"), agent_call("EMPTYALWAYS child", "e2"),
            agent_call("GARBAGEONCE child", "e3"), agent_call("PLAINKID child", "e4")]),
            answer_with_results],
        "EMPTYONCE": [Once(Fault(200, body=EMPTY_CHOICES), Reply(content="empty recovered"))],
        "EMPTYALWAYS": [Fault(200, body=EMPTY_CHOICES)],
        "GARBAGEONCE": [Once(Garbage(), Reply(content="garbage recovered"))],
        "PLAINKID": [Reply(content="plain done")],
    })
    once, always, garbage, plain = results
    assert (once["state"], once["answer"]) == ("done", "empty recovered")
    assert (garbage["state"], garbage["answer"]) == ("done", "garbage recovered")
    assert (plain["state"], plain["answer"]) == ("done", "plain done")
    # The retry re-sent the same conversation; nothing broken was added to it.
    first, second = requests_of(model, "EMPTYONCE")
    assert first["messages"] == second["messages"]
    assert always["state"] == "failed"
    assert "answer has no choices" in always["error"], always
    assert "gave up after 2 tries" in always["error"]
    assert len(requests_of(model, "EMPTYALWAYS")) == 2


def test_streamed_empty_choices_are_retried(swarm: Swarm, model: ScriptedModelServer,
                                            tmp_path: Path) -> None:
    results = run_swarm(swarm, model, tmp_path, "STREAMFAULT root", {
        "STREAMFAULT": [Reply(tool_calls=[agent_call("STREAMEMPTY child", "s1")]),
                        answer_with_results],
        "STREAMEMPTY": [Once(Fault(200, body=EMPTY_STREAM), Reply(content="stream recovered"))],
    })
    (child,) = results
    assert (child["state"], child.get("answer")) == ("done", "stream recovered"), child
    assert len(requests_of(model, "STREAMEMPTY")) == 2


def test_bad_tool_calls_come_back_to_the_model_as_errors(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    results = run_swarm(swarm, model, tmp_path, "TOOLFAULTS root", {
        "TOOLFAULTS": [Reply(tool_calls=[
            agent_call("BADJSON child", "t1"), agent_call("UNKNOWNTOOL child", "t2"),
            agent_call("BADTYPES child", "t3")]), answer_with_results],
        "BADJSON": [Reply(tool_calls=[ToolCall("run_cli", '{"command": "echo hi"', id="j1")]),
                    echo_result],
        "UNKNOWNTOOL": [Reply(tool_calls=[ToolCall("launch_rockets", {"count": 3}, id="u1")]),
                        echo_result],
        "BADTYPES": [Reply(tool_calls=[ToolCall("run_cli", {"command": 42, "verbose": True},
                                                id="b1")]), echo_result],
    })
    assert [r["state"] for r in results] == ["done", "done", "done"], results
    bad_json = last_tool_result(model, "BADJSON", "j1")
    assert bad_json.startswith("error: the arguments of run_cli are not valid JSON")
    unknown = last_tool_result(model, "UNKNOWNTOOL", "u1")
    assert unknown.startswith("error: unknown tool 'launch_rockets'. Available tools:")
    assert "run_cli" in unknown
    bad_types = last_tool_result(model, "BADTYPES", "b1")
    assert "error: invalid arguments for run_cli" in bad_types
    assert "command: 42 is not of type 'string'" in bad_types
    assert "'verbose' was unexpected" in bad_types
    # Each child answered from its error: the parent got it back as the child's answer.
    for result, text in zip(results, (bad_json, unknown, bad_types), strict=True):
        assert result["answer"] == f"got: {text}"


# -- commands ------------------------------------------------------------------------------

def test_huge_binary_and_endless_output_is_capped_or_killed(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    def short(request: dict[str, Any]) -> Reply:
        return Reply(content=f"saw {len(tool_results(request)[0])} chars")

    results = run_swarm(swarm, model, tmp_path, "OUTPUTS root", {
        "OUTPUTS": [Reply(tool_calls=[
            agent_call("HUGEOUT child", "o1"), agent_call("BINOUT child", "o2"),
            agent_call("FOREVER child", "o3")]), answer_with_results],
        "HUGEOUT": [Reply(tool_calls=[ToolCall("run_cli", {
            "command": "head -c 100000000 /dev/zero | tr '\\0' a; echo; echo HUGE-END"})]), short],
        "BINOUT": [Reply(tool_calls=[ToolCall("run_cli", {
            "command": "head -c 100000 /dev/urandom; echo; echo BIN-END"})]), short],
        "FOREVER": [Reply(tool_calls=[ToolCall("run_cli", {
            "command": "echo $$ > pgid.txt; sleep 300; echo NEVER-PRINTED", "timeout": 1})]),
            echo_result],
    })
    assert [r["state"] for r in results] == ["done", "done", "done"], results

    huge = last_tool_result(model, "HUGEOUT")
    huge.encode("utf-8")  # strict: valid UTF-8 all through
    assert huge.startswith("a" * 1000)
    assert huge.endswith("a\nHUGE-END\n[exit code: 0]")
    cut = re.search(r"\n\[\.\.\. (\d+) characters cut \.\.\.\]\n", huge)
    assert cut is not None, huge[9_900:10_100]
    assert int(cut[1]) == 100_000_000 + len("\nHUGE-END\n") - OUTPUT_CAP
    assert len(huge) < OUTPUT_CAP + 100
    assert results[0]["answer"] == f"saw {len(huge)} chars"

    binary = last_tool_result(model, "BINOUT")
    binary.encode("utf-8")
    assert "\ufffd" in binary and "\x00" not in binary
    assert "characters cut ...]" in binary and len(binary) < OUTPUT_CAP + 100
    assert binary.endswith("\nBIN-END\n[exit code: 0]")

    forever = last_tool_result(model, "FOREVER")
    assert forever.endswith("[timed out: the command and its children were killed]")
    assert "NEVER-PRINTED" not in forever
    assert results[2]["answer"] == f"got: {forever}"
    pgid = int((Path(results[2]["workspace"]) / "pgid.txt").read_text())
    assert live_group_members(pgid) == []  # bash and its sleep are both gone


# -- the agent tool ----------------------------------------------------------------------------

def test_invalid_schema_and_huge_message_are_refused_siblings_run(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path, whole_answers: None) -> None:
    # Over the 256 KiB a message may have, within the 1,000,000 characters of an answer.
    huge = "HUGEMSG child " + "x" * 600_000
    results = run_swarm(swarm, model, tmp_path, "REFUSALS root", {
        "REFUSALS": [Reply(tool_calls=[
            agent_call("SCHEMABAD child", "r1", output_schema={"type": "nonsense"}),
            agent_call(huge, "r2"), agent_call("SIBLING child", "r3")]), answer_with_results],
        "SIBLING": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo sib > s.txt"})]),
                    Reply(content="sibling done")],
        "SCHEMABAD": [Reply(content="must never run")],
        "HUGEMSG": [Reply(content="must never run")],
    })
    schema, big, sibling = results
    assert schema["state"] == "refused"
    assert schema["error"].startswith("output_schema is not a valid JSON Schema: ")
    assert "'nonsense' is not valid" in schema["error"]
    assert big["state"] == "refused"
    assert re.match(r"the message is 586 KiB; the limit is 256 KiB\. Write the material to a "
                    r"file", big["error"]), big["error"]
    assert (sibling["state"], sibling["answer"]) == ("done", "sibling done")
    assert sibling["files_changed"] == ["s.txt"]
    assert requests_of(model, "SCHEMABAD") == [] and requests_of(model, "HUGEMSG") == []
    ledger = Ledger(connect(swarm.url))
    swarm_id = ledger.latest_swarm()
    assert swarm_id is not None and ledger.swarm(swarm_id)["task"].startswith("REFUSALS")
    labels = [a.label for a in ledger.agents(swarm_id)]
    assert len(labels) == 2 and "SIBLING" in labels[1], labels  # root + the sibling only


def test_malformed_agent_calls_get_errors_and_create_no_child(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    results = run_swarm(swarm, model, tmp_path, "MALFORMED root", {
        "MALFORMED": [Reply(tool_calls=[
            ToolCall("agent", {}, id="m1"),
            ToolCall("agent", {"message": "EXTRAFIELD child", "priority": "high"}, id="m2"),
            ToolCall("agent", '{"message": "BROKENJSON child"', id="m3"),
            ToolCall("teleport", {"to": "mars"}, id="m4"),
            agent_call("VALIDKID child", "m5")]), answer_with_results],
        "VALIDKID": [Reply(content="valid done")],
        "EXTRAFIELD": [Reply(content="must never run")],
        "BROKENJSON": [Reply(content="must never run")],
    })
    missing, extra, broken, unknown, valid = results
    assert missing.startswith("error: invalid arguments for agent: "
                              "'message' is a required property")
    assert extra.startswith("error: invalid arguments for agent: Additional properties are "
                            "not allowed ('priority' was unexpected)")
    assert broken.startswith("error: the arguments of agent are not valid JSON")
    assert unknown.startswith("error: unknown tool 'teleport'")
    assert (valid["state"], valid["answer"]) == ("done", "valid done")
    assert requests_of(model, "EXTRAFIELD") == [] and requests_of(model, "BROKENJSON") == []
    ledger = Ledger(connect(swarm.url))
    swarm_id = ledger.latest_swarm()
    assert swarm_id is not None and ledger.swarm(swarm_id)["task"].startswith("MALFORMED")
    labels = [a.label for a in ledger.agents(swarm_id)]
    assert len(labels) == 2 and "VALIDKID" in labels[1], labels


def test_only_malformed_agent_calls_start_nothing(swarm: Swarm, model: ScriptedModelServer,
                                                   tmp_path: Path) -> None:
    client = connect(swarm.url)
    before = set(client.scan_iter(match="swarm:agent:*"))
    results = run_swarm(swarm, model, tmp_path, "ONLYBAD root", {
        "ONLYBAD": [Reply(tool_calls=[
            ToolCall("agent", {"message": "NEVERKID child", "extra": 1}, id="b1")]),
            answer_with_results],
        "NEVERKID": [Reply(content="must never run")],
    })
    (error,) = results
    assert "'extra' was unexpected" in error
    assert requests_of(model, "NEVERKID") == []
    new = set(client.scan_iter(match="swarm:agent:*")) - before
    assert all(client.hget(k, "kind") == "root" for k in new), new
