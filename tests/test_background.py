"""Background children end to end (real Redis, a real coordinator and Celery worker, the
scripted model over HTTP): ``agent(background: true)``, ``agent_status``, ``agent_join``,
``agent_cancel``, a final answer given while they run, limits, cancel.

A slow child is one whose model call the test holds (an event the responder waits on):
the test decides when it answers, and waits on conditions, never on sleeps."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result

from swarm.cli import main
from swarm.domain.spawn import SpawnCall
from swarm.runtime.build import new_session
from swarm.runtime.spawner import RedisSpawner
from swarm.store.connection import connect
from swarm.store.ledger import AgentRecord, Ledger
from swarm.store.sessions import RedisSessionStore
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, task_of, tool_results, turn_of
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("background-home")
    with local_swarm(home, env={"SWARM_SANDBOX": "none"}) as url:
        yield url, home


@pytest.fixture(scope="module")
def model(cluster: tuple[str, Path]) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture
def client(cluster: tuple[str, Path]) -> redis_lib.Redis:
    return connect(cluster[0])


def swarm_run(cluster: tuple[str, Path], model: ScriptedModelServer, workspace: Path,
              task: str, **env: str) -> Result:
    url, home = cluster
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
                SWARM_RETRIES="1", SWARM_SANDBOX="none")
    base.update(env)
    return CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C", str(workspace),
                                     task], env=base, catch_exceptions=False)


def background(message: str, call_id: str, **extra: Any) -> ToolCall:
    return ToolCall("agent", {"message": message, "background": True, **extra}, id=call_id)


def held(event: threading.Event, reply: Reply) -> Callable[[dict[str, Any]], Reply]:
    """A model answer that waits for ``event`` (the test lets the child go)."""
    def answer(request: dict[str, Any]) -> Reply:
        assert event.wait(60), "the test never let the slow child go"
        return reply
    return answer


def requests_of(model: ScriptedModelServer, key: str) -> list[dict[str, Any]]:
    return [r for r in model.requests if key in task_of(r)]


def labelled(ledger: Ledger, label: str) -> AgentRecord:
    """The agent of the latest swarm with ``label`` (its task's first words)."""
    found = [a for a in ledger.agents(ledger.latest_swarm() or "") if a.label == label]
    assert found, f"no agent {label} in the latest swarm"
    return found[0]


def state_of(ledger: Ledger, label: str) -> str:
    swarm_id = ledger.latest_swarm() or ""
    found = [a for a in ledger.agents(swarm_id) if a.label == label] if swarm_id else []
    return found[0].state if found else ""


def answer_with(request: dict[str, Any]) -> Reply:
    """Answer with what the last message(s) carried: tool results, or a user message."""
    last = request["messages"][-1]
    if last["role"] == "user":
        return Reply(content="again: " + last["content"])
    return Reply(content="results: " + json.dumps(tool_results(request)))


def test_a_parent_gets_ids_works_peeks_joins_any_then_the_rest(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    """A child parent (in a worker) starts a slow and a fast child in the background, gets
    their ids at once, runs its own command while they run, peeks, joins ``any`` (the fast
    one comes), then joins the rest (the slow one, let go by then); each result once."""
    slow = threading.Event()
    seen: dict[str, Any] = {}

    def after_start(request: dict[str, Any]) -> Reply:
        seen["started"] = [json.loads(t) for t in tool_results(request)]
        return Reply(tool_calls=[ToolCall("run_cli", {"command": "echo own work > own.txt"},
                                          id="own")])

    def join_rest(request: dict[str, Any]) -> Reply:
        seen["any"] = json.loads(tool_results(request)[0])
        slow.set()  # only now may the slow child answer
        return Reply(tool_calls=[ToolCall("agent_join", {}, id="rest")])

    def peeked(request: dict[str, Any]) -> Reply:
        seen["status"] = json.loads(tool_results(request)[0])
        return Reply(tool_calls=[ToolCall("agent_join", {"any": True}, id="any")])

    model.responder = ByTask({
        "BG-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "BG-PARENT"}, id="p")]),
                    answer_with],
        "BG-PARENT": [Reply(tool_calls=[background("BG-SLOW", "s"), background("BG-FAST", "f")]),
                      after_start,
                      Reply(tool_calls=[ToolCall("agent_status", {}, id="peek")]),
                      peeked, join_rest, answer_with],
        "BG-SLOW": [held(slow, Reply(content="slow done"))],
        "BG-FAST": [Reply(content="fast done")],
    })
    result = swarm_run(cluster, model, tmp_path, "BG-ROOT")
    assert result.exit_code == 0, result.output

    started = seen["started"]
    assert [s["state"] for s in started] == ["started", "started"]
    slow_id, fast_id = started[0]["agent_id"], started[1]["agent_id"]
    # Its own command ran while they ran (the slow one could not have settled yet).
    own = [r for r in requests_of(model, "BG-PARENT") if tool_results(r) and
           "own" in json.dumps(r["messages"][-1])]
    assert own, "the parent's own command never ran"
    status = {row["agent_id"]: row for row in seen["status"]}
    assert set(status) == {slow_id, fast_id}
    assert status[slow_id]["state"] not in ("done", "failed")
    # any: the fast child came first, the slow one still running.
    (first,) = seen["any"]["results"]
    assert (first["agent_id"], first["answer"]) == (fast_id, "fast done")
    assert seen["any"]["still_running"] == [slow_id]
    # The rest: only the slow one (the fast one's result is given once).
    last = [r for r in requests_of(model, "BG-PARENT")][-1]
    rest = json.loads(tool_results(last)[0])
    assert [(r["agent_id"], r["answer"]) for r in rest["results"]] == [(slow_id, "slow done")]
    text = json.dumps([m for r in requests_of(model, "BG-PARENT")[-1:] for m in r["messages"]])
    assert text.count("fast done") == 1 and text.count("slow done") == 1
    runs = Ledger(client).background_runs(labelled(Ledger(client), "BG-PARENT").id)
    assert [(r.agent, bool(r.delivered)) for r in runs] == [(slow_id, True), (fast_id, True)]


def test_a_parent_that_answers_while_a_background_child_runs_waits_and_answers_again(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    """A root in a terminal answers while its background child still runs: it parks until
    the child settles (no orphan), then gets the child's result in a message and answers
    again."""
    slow = threading.Event()
    ledger = Ledger(client)

    def answer_early(request: dict[str, Any]) -> Reply:
        def let_go() -> None:  # once the root parks on its answer
            wait_until(lambda: state_of(ledger, "EARLY-ROOT") == "parked",
                       "the root parked on its answer")
            slow.set()
        threading.Thread(target=let_go, daemon=True).start()
        return Reply(content="first answer")

    model.responder = ByTask({
        "EARLY-ROOT": [Reply(tool_calls=[background("EARLY-SLOW", "s")]), answer_early,
                       answer_with],
        "EARLY-SLOW": [held(slow, Reply(content="early slow done"))],
    })
    result = swarm_run(cluster, model, tmp_path, "EARLY-ROOT")
    assert result.exit_code == 0, result.output
    assert slow.is_set()
    out = result.stdout.strip()
    assert out.startswith("again: [swarm: you answered while children you started in the "
                          "background still ran"), out
    assert "early slow done" in out
    root = [r for r in model.requests if task_of(r) == "EARLY-ROOT"]
    assert len(root) == 3 and root[-1]["messages"][-2]["content"] == "first answer"


def test_agent_cancel_drops_background_children_and_the_answer_does_not_wait(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    never = threading.Event()
    model.responder = ByTask({
        "DROP-ROOT": [Reply(tool_calls=[background("DROP-SLOW", "s")]),
                      Reply(tool_calls=[ToolCall("agent_cancel", {}, id="x")]),
                      answer_with],
        "DROP-SLOW": [held(never, Reply(content="never wanted"))],
    })
    try:
        result = swarm_run(cluster, model, tmp_path, "DROP-ROOT")
        assert result.exit_code == 0, result.output
        assert result.stdout.strip().startswith("results: ")
        assert "cancelled: " in result.stdout and "never wanted" not in result.stdout
        ledger = Ledger(client)
        wait_until(lambda: state_of(ledger, "DROP-SLOW") == "cancelled",
                   "the dropped child cancelled")
    finally:
        never.set()


def test_the_children_limit_counts_background_children(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    model.responder = ByTask({
        "LIMIT-ROOT": [Reply(tool_calls=[background("LIMIT-A", "a"), background("LIMIT-B", "b")]),
                       Reply(tool_calls=[background("LIMIT-C", "c")]),
                       Reply(tool_calls=[ToolCall("agent_join", {}, id="j")]),
                       answer_with],
        "LIMIT-": [Reply(content="limited child done")],
    })
    result = swarm_run(cluster, model, tmp_path, "LIMIT-ROOT", SWARM_MAX_CHILDREN="2")
    assert result.exit_code == 0, result.output
    root = [r for r in model.requests if task_of(r) == "LIMIT-ROOT"]
    (third,) = [json.loads(t) for t in tool_results(root[2])]
    assert third["state"] == "refused"
    assert third["error"].startswith("children limit reached: this swarm has spawned 2 of 2")
    joined = json.loads(tool_results(root[3])[0])
    assert [r["answer"] for r in joined["results"]] == ["limited child done"] * 2
    assert not [r for r in model.requests if task_of(r) == "LIMIT-C"]


def test_cancelling_a_parent_cancels_its_background_children(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    """A parent in a worker, parked on a join of its background child, is cancelled: the
    child (its subtree) is cancelled too, and the root hears the parent was."""
    never = threading.Event()
    ledger = Ledger(client)
    model.responder = ByTask({
        "CANCEL-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "CANCEL-PARENT"},
                                                   id="p")]), answer_with],
        "CANCEL-PARENT": [Reply(tool_calls=[background("CANCEL-SLOW", "s")]),
                          Reply(tool_calls=[ToolCall("agent_join", {}, id="j")]),
                          Reply(content="parent never answers")],
        "CANCEL-SLOW": [held(never, Reply(content="never wanted"))],
    })

    def cancel_when_parked() -> None:
        wait_until(lambda: state_of(ledger, "CANCEL-PARENT") == "parked"
                   and requests_of(model, "CANCEL-SLOW"), "the parent parked on its join")
        ledger.cancel(labelled(ledger, "CANCEL-PARENT").id, "cancelled by the test")

    canceller = threading.Thread(target=cancel_when_parked, daemon=True)
    canceller.start()
    try:
        result = swarm_run(cluster, model, tmp_path, "CANCEL-ROOT")
    finally:
        never.set()
        canceller.join(timeout=30)
    assert result.exit_code == 0, result.output
    (parent,) = json.loads(result.stdout.strip().removeprefix("results: "))
    assert json.loads(parent)["state"] == "cancelled"
    assert state_of(ledger, "CANCEL-SLOW") == "cancelled"
    assert not [r for r in model.requests if "parent never answers" in json.dumps(r)]


def test_a_background_result_is_taken_once_in_the_same_write_as_the_session(
        redis: redis_lib.Redis) -> None:
    """The parent's own take (its children settled before it joined): each result goes
    into the session saved with its mark, once; a later join of it says so."""
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent")
    sessions = RedisSessionStore(redis, index=False)
    spawner = RedisSpawner(ledger, "aparent", "s1", sessions=sessions)
    started = spawner.start(1, [SpawnCall("c1", "do 1", background=True),
                                SpawnCall("c2", "do 2", background=True)])
    first, second = (json.loads(started[c])["agent_id"] for c in ("c1", "c2"))
    runs, notes = spawner.outstanding([])
    assert list(runs) == [first, second] and notes == []
    run = ledger.run(runs[first])
    assert run is not None and ledger.settle(run, "s1", "done", {"answer": "one"}, {})
    session = new_session(Path("/w"), "aparent")
    session.messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "j1", "type": "function",
         "function": {"name": "agent_join", "arguments": '{"any": true}'}}]})
    session.parked = "w1"  # as a parent saves itself before it tries to wait
    sessions.save(session)

    text = spawner.take(runs, True, "w1", session, "j1", [])
    body = json.loads(text)
    assert [r["answer"] for r in body["results"]] == ["one"]
    assert body["still_running"] == [second]
    assert spawner.take(runs, True, "w2", session, "j2", []) == ""  # once
    stored = sessions.load(session.id)
    assert stored is not None and not stored.parked
    assert [(m["tool_call_id"], m["content"]) for m in stored.messages
            if m["role"] == "tool"] == [("j1", text)]
    assert spawner.outstanding([first, second, "anobody"]) == (
        {second: runs[second]}, [f"{first}: its result was given to you already",
                                 "anobody: not a child you started in the background"])


