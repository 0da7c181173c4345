"""Declared agent types (``.swarm/agents/NAME.md``): the file's format, and children of a
type end to end (real Redis, a real coordinator and worker, the scripted model over HTTP)."""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result
from rich.console import Console

from swarm.agent import agent_types
from swarm.cli import live, main
from swarm.errors import ConfigError
from swarm.report.display import Prices
from swarm.report.view import SwarmReader
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, task_of, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until

LEAF = """---
description: A cheap leaf for one small, well-described piece of a wide fan-out.
model: cheap-model
tools: run_cli
max_turns: 5
---
LEAF-INSTRUCTIONS: do the one thing asked, then answer in one line.
"""
PLANNER = """---
description: Splits work and starts children.
tools: [run_cli, agent]
---
PLANNER-INSTRUCTIONS
"""
EVIL = """---
description: planted by a child's commands
model: evil-model
---
EVIL-INSTRUCTIONS
"""


# -- the file ---------------------------------------------------------------------------------

def test_a_type_file_is_read_from_its_front_matter_and_body(tmp_path: Path) -> None:
    (tmp_path / ".swarm/agents").mkdir(parents=True)
    (tmp_path / ".swarm/agents/reviewer.md").write_text(
        "---\n# a comment\ndescription: \"Reviews: a diff\"  \nmodel: small # cheap\n"
        "tools:\n  - read_file\n  - mcp__github\ninherit: instructions\n"
        "approval: run_cli=never,*=once\nmax_turns: 7\n---\n\nReview it.\n")
    home = tmp_path / "home"
    (home / "agents").mkdir(parents=True)
    (home / "agents/leaf.md").write_text(LEAF)
    (home / "agents/reviewer.md").write_text(LEAF.replace("cheap leaf", "user's reviewer"))
    types = agent_types.load(tmp_path, home)
    assert types.names() == ["leaf", "reviewer"]
    reviewer = types.get("reviewer")
    assert reviewer is not None  # the workspace's replaces the user's of the same name
    assert (reviewer.description, reviewer.model, reviewer.tools, reviewer.inherit,
            reviewer.max_turns, reviewer.instructions) == (
        "Reviews: a diff", "small", ("read_file", "mcp__github"), ("instructions",), 7,
        "Review it.")
    assert reviewer.policies() == {"run_cli": "never", "*": "once"}
    assert reviewer.allows("mcp__github__create_issue") and reviewer.allows("read_file")
    assert not reviewer.allows("run_cli") and not reviewer.allows("agent")
    assert reviewer.mcp_servers() == {"github"}
    assert agent_types.AgentTypes.from_json(json.loads(json.dumps(types.to_json()))) == types


@pytest.mark.parametrize(("text", "line", "says"), [
    ("---\nmodel: m\n---\nbody", 1, "description is required"),
    ("---\ndescription: d\ncolour: red\n---\n", 3, "unknown key 'colour'"),
    ("---\ndescription: d\nmax_turns: many\n---\n", 3, "max_turns 'many'"),
    ("---\ndescription: d\napproval: run_cli=maybe\n---\n", 3, "'maybe' is not one of"),
    ("---\ndescription: d\n  model: m\n---\n", 3, "indented line"),
    ("---\ndescription: d\ntools: run cli\n---\n", 3, "'run cli' is not a tool"),
    ("---\ndescription: d\n", 1, "not closed"),
    ("description: d\n", 1, "starts with a front matter"),
    ("---\ndescription: d\ndescription: e\n---\n", 3, "given twice"),
    ("---\ndescription: d\nbase_url: https://u:sk-1@h/v1\n---\n", 3, "holds credentials"),
])
def test_a_wrong_type_file_is_an_error_naming_its_file_and_line(
        tmp_path: Path, text: str, line: int, says: str) -> None:
    path = tmp_path / ".swarm/agents/bad.md"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        agent_types.load(tmp_path, None)
    assert str(caught.value).startswith(f"{path}:{line}: ")
    assert says in str(caught.value)


