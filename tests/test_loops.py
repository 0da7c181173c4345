"""A misbehaving model cannot hurt the swarm: its loops end by themselves and what it gets
back is bounded. Real `swarm run`, a real coordinator and Celery worker, real Redis, the
scripted model over HTTP."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from swarm.cli import main
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, task_of, tool_results
from swarm.testing.server import Item, Reply, ScriptedModelServer, ToolCall

pytestmark = pytest.mark.slow

#: Chat requests the guarded model answers before it gives up looping by itself: code
#: whose limits do not hold still ends (and its test fails) instead of running forever.
GUARD = 400


class GuardedModel(ScriptedModelServer):
    """The scripted model, answering plainly once it has had :data:`GUARD` chat requests."""

    def take(self, request: dict[str, Any]) -> Item:
        if len(self.requests) > GUARD:
            return Reply(content="the test's guard: too many requests, answering")
        return super().take(request)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("loops-home")
    with local_swarm(home) as url:
        yield url, home


@pytest.fixture
def model(cluster: tuple[str, Path]) -> Iterator[GuardedModel]:
    with GuardedModel() as server:
        yield server


def cli(cluster: tuple[str, Path], *args: str, **env: str) -> Result:
    url, home = cluster
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(SWARM_REDIS_URL=url, SWARM_HOME=str(home), SWARM_RETRIES="1", **env)
    return CliRunner().invoke(main, list(args), env=base, catch_exceptions=False)


def swarm_run(cluster: tuple[str, Path], model: ScriptedModelServer, workspace: Path,
              task: str, **env: str) -> Result:
    return cli(cluster, "run", "--yes", "--workers", "0", "-C", str(workspace), task,
               SWARM_BASE_URL=model.base_url, **env)


def status(cluster: tuple[str, Path]) -> dict[str, Any]:
    out = cli(cluster, "status", "--json")
    assert out.exit_code == 0, out.output
    return dict(json.loads(out.stdout))


def agent_call(message: str, n: int = 1) -> Reply:
    return Reply(tool_calls=[ToolCall("agent", {"message": message}) for _ in range(n)])


def results(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(text) for text in tool_results(request)]


def summarise(request: dict[str, Any]) -> Reply:
    return Reply(content=" | ".join(f"{r['state']}:{r.get('answer', r.get('error', ''))}"
                                    for r in results(request)))


def test_a_model_that_always_calls_agent_ends_by_itself_with_default_settings(
        cluster: tuple[str, Path], model: GuardedModel, tmp_path: Path) -> None:
    started = time.monotonic()
    result = swarm_run(cluster, model, tmp_path, "recurse 1")
    elapsed = time.monotonic() - started
    assert result.exit_code == 3, (result.stdout, result.stderr[-2000:])
    assert "SWARM_REPEAT_LIMIT" in result.stderr
    # Each depth-3 child is refused 3 times, each parent gets 3 identical failures: 39
    # children and about 120 model calls, not thousands.
    assert len(model.requests) < 200, len(model.requests)
    assert elapsed < 90, elapsed
    swarm = status(cluster)
    root, *children = swarm["agents"]
    assert root["kind"] == "root" and root["state"] == "failed"
    assert "SWARM_REPEAT_LIMIT" in root["error"]
    assert children and all(c["state"] == "failed" and "SWARM_REPEAT_LIMIT" in c["error"]
                            for c in children)
    assert swarm["totals"]["refused"] > 0


def test_the_same_refused_call_stops_an_agent_after_a_few_answers(
        cluster: tuple[str, Path], model: GuardedModel, tmp_path: Path) -> None:
    model.responder = ByTask({
        "PERSIST": [agent_call("STUBBORN child"), summarise],
        # At depth 1 with a depth limit of 1, every agent call is refused; it asks 10 times.
        "STUBBORN": [*[agent_call("too deep")] * 10, Reply(content="kept asking")],
    })
    result = swarm_run(cluster, model, tmp_path, "PERSIST", SWARM_MAX_DEPTH="1")
    assert result.exit_code == 0, result.stderr[-2000:]
    assert result.stdout.startswith("failed:RepeatedCalls: stopped: 3 answers in a row made "
                                    "the same call and got the same refusal "
                                    "(SWARM_REPEAT_LIMIT 3)"), result.stdout
    assert "depth limit reached" in result.stdout
    asked = [r for r in model.requests if task_of(r).startswith("STUBBORN")]
    assert len(asked) == 3


def test_a_child_stops_at_its_own_turn_limit(cluster: tuple[str, Path], model: GuardedModel,
                                             tmp_path: Path) -> None:
    model.responder = ByTask({
        "BUSY-ROOT": [agent_call("BUSY child"), summarise],
        "BUSY child": [*[Reply(tool_calls=[ToolCall("run_cli", {"command": f"echo {i}"})])
                         for i in range(10)], Reply(content="finished")],
    })
    result = swarm_run(cluster, model, tmp_path, "BUSY-ROOT", SWARM_CHILD_MAX_TURNS="3")
    assert result.exit_code == 0, result.stderr[-2000:]
    assert result.stdout.startswith("failed:TurnLimitReached: stopped after 3 model calls "
                                    "(SWARM_CHILD_MAX_TURNS 3)"), result.stdout


def test_the_token_budget_counts_the_root(cluster: tuple[str, Path], model: GuardedModel,
                                          tmp_path: Path) -> None:
    spend = {"prompt_tokens": 1100, "completion_tokens": 100, "total_tokens": 1200}
    model.responder = ByTask({
        "SPENDER": [Reply(tool_calls=[ToolCall("agent", {"message": "FRUGAL child"})],
                          usage=spend),
                    *[Reply(tool_calls=[ToolCall("run_cli", {"command": f"echo {i}"})],
                            usage=spend) for i in range(8)],
                    Reply(content="spent it all", usage=spend)],
        "FRUGAL": [Reply(content="cheap", usage={"prompt_tokens": 5, "completion_tokens": 5,
                                                 "total_tokens": 10})],
    })
    # The child spends 10 tokens: the root alone spends the budget, at its third call.
    result = swarm_run(cluster, model, tmp_path, "SPENDER", SWARM_TOKEN_BUDGET="3000")
    assert result.exit_code == 3, (result.stdout, result.stderr[-2000:])
    assert "the swarm used 3610 tokens of its budget of 3000 (SWARM_TOKEN_BUDGET)" \
        in result.stderr
    assert len([r for r in model.requests if task_of(r) == "SPENDER"]) == 3
    root = status(cluster)["agents"][0]
    assert root["state"] == "failed" and "SWARM_TOKEN_BUDGET" in root["error"]


def test_a_swarm_that_spent_its_budget_gets_no_new_children(
        cluster: tuple[str, Path], model: GuardedModel, tmp_path: Path) -> None:
    model.responder = ByTask({
        "BUDGET-ROOT": [agent_call("LAVISH child"), summarise],
        # Its model call spends the budget, and asks for a child in the same answer.
        "LAVISH": [Reply(tool_calls=[ToolCall("agent", {"message": "NEVER grandchild"})],
                         usage={"prompt_tokens": 4000, "completion_tokens": 1000,
                                "total_tokens": 5000}), summarise],
        "NEVER": [Reply(content="should not run")],
    })
    result = swarm_run(cluster, model, tmp_path, "BUDGET-ROOT", SWARM_TOKEN_BUDGET="3000")
    assert result.exit_code == 3, (result.stdout, result.stderr[-2000:])
    assert "SWARM_TOKEN_BUDGET" in result.stderr
    assert not [r for r in model.requests if task_of(r).startswith("NEVER")]
    swarm = status(cluster)
    assert swarm["totals"]["refused"] == 1
    (child,) = [a for a in swarm["agents"] if a["depth"] == 1]
    assert child["state"] == "failed" and "SWARM_TOKEN_BUDGET" in child["error"]
    logs = cli(cluster, "logs", child["id"])
    assert "refused" in logs.stdout and "token budget spent" in logs.stdout


def test_a_childs_huge_answer_reaches_the_parent_capped_and_logs_show_it_whole(
        cluster: tuple[str, Path], model: GuardedModel, tmp_path: Path) -> None:
    huge = "HEAD-OF-IT " + "x" * 300_000 + " END-OF-IT"
    model.responder = ByTask({
        "ASK-BIG": [agent_call("BIG child"), Reply(content="got it")],
        "BIG child": [Reply(content=huge)],
    })
    result = swarm_run(cluster, model, tmp_path, "ASK-BIG", SWARM_OUTPUT_CAP="2000")
    assert result.exit_code == 0, result.stderr[-2000:]
    final = [r for r in model.requests if task_of(r) == "ASK-BIG"][-1]
    (text,) = tool_results(final)
    assert len(text) < 3000, len(text)
    (child,) = results(final)
    assert child["state"] == "done"
    assert child["answer"].startswith("HEAD-OF-IT ") and child["answer"].endswith(" END-OF-IT")
    assert "characters cut" in child["answer"]
    assert f"`swarm logs {child['agent_id']}` shows it whole" in child["cut"]
    logs = cli(cluster, "logs", child["agent_id"])
    assert logs.exit_code == 0, logs.output
    assert huge in logs.stdout


def test_refused_calls_are_counted_in_progress_and_status(
        cluster: tuple[str, Path], model: GuardedModel, tmp_path: Path) -> None:
    model.responder = ByTask({"MANY": [agent_call("FEW child", 5), summarise],
                              "FEW child": [Reply(content="ok")]})
    result = swarm_run(cluster, model, tmp_path, "MANY", SWARM_MAX_CHILDREN="2")
    assert result.exit_code == 0, result.stderr[-2000:]
    assert "asked for 5 children" in result.stderr
    assert "dispatched 2 children, 3 refused" in result.stderr
    assert "joined 2 children, 3 refused" in result.stderr
    swarm = status(cluster)
    assert swarm["totals"]["refused"] == 3 and len(swarm["agents"]) == 3
    shown = cli(cluster, "status")
    assert "3 agents: 3 done · 3 agent calls refused" in shown.stdout
