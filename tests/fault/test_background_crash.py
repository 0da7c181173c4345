"""A worker SIGKILLed while a background child runs on it and its parent, on the same
worker, is parked on an ``agent_join``: the child is taken over, the parent resumed from its
saved step, and each result reaches the parent once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarm.testing.scripts import ByTask, task_of, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.fault.test_crashes import Swarm, kill_group_of
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def model() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture
def swarm(tmp_path: Path, model: ScriptedModelServer) -> Iterator[Swarm]:
    s = Swarm(tmp_path / "home", model)
    try:
        yield s
    finally:
        s.close()


def test_a_worker_killed_under_a_background_child_and_its_joined_parent(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    slow = threading.Event()
    asked = threading.Event()

    def slow_child(request: dict[str, Any]) -> Reply:
        asked.set()
        assert slow.wait(60), "the test never let the slow child go"
        return Reply(content="slow done")

    def final(request: dict[str, Any]) -> Reply:
        return Reply(content="parent: " + json.dumps(tool_results(request)))

    model.responder = ByTask({
        "CRASH-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "CRASH-PARENT"},
                                                  id="p")]),
                       lambda r: Reply(content=tool_results(r)[0])],
        "CRASH-PARENT": [Reply(tool_calls=[
                             ToolCall("agent", {"message": "CRASH-SLOW", "background": True},
                                      id="s"),
                             ToolCall("agent", {"message": "CRASH-FAST", "background": True},
                                      id="f")]),
                         Reply(tool_calls=[ToolCall("agent_join", {}, id="j")]),
                         final],
        "CRASH-SLOW": [slow_child],
        "CRASH-FAST": [Reply(content="fast done")],
    })
    swarm.start("coordinator", "coord")
    doomed = swarm.start("worker", "doomed", SWARM_LEASE="2")
    swarm.ready()
    thread, out = swarm.run_in_thread("CRASH-ROOT go", tmp_path)

    def parent() -> Any:
        return next((a for a in swarm.agents() if a.label == "CRASH-PARENT"), None)

    try:
        wait_until(lambda: asked.is_set() and parent() is not None
                   and parent().state == "parked", "the parent parked on its join")
        os.kill(doomed.pid, signal.SIGKILL)  # the whole worker: the child's model call too
        killed = time.monotonic()
        swarm.start("worker", "rescuer", SWARM_LEASE="2")
        slow.set()
        thread.join(timeout=90)
        assert not thread.is_alive(), "the root never got its answer"
    finally:
        slow.set()
    (result,) = out
    assert result.exit_code == 0, result.output
    print(f"\nworker SIGKILL under a background child: root answered "
          f"{time.monotonic() - killed:.1f} s after the kill")
    body = json.loads(result.stdout.strip())
    assert body["state"] == "done", body
    answer = body["answer"]
    assert answer.count("slow done") == 1 and answer.count("fast done") == 1, answer
    slow_agent = next(a for a in swarm.agents() if a.label == "CRASH-SLOW")
    run = swarm.ledger.run(slow_agent.run)
    assert run is not None and run.attempts == 2 and run.delivered
    # The parent's last model call saw each child's result once, answering its one join.
    last = [r for r in model.requests if task_of(r) == "CRASH-PARENT"][-1]
    text = json.dumps(last["messages"])
    assert text.count("slow done") == 1 and text.count("fast done") == 1
    assert [m.get("tool_call_id") for m in last["messages"] if m["role"] == "tool"][-1] == "j"


def test_a_worker_killed_while_a_parent_works_beside_its_background_child(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """The parent is running its own command (not parked) when its worker dies, with its
    background child on the same worker: both are taken over, and the parent's join gets
    the child's result once."""
    marker = tmp_path / "started"
    slow = threading.Event()

    def slow_child(request: dict[str, Any]) -> Reply:
        assert slow.wait(60), "the test never let the slow child go"
        return Reply(content="slow done")

    model.responder = ByTask({
        "WORK-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "WORK-PARENT"},
                                                 id="p")]),
                      lambda r: Reply(content=tool_results(r)[0])],
        "WORK-PARENT": [Reply(tool_calls=[
                            ToolCall("agent", {"message": "WORK-SLOW", "background": True},
                                     id="s")]),
                        Reply(tool_calls=[ToolCall("run_cli", {
                            "command": f"echo $$ >> {marker}; sleep 30"}, id="own")]),
                        Reply(tool_calls=[ToolCall("agent_join", {}, id="j")]),
                        lambda r: Reply(content="parent: " + json.dumps(tool_results(r)))],
        "WORK-SLOW": [slow_child],
    })
    swarm.start("coordinator", "coord")
    doomed = swarm.start("worker", "doomed", SWARM_LEASE="2")
    swarm.ready()
    thread, out = swarm.run_in_thread("WORK-ROOT go", tmp_path)
    try:
        wait_until(lambda: marker.exists() and marker.read_text().strip()
                   and [r for r in model.requests if task_of(r) == "WORK-SLOW"],
                   "the parent's command and its background child running")
        os.kill(doomed.pid, signal.SIGKILL)
        swarm.start("worker", "rescuer", SWARM_LEASE="2")
        slow.set()
        thread.join(timeout=90)
        assert not thread.is_alive(), "the root never got its answer"
    finally:
        slow.set()
        kill_group_of(marker)
    (result,) = out
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout.strip())
    assert body["state"] == "done" and body["answer"].count("slow done") == 1, body
    agents = {a.label: a for a in swarm.agents()}
    slow_run, parent_run = (swarm.ledger.run(agents[label].run)
                            for label in ("WORK-SLOW", "WORK-PARENT"))
    assert slow_run is not None and slow_run.attempts == 2 and slow_run.state == "done"
    # Taken over (2), and resumed once more (3) if its join had to wait for the child.
    assert parent_run is not None and parent_run.attempts in (2, 3)
    assert parent_run.state == "done"
    last = [r for r in model.requests if task_of(r) == "WORK-PARENT"][-1]
    assert json.dumps(last["messages"]).count("slow done") == 1
    assert len(marker.read_text().split()) == 1  # its command did not run again