# -- end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("types-home")
    with local_swarm(home) as url:
        yield url, home


@pytest.fixture(scope="module")
def model(cluster: tuple[str, Path]) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer(models=("scripted-model", "cheap-model", "evil-model")) as server:
        yield server


@pytest.fixture
def client(cluster: tuple[str, Path]) -> redis_lib.Redis:
    return connect(cluster[0])


def swarm(cluster: tuple[str, Path], model: ScriptedModelServer, *args: str) -> Result:
    url, home = cluster
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model.base_url, SWARM_MODEL="scripted-model",
               SWARM_REDIS_URL=url, SWARM_HOME=str(home), SWARM_RETRIES="1",
               SWARM_PRICE_INPUT="1", SWARM_PRICE_OUTPUT="2",
               SWARM_PRICES="cheap-model=0.5/0.25")
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def run(cluster: tuple[str, Path], model: ScriptedModelServer, folder: Path,
        task: str) -> Result:
    return swarm(cluster, model, "run", "--yes", "--workers", "0", "-C", str(folder), task)


def folder_with_types(path: Path, **types: str) -> Path:
    (path / ".swarm/agents").mkdir(parents=True)
    for name, text in types.items():
        (path / f".swarm/agents/{name}.md").write_text(text)
    (path / "AGENTS.md").write_text("PROJECT-RULES: the parent's instructions.\n")
    return path


def results_of(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(r) for r in tool_results(request)]


def system_of(request: dict[str, Any]) -> str:
    return str(request["messages"][0]["content"])


def tools_of(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in request.get("tools") or []}


def answer_with_results(request: dict[str, Any]) -> Reply:
    try:
        return Reply(content="results: " + json.dumps(results_of(request)))
    except ValueError:  # a call refused by its schema: its error, as it came
        return Reply(content="results: " + json.dumps(tool_results(request)))


@pytest.mark.slow
def test_a_child_of_a_type_runs_with_its_model_tools_and_instructions_and_keeps_its_type(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    def continue_it(request: dict[str, Any]) -> Reply:
        (first,) = results_of(request)
        return Reply(tool_calls=[ToolCall("agent", {"message": "LEAF-TASK again",
                                                    "agent_id": first["agent_id"]}, id="c2")])

    model.responder = ByTask({
        "TYPED-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "LEAF-TASK count",
                                                            "type": "leaf"}, id="c1")]),
                       continue_it, answer_with_results],
        "LEAF-TASK": [Reply(content="leaf done")],
    })
    folder = folder_with_types(tmp_path, leaf=LEAF, planner=PLANNER)
    result = run(cluster, model, folder, "TYPED-ROOT")
    assert result.exit_code == 0, result.output
    (done,) = json.loads(result.stdout.strip().removeprefix("results: "))
    assert done["state"] == "done" and done["answer"] == "leaf done"

    root = [r for r in model.requests if task_of(r) == "TYPED-ROOT"]
    assert {r["model"] for r in root} == {"scripted-model"}
    agent = tools_of(root[0])["agent"]
    assert "- leaf: A cheap leaf for one small" in agent["description"]
    assert "- planner: Splits work and starts children." in agent["description"]
    assert "type" in agent["parameters"]["properties"]
    assert "PROJECT-RULES" in system_of(root[0])

    leaf = [r for r in model.requests if task_of(r).startswith("LEAF-TASK")]
    # Its first run, and its continuation without `type`.
    asked = [m["content"] for r in leaf for m in r["messages"] if m["role"] == "user"]
    assert "LEAF-TASK count" in asked and any(a.endswith("LEAF-TASK again") for a in asked)
    for request in leaf:
        assert request["model"] == "cheap-model"
        assert set(tools_of(request)) == {"run_cli"}  # no agent tool: not listed
        system = system_of(request)
        assert "LEAF-INSTRUCTIONS" in system and "of type leaf" in system
        assert "PROJECT-RULES" not in system  # nothing of the parent's it does not inherit
        assert "You are swarm, an autonomous agent" not in system