def test_background_and_plain_calls_in_one_answer(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    """The plain call parks the parent as ever; the background one is answered with its
    id in the same fan-in, and its result comes with the join after."""
    model.responder = ByTask({
        "MIXED-ROOT": [Reply(tool_calls=[background("MIXED-BG", "b"),
                                         ToolCall("agent", {"message": "MIXED-PLAIN"}, id="p"),
                                         ToolCall("agent_join", {}, id="no")]),
                       Reply(tool_calls=[ToolCall("agent_join", {}, id="j")]),
                       answer_with],
        "MIXED-BG": [Reply(content="background done")],
        "MIXED-PLAIN": [Reply(content="plain done")],
    })
    result = swarm_run(cluster, model, tmp_path, "MIXED-ROOT")
    assert result.exit_code == 0, result.output
    root = [r for r in model.requests if task_of(r) == "MIXED-ROOT"]
    started, plain, refused = tool_results(root[1])
    assert json.loads(started)["state"] == "started"
    assert json.loads(plain)["answer"] == "plain done"
    assert refused.startswith("error: agent_join cannot be called in an answer that also")
    (joined,) = json.loads(tool_results(root[2])[0])["results"]
    assert (joined["agent_id"], joined["answer"]) == (json.loads(started)["agent_id"],
                                                      "background done")


def test_a_background_childs_work_lands_when_its_result_is_taken(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    ledger = Ledger(client)
    seen: dict[str, bool] = {}

    def join_once_settled(request: dict[str, Any]) -> Reply:
        wait_until(lambda: state_of(ledger, "LAND-CHILD") == "done", "the child settled")
        seen["before"] = (tmp_path / "bg.txt").exists()
        return Reply(tool_calls=[ToolCall("agent_join", {}, id="j")])

    model.responder = ByTask({
        "LAND-ROOT": [Reply(tool_calls=[background("LAND-CHILD", "b")]), join_once_settled,
                      answer_with],
        "LAND-CHILD": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo made > bg.txt"})]),
                       Reply(content="wrote it")],
    })
    (tmp_path / "README").write_text("the parent's folder\n")  # seeded from it
    result = swarm_run(cluster, model, tmp_path, "LAND-ROOT")
    assert result.exit_code == 0, result.output
    assert seen == {"before": False}  # settled, but not landed until taken
    assert (tmp_path / "bg.txt").read_text() == "made\n"
    root = [r for r in model.requests if task_of(r) == "LAND-ROOT"]
    (joined,) = json.loads(tool_results(root[-1])[0])["results"]
    assert joined["landing"] == "landed" and joined["files_changed"] == ["bg.txt"]


def test_a_parent_holds_its_slot_while_it_works_and_gives_it_back_when_it_joins(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    """SWARM_MAX_PARALLEL=1: a parent in a worker holds the one slot, so its background
    child waits; its join parks it and frees the slot, and the child runs."""
    seen: dict[str, Any] = {}

    def parent(request: dict[str, Any]) -> Reply:
        """Spawns, peeks until the coordinator has taken the request (its child "queued"
        till then), joins, answers."""
        if turn_of(request) == 0:
            return Reply(tool_calls=[background("SLOT-CHILD", "c")])
        if "status" in seen:
            return answer_with(request)
        if turn_of(request) > 1:
            rows = json.loads(tool_results(request)[0])
            if [row["state"] for row in rows] != ["queued"]:
                seen["status"] = rows
                return Reply(tool_calls=[ToolCall("agent_join", {}, id="j")])
        return Reply(tool_calls=[ToolCall("agent_status", {}, id=f"s{turn_of(request)}")])

    model.responder = ByTask({
        "SLOT-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "SLOT-PARENT"}, id="p")]),
                      answer_with],
        "SLOT-PARENT": [parent],
        "SLOT-CHILD": [Reply(content="ran once the slot was free")],
    })
    result = swarm_run(cluster, model, tmp_path, "SLOT-ROOT", SWARM_MAX_PARALLEL="1")
    assert result.exit_code == 0, result.output
    assert [row["state"] for row in seen["status"]] == ["waiting"]
    assert "ran once the slot was free" in result.stdout