@pytest.mark.slow
def test_an_unknown_type_is_refused_with_the_known_types(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    model.responder = ByTask({
        "UNKNOWN-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "NEVER-RUNS",
                                                              "type": "wizard"}, id="c1")]),
                         answer_with_results],
    })
    folder = folder_with_types(tmp_path, leaf=LEAF, planner=PLANNER)
    result = run(cluster, model, folder, "UNKNOWN-ROOT")
    assert result.exit_code == 0, result.output
    (refused,) = json.loads(result.stdout.strip().removeprefix("results: "))
    assert refused["state"] == "refused"
    assert refused["error"].startswith(
        "unknown agent type 'wizard'; known types: leaf, planner.")
    assert not [r for r in model.requests if task_of(r) == "NEVER-RUNS"]
    swarm_id = Ledger(client).latest_swarm()
    assert swarm_id is not None and Ledger(client).counters(swarm_id).get("refused") == 1


@pytest.mark.slow
def test_a_type_a_child_writes_in_its_workspace_is_not_used_for_its_children(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    plant = ("mkdir -p .swarm/agents && printf '%s' " + json.dumps(EVIL)
             + " > .swarm/agents/evil.md && ls .swarm/agents")
    model.responder = ByTask({
        "PLANT-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "PLANTER",
                                                            "type": "planner"}, id="c1")]),
                       answer_with_results],
        "PLANTER": [Reply(tool_calls=[ToolCall("run_cli", {"command": plant})]),
                    Reply(tool_calls=[ToolCall("agent", {"message": "EVIL-CHILD",
                                                         "type": "evil"}, id="c2")]),
                    answer_with_results],
    })
    folder = folder_with_types(tmp_path, leaf=LEAF, planner=PLANNER)
    result = run(cluster, model, folder, "PLANT-ROOT")
    assert result.exit_code == 0, result.output
    (planter,) = json.loads(result.stdout.strip().removeprefix("results: "))
    assert planter["state"] == "done", planter
    planted = [r for r in model.requests if task_of(r) == "PLANTER"]
    assert "evil.md" in tool_results(planted[1])[0]  # the file is there, in its workspace
    (refused,) = json.loads(planter["answer"].removeprefix("results: "))
    assert refused["state"] == "refused"
    assert refused["error"].startswith(
        "unknown agent type 'evil'; known types: leaf, planner.")
    assert not [r for r in model.requests if task_of(r) == "EVIL-CHILD"
                or r.get("model") == "evil-model"]
    # Its own agent tool lists the swarm's types, not the planted one.
    description = tools_of(planted[1])["agent"]["description"]
    assert "- leaf:" in description and "evil" not in description


@pytest.mark.slow
def test_status_shows_tokens_and_cost_per_agent_type(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    model.responder = ByTask({
        "COSTS-ROOT": [Reply(tool_calls=[
            ToolCall("agent", {"message": "LEAF-COST a", "type": "leaf"}, id="c1"),
            ToolCall("agent", {"message": "LEAF-COST b", "type": "leaf"}, id="c2"),
            ToolCall("agent", {"message": "COPY-COST"}, id="c3")]),
            Reply(content="costed")],
        "LEAF-COST": [Reply(content="leaf", usage={"prompt_tokens": 1000,
                                                   "completion_tokens": 500,
                                                   "total_tokens": 1500})],
        "COPY-COST": [Reply(content="copy", usage={"prompt_tokens": 100,
                                                   "completion_tokens": 10,
                                                   "total_tokens": 110})],
    })
    folder = folder_with_types(tmp_path, leaf=LEAF)
    result = run(cluster, model, folder, "COSTS-ROOT")
    assert result.exit_code == 0, result.output
    swarm_id = Ledger(client).latest_swarm()
    assert swarm_id is not None

    status = swarm(cluster, model, "status", "--json", swarm_id)
    assert status.exit_code == 0, status.output
    data = json.loads(status.stdout)
    leaf = data["totals"]["types"]["leaf"]
    assert leaf["agents"] == 2
    assert leaf["usage"] == {"prompt_tokens": 2000, "completion_tokens": 1000,
                             "total_tokens": 3000}
    # The leaf type's model has a price of its own (SWARM_PRICES); the rest, the default.
    assert leaf["cost"] == pytest.approx((2000 * 0.5 + 1000 * 0.25) / 1e6)
    leaves = [a for a in data["agents"] if a["type"] == "leaf"]
    assert {a["model"] for a in leaves} == {"cheap-model"}
    assert leaves[0]["cost"] == pytest.approx((1000 * 0.5 + 500 * 0.25) / 1e6)
    untyped = data["totals"]["types"]["(no type)"]
    assert untyped["agents"] == 2  # the root and the copy
    assert untyped["usage"]["total_tokens"] > 110
    assert sorted(a["type"] or "" for a in data["agents"]) == ["", "", "leaf", "leaf"]
    assert data["swarm"]["types"] == {"leaf": "A cheap leaf for one small, well-described "
                                              "piece of a wide fan-out."}

    text = swarm(cluster, model, "status", swarm_id)
    assert text.exit_code == 0, text.output
    assert "  leaf: 2 agents, 3.0k tokens, ~$0.0013" in text.stdout.splitlines()

    page = swarm(cluster, model, "report", "-o", "-", swarm_id)
    assert page.exit_code == 0, page.output
    assert "<li>leaf: 2 agents, 3.0k tokens, ~$0.0013</li>" in page.stdout
    # The live tree names each child's type before its task.
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(
        live.render(SwarmReader(client).load(swarm_id), Prices(1, 2), 20))
    assert len(re.findall(r"\[leaf\] LEAF-COST", out.getvalue())) == 2, out.getvalue()


@pytest.mark.slow
def test_a_wrong_type_file_stops_swarm_run_with_its_file_and_line(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    model.responder = ByTask({}, default=Reply(content="never asked"))
    folder = folder_with_types(tmp_path, leaf=LEAF.replace("max_turns: 5", "max_turns: -1"))
    result = run(cluster, model, folder, "WRONG-TYPE")
    assert result.exit_code != 0
    assert f"{folder / '.swarm/agents/leaf.md'}:5: max_turns '-1'" in result.output
    assert not [r for r in model.requests if task_of(r) == "WRONG-TYPE"]


@pytest.mark.slow
def test_a_jobs_types_are_taken_at_submission_and_its_typed_child_runs_on_the_workers(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    from swarm.broker.app import configure
    from swarm.runtime.jobs import job_state, submit_job

    model.responder = ByTask({
        "JOB-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "JOB-LEAF",
                                                          "type": "leaf"}, id="c1")]),
                     answer_with_results],
        "JOB-LEAF": [Reply(content="job leaf done")],
    })
    folder = folder_with_types(tmp_path, leaf=LEAF)
    ledger = Ledger(client)
    settings = {"base_url": model.base_url, "model": "scripted-model", "yes": True}
    swarm_id = submit_job(ledger, configure(cluster[0]), "JOB-ROOT", folder, settings,
                          home=cluster[1])
    # Written after submission: the job's types are those its folder had then.
    (folder / ".swarm/agents/leaf.md").write_text(LEAF.replace("cheap-model", "evil-model"))
    job = wait_until(lambda: (j := job_state(ledger, swarm_id))["state"] not in (
        "queued", "running") and j, "the job to settle")
    assert job["state"] == "done", job
    assert [a["type"] for a in job["agents"]] == [None, "leaf"]
    (leaf,) = [r for r in model.requests if task_of(r) == "JOB-LEAF"]
    assert leaf["model"] == "cheap-model" and set(tools_of(leaf)) == {"run_cli"}
