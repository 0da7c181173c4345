"""The loop over real HTTP: tool calls, pairing, approvals, limits, compaction."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from swarm.agent import compaction, context
from swarm.agent.approval import approve_all, deny_all
from swarm.agent.loop import INTERRUPTED_BY_USER, Agent, Observer
from swarm.config import Settings
from swarm.domain.history import problems
from swarm.domain.messages import (
    TOKENS_BEYOND_BYTES,
    ChatResult,
    Message,
    OnEvent,
    StreamEvent,
    Usage,
)
from swarm.domain.spawn import SpawnCall
from swarm.errors import Interrupted, LockError, RepeatedCalls, TaskTooLarge, TurnLimitReached
from swarm.llm.client import LLMClient
from swarm.runtime.build import build_agent, new_session
from swarm.store.sessions import RedisSessionStore
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import MemoryHints, client_for, make_agent


def tool_messages(request: dict[str, object]) -> list[dict[str, object]]:
    return [m for m in request["messages"] if m["role"] == "tool"]  # type: ignore[union-attr,index]


def test_runs_a_command_and_pairs_the_result(model_server: ScriptedModelServer,
                                             tmp_path: Path) -> None:
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo hello; pwd"}, id="call_1")]),
        Reply(content="All done."),
    )
    agent = make_agent(model_server, tmp_path)
    assert agent.run("say hello") == "All done."
    second = model_server.requests[1]
    assistant = next(m for m in second["messages"] if m["role"] == "assistant")
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {
        "command": "echo hello; pwd"}
    (result,) = tool_messages(second)
    assert result["tool_call_id"] == "call_1"
    assert "hello" in result["content"] and str(tmp_path) in result["content"]
    assert "[exit code: 0]" in result["content"]
    assert problems(agent.messages) == []


def test_bad_calls_become_errors_and_the_loop_goes_on(model_server: ScriptedModelServer,
                                                      tmp_path: Path) -> None:
    model_server.script(
        Reply(tool_calls=[
            ToolCall("format_disk", {}, id="a"),
            ToolCall("run_cli", '{"command": ', id="b"),
            ToolCall("run_cli", {"cmd": "ls"}, id="c"),
            ToolCall("run_cli", {"command": "echo ok"}, id="d"),
        ]),
        Reply(content="recovered"),
    )
    agent = make_agent(model_server, tmp_path)
    assert agent.run("go") == "recovered"
    results = {m["tool_call_id"]: m["content"] for m in tool_messages(model_server.requests[1])}
    assert list(results) == ["a", "b", "c", "d"]
    assert "unknown tool 'format_disk'" in results["a"]
    assert "not valid JSON" in results["b"]
    assert "'command' is a required property" in results["c"]
    assert results["d"].startswith("ok")


def test_denied_command_does_not_run(model_server: ScriptedModelServer, tmp_path: Path) -> None:
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "touch made"})]),
        Reply(content="could not"),
    )
    agent = make_agent(model_server, tmp_path, approver=deny_all, policy="always")
    assert agent.run("make a file") == "could not"
    assert not (tmp_path / "made").exists()
    assert "denied" in tool_messages(model_server.requests[1])[0]["content"]


def test_review_policy_asks_the_model_then_runs_read_only(model_server: ScriptedModelServer,
                                                          tmp_path: Path) -> None:
    from swarm.agent.approval import LLMReviewer

    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "ls"}),
                          ToolCall("run_cli", {"command": "touch x"})]),
        Reply(content="ok"),
    )
    agent = make_agent(model_server, tmp_path, approver=deny_all, policy="review")
    agent.gate.reviewer = LLMReviewer(agent.model)  # type: ignore[arg-type]
    agent.run("look")
    assert len(model_server.review_requests) == 2
    assert model_server.review_requests[0]["temperature"] == 0
    results = [m["content"] for m in tool_messages(model_server.requests[1])]
    assert "[exit code: 0]" in results[0]
    assert results[1].startswith("denied")
    assert not (tmp_path / "x").exists()


def test_max_turns_stops_cleanly(model_server: ScriptedModelServer, tmp_path: Path) -> None:
    model_server.script(*[Reply(tool_calls=[ToolCall("run_cli", {"command": "true"})])] * 3)
    agent = make_agent(model_server, tmp_path, max_turns=2)
    with pytest.raises(TurnLimitReached, match="--max-turns 2"):
        agent.run("loop forever")
    assert len(model_server.requests) == 2
    assert problems(agent.messages) == []


def test_the_same_denied_call_answer_after_answer_stops_the_agent(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    from swarm.agent.approval import LLMReviewer

    # Polling (the same command, the same output) is work, and refusals of calls that
    # differ are no loop: neither stops it.
    poll = Reply(tool_calls=[ToolCall("run_cli", {"command": "echo pending"})])
    varied = [Reply(tool_calls=[ToolCall("nope", args)]) for args in ({}, {"a": 1})] * 2
    denied = Reply(tool_calls=[ToolCall("run_cli", {"command": "rm -rf build"})])
    model_server.script(poll, poll, poll, poll, *varied, *[denied] * 6, Reply(content="gave up"))
    agent = make_agent(model_server, tmp_path, approver=deny_all, policy="review",
                       repeat_limit=3)
    agent.gate.reviewer = LLMReviewer(agent.model)  # type: ignore[arg-type]  # passes echo
    with pytest.raises(RepeatedCalls, match=r"3 answers in a row .*\(SWARM_REPEAT_LIMIT 3\): "
                                            r"run_cli \{\"command\": \"rm -rf build\"\} -> "
                                            r"denied: this call was not allowed"):
        agent.run("clean up")
    assert len(model_server.requests) == 4 + 4 + 3
    assert problems(agent.messages) == []


def test_reasoning_is_sent_back(model_server: ScriptedModelServer, tmp_path: Path) -> None:
    model_server.script(
        Reply(reasoning="I should list files", tool_calls=[ToolCall("run_cli", {"command": "ls"})]),
        Reply(content="done"),
    )
    make_agent(model_server, tmp_path).run("list")
    assistant = next(m for m in model_server.requests[1]["messages"] if m["role"] == "assistant")
    assert assistant["reasoning_content"] == "I should list files"


def test_session_saved_after_every_step(model_server: ScriptedModelServer, tmp_path: Path,
                                        redis: redis_lib.Redis) -> None:
    store = RedisSessionStore(redis)
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo one"})]),
        Reply(content="answer"),
    )
    agent = make_agent(model_server, tmp_path, store=store)
    agent.run("task")
    loaded = store.load(agent.session.id)
    assert loaded is not None
    assert loaded.messages == agent.messages
    assert loaded.usage["total_tokens"] > 0
    assert [m["role"] for m in loaded.messages] == ["system", "user", "assistant", "tool",
                                                     "assistant"]


def test_typed_tool_and_skill(model_server: ScriptedModelServer, tmp_path: Path) -> None:
    tools = tmp_path / ".swarm" / "tools"
    tools.mkdir(parents=True)
    (tools / "add.py").write_text('"""Add two numbers."""\n\ndef run(a: int, b: int) -> int:\n'
                                  '    return a + b\n')
    skills = tmp_path / ".swarm" / "skills"
    skills.mkdir()
    (skills / "deploy.md").write_text("# How to deploy\nrun make deploy\n")
    model_server.script(
        Reply(tool_calls=[ToolCall("add", {"a": 2, "b": 40}),
                          ToolCall("load_skill", {"name": "deploy"})]),
        Reply(content="42"),
    )
    make_agent(model_server, tmp_path, policy="never").run("add")
    first = model_server.requests[0]
    names = {t["function"]["name"] for t in first["tools"]}
    assert names == {"run_cli", "add", "load_skill"}
    assert "deploy: How to deploy" in first["messages"][0]["content"]
    results = [m["content"] for m in tool_messages(model_server.requests[1])]
    assert results[0] == "42"
    assert "run make deploy" in results[1]


def test_compaction_end_to_end(model_server: ScriptedModelServer, tmp_path: Path) -> None:
    model_server.context_length = 10_000
    big = {"prompt_tokens": 7_600, "completion_tokens": 100, "total_tokens": 7_700}
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo a"}),
                          ToolCall("run_cli", {"command": "echo b"})], usage=big),
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo notes > notes.md"}),
                          ToolCall("leave_memory_hints", {"hints": "notes are in notes.md"})],
              usage=big),
        Reply(content="finished"),
    )
    hints = MemoryHints()
    agent = make_agent(model_server, tmp_path, hints=hints)
    assert agent.run("the task") == "finished"
    first, second, third = model_server.requests
    assert "leave_memory_hints" not in {t["function"]["name"] for t in first["tools"]}
    assert second["messages"][-1]["content"] == compaction.EMERGENCY
    assert "leave_memory_hints" in {t["function"]["name"] for t in second["tools"]}
    assert hints.text == "notes are in notes.md"
    assert (tmp_path / "notes.md").exists()
    msgs = third["messages"]
    assert "notes are in notes.md" in msgs[0]["content"]
    assert compaction.NOTE in msgs[1]["content"] and "the task" in msgs[1]["content"]
    assert problems(msgs) == []
    assert "leave_memory_hints" not in {t["function"]["name"] for t in third["tools"]}


def test_a_task_too_large_for_the_context_is_refused_before_any_model_call(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    """The check every task passes (a terminal's, a job's, a child's message): over
    compact_at of the context it is refused, nothing added or sent; over half, a notice."""
    model_server.context_length = 10_000
    model_server.script(Reply(content="done"))
    notices: list[str] = []

    class Notices(Observer):
        def on_notice(self, text: str) -> None:
            notices.append(text)

    agent = make_agent(model_server, tmp_path, observer=Notices())
    with pytest.raises(TaskTooLarge, match=r"about 7,500 tokens .* at most 7,500 of the 10,000"):
        agent.run("z" * 30_000)
    assert model_server.requests == [] and agent.messages == [] and notices == []
    assert agent.run("z" * 24_000) == "done"
    assert notices == ["the task takes about 6,000 tokens, 60% of the model's 10,000-token "
                       "context: little is left to work in before the conversation is "
                       "compacted (material in a file in the workspace, which the agent reads "
                       "as it needs, costs less)"]
class LyingModel:
    """A Model (not an LLMClient, so nothing checks its figures) whose every answer claims
    10^12 prompt tokens."""

    def __init__(self, inner: LLMClient) -> None:
        self.inner, self.model = inner, inner.model

    def context_length(self) -> int:
        return self.inner.context_length()

    def chat(self, messages: list[Message], tools: list[dict[str, Any]] | None = None, *,
             on_event: OnEvent | None = None, temperature: float | None = None,
             stream: bool | None = None) -> ChatResult:
        result = self.inner.chat(messages, tools, on_event=on_event)
        result.usage = Usage(10**12, 1, 10**12 + 1)
        return result


def test_no_figure_alone_compacts_the_conversation(model_server: ScriptedModelServer,
                                                   tmp_path: Path) -> None:
    # A context the history fills a small part of, even at a token a byte.
    model_server.context_length = 50_000
    model_server.script(Reply("first answer"),
                        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo a"})]),
                        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo b"})]),
                        Reply("done"))
    notices: list[str] = []
    observer = Observer()
    observer.on_notice = notices.append  # type: ignore[method-assign]
    agent = make_agent(model_server, tmp_path, observer=observer)
    agent.model = LyingModel(agent.model)  # type: ignore[arg-type]
    assert agent.run("the first task") == "first answer"
    assert agent.run("the second task") == "done"
    contents = [m.get("content") for m in agent.messages]
    assert contents[1:3] == ["the first task", "first answer"]
    assert compaction.EMERGENCY not in contents and notices == []


class Unencodable:
    """A value ``json.dumps`` refuses: a history holding it fails where it is encoded."""


class History:
    """What :func:`context.used_tokens` reads of an agent; its tools encode to ``tools``
    bytes, or fail the test when asked for (None)."""

    def __init__(self, messages: list[Message], tools: int | None = None) -> None:
        self.messages, self.tools = messages, tools

    @property
    def tools_bytes(self) -> int:
        assert self.tools is not None, "the tools were encoded"
        return self.tools


def test_a_plausible_token_count_encodes_neither_the_history_nor_the_tools() -> None:
    # It was encoded after every model call and tool result (7 times a child of 3 commands).
    history = History([{"role": "user", "content": "x" * 40_000, "odd": Unencodable()}])
    result = ChatResult({"role": "assistant", "content": "ok"}, Usage(30_000, 10, 30_010))
    assert context.used_tokens(history, result) == 30_010  # type: ignore[arg-type]
    # A count the history's bytes cannot hold is still capped by them.
    messages: list[Message] = [{"role": "user", "content": "x" * 100}]
    result.usage = Usage(10**12, 1, 10**12 + 1)
    cap = len(json.dumps(messages).encode()) + 300 + TOKENS_BEYOND_BYTES
    assert context.used_tokens(History(messages, 300), result) == cap  # type: ignore[arg-type]


def test_a_cut_answer_is_told_to_the_model_with_its_tool_results(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    model_server.script(Reply("a" * 200, [ToolCall("run_cli", {"command": "echo hi"}),
                                          ToolCall("run_cli", {"command": "b" * 5000})]),
                        Reply("done"))
    notices: list[str] = []
    observer = Observer()
    observer.on_notice = notices.append  # type: ignore[method-assign]
    agent = make_agent(model_server, tmp_path, observer=observer)
    agent.model = client_for(model_server, answer_max=1000)
    assert agent.run("go") == "done"
    cut = "cut at 1,000 characters (SWARM_ANSWER_MAX=1000)"
    answer, result = model_server.requests[1]["messages"][-2:]
    assert answer["content"].endswith(f"[swarm: this answer was {cut}; the rest of it was "
                                      "dropped, with its unfinished call of run_cli]")
    assert len(answer["tool_calls"]) == 1  # the call cut short was not run
    assert result["content"] == ("hi\n[exit code: 0]\n\n[swarm: your last answer was "
                                 f"{cut}: the rest of it was dropped. Keep answers shorter; "
                                 "write long output to files.]")
    assert notices == [f"the model's answer was {cut}; the rest of it was dropped"]
    assert problems(model_server.requests[1]["messages"]) == []


def test_a_429_closes_the_shared_rate_gate(model_server: ScriptedModelServer,
                                          redis: redis_lib.Redis) -> None:
    import time

    from swarm.llm.client import LLMClient
    from swarm.store import keys
    from swarm.store.gate import RedisRateGate
    from swarm.testing.server import Fault

    model_server.script(Fault(status=429, retry_after=1), Reply(content="ok"))
    client = LLMClient(model_server.base_url, model_server.models[0], retries=2, backoff_max=5)
    client.gate = RedisRateGate(redis, "s-test")
    seconds, micros = redis.time()
    before = seconds + micros / 1e6
    assert client.chat([{"role": "user", "content": "hi"}]).content == "ok"
    closed_until = float(redis.get(keys.rate_gate("s-test")) or 0)
    seconds, micros = redis.time()
    # Retry-After: 1 s, for all, on the server's clock
    assert before + 0.9 <= closed_until <= seconds + micros / 1e6 + 1.1
    # Another client of the same swarm holds until the gate opens.
    other = RedisRateGate(redis, "s-test")
    other.pause(0.5)
    started = time.monotonic()
    other.wait()
    assert time.monotonic() - started >= 0.4


def test_concurrent_pauses_keep_the_latest_closing_time(redis: redis_lib.Redis) -> None:
    """Two children told to back off at once: the gate closes for the longer of the two,
    whatever order their writes land in (a pause never shortens it)."""
    import threading

    from swarm.store import keys
    from swarm.store.gate import RedisRateGate

    gates = [RedisRateGate(redis, "s-race") for _ in range(16)]
    threads = [threading.Thread(target=g.pause, args=(1.0 + (i % 2) * 29.0,))
               for i, g in enumerate(gates)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds, micros = redis.time()
    left = float(redis.get(keys.rate_gate("s-race")) or 0) - (seconds + micros / 1e6)
    assert 28 < left <= 30
    RedisRateGate(redis, "s-race").pause(1.0)  # a shorter pause later changes nothing
    assert float(redis.get(keys.rate_gate("s-race")) or 0) - (seconds + micros / 1e6) > 28


# -- Ctrl-C: every call of the step is answered, the session is whole and saved -------------

#: A command that sends the agent's process a real SIGINT (Ctrl-C) while it runs.
CTRL_C = "kill -INT $PPID; sleep 30"


def expect_interrupted(run: Callable[[], object]) -> None:
    """``run()`` must raise Interrupted; a KeyboardInterrupt getting out fails the test
    (instead of stopping the whole session). Ctrl-C raises KeyboardInterrupt here even
    where the test session was started with SIGINT ignored (a shell's background job:
    Python then leaves it ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run()
    except Interrupted as exc:
        assert str(exc) == "interrupted by the user"
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C got out of the loop as KeyboardInterrupt, not Interrupted")
    else:
        pytest.fail("the run was not interrupted")
    finally:
        signal.signal(signal.SIGINT, before)


class RecordingSpawner:
    def __init__(self) -> None:
        self.submitted: list[str] = []

    def request_id(self, turn: int, calls: list[SpawnCall]) -> str:
        return f"q{turn}"

    def submit(self, request_id: str, turn: int, calls: list[SpawnCall],
               results: dict[str, str]) -> None:
        self.submitted.append(request_id)


def test_ctrl_c_in_a_command_answers_the_rest_as_interrupted(
        model_server: ScriptedModelServer, tmp_path: Path, redis: redis_lib.Redis) -> None:
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo first"}, id="a"),
                          ToolCall("run_cli", {"command": CTRL_C}, id="b"),
                          ToolCall("run_cli", {"command": "touch never"}, id="c")]),
        Reply(content="carrying on"),
    )
    store = RedisSessionStore(redis)
    agent = make_agent(model_server, tmp_path, store=store)
    expect_interrupted(lambda: agent.run("three commands"))
    assert not (tmp_path / "never").exists()
    saved = store.load(agent.session.id)
    assert saved is not None and problems(saved.messages) == []
    results = {m["tool_call_id"]: m["content"] for m in saved.messages if m["role"] == "tool"}
    assert "first" in results["a"]
    assert results["b"] == results["c"] == INTERRUPTED_BY_USER
    assert agent.run("go on") == "carrying on"  # the next run's history is whole


def test_ctrl_c_beside_agent_calls_answers_them_all_and_does_not_park(
        model_server: ScriptedModelServer, tmp_path: Path, redis: redis_lib.Redis) -> None:
    model_server.script(Reply(tool_calls=[
        ToolCall("agent", {"message": "child work"}, id="kid"),
        ToolCall("run_cli", {"command": "echo ran"}, id="a"),
        ToolCall("run_cli", {"command": CTRL_C}, id="b"),
    ]))
    store = RedisSessionStore(redis)
    spawner = RecordingSpawner()
    agent = make_agent(model_server, tmp_path, store=store)
    agent.spawner = spawner
    expect_interrupted(lambda: agent.run("fan out"))
    assert spawner.submitted == []
    saved = store.load(agent.session.id)
    assert saved is not None and not saved.parked and problems(saved.messages) == []
    results = [(m["tool_call_id"], m["content"]) for m in saved.messages if m["role"] == "tool"]
    assert [call for call, _ in results] == ["kid", "a", "b"]  # in the calls' order
    assert results[0][1] == results[2][1] == INTERRUPTED_BY_USER
    assert "ran" in results[1][1]


class CtrlCWhileStreaming(Observer):
    def on_event(self, event: StreamEvent) -> None:
        raise KeyboardInterrupt


def test_ctrl_c_during_the_model_call_raises_interrupted(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    model_server.script(Reply(content="an answer that never arrives whole"))
    agent = make_agent(model_server, tmp_path, observer=CtrlCWhileStreaming())
    expect_interrupted(lambda: agent.run("hello"))
    assert agent.messages[-1] == {"role": "user", "content": "hello"}


# -- build_agent: any Model, and the seams given to the constructor ------------------------

class CountingModel:
    """A Model that is not an LLMClient: build_agent takes the protocol."""

    def __init__(self, inner: LLMClient) -> None:
        self.inner, self.model, self.calls = inner, inner.model, 0

    def context_length(self) -> int:
        return self.inner.context_length()

    def chat(self, messages: list[Message], tools: list[dict[str, Any]] | None = None, *,
             on_event: OnEvent | None = None, temperature: float | None = None,
             stream: bool | None = None) -> ChatResult:
        self.calls += 1
        return self.inner.chat(messages, tools, on_event=on_event, temperature=temperature,
                               stream=stream)


def test_build_agent_takes_any_model_and_its_seams(model_server: ScriptedModelServer,
                                                   tmp_path: Path) -> None:
    model_server.script(Reply(tool_calls=[ToolCall("run_cli", {"command": "true"})]),
                        Reply(content="done"))
    settings = Settings(base_url=model_server.base_url, model=model_server.models[0], yes=True)
    model = CountingModel(client_for(model_server))
    steps: list[int] = []
    saves: list[int] = []

    def before_step(agent: Agent) -> None:
        steps.append(len(agent.messages))
        if len(steps) == 2:
            agent.messages.append({"role": "user", "content": "NOTE from before_step"})

    agent = build_agent(settings, tmp_path, model, new_session(tmp_path), store=None,
                        hints=MemoryHints(), approver=approve_all, before_step=before_step,
                        guard=lambda: saves.append(1))
    assert agent.run("go") == "done"
    assert model.calls == 2 and len(steps) == 2
    assert model_server.requests[1]["messages"][-1]["content"] == "NOTE from before_step"
    assert len(saves) >= 3  # the task, the model's two messages, the tool result


def test_a_guard_that_raises_stops_the_agent_before_it_saves(
        model_server: ScriptedModelServer, tmp_path: Path, redis: redis_lib.Redis) -> None:
    model_server.script(Reply(content="never saved"))
    settings = Settings(base_url=model_server.base_url, model=model_server.models[0])
    store = RedisSessionStore(redis)

    def lost() -> None:
        raise LockError("lost the lock")

    agent = build_agent(settings, tmp_path, client_for(model_server), new_session(tmp_path),
                        store=store, hints=MemoryHints(), approver=approve_all, guard=lost)
    with pytest.raises(LockError):
        agent.run("go")
    assert store.load(agent.session.id) is None
    assert model_server.requests == []  # it stopped at the first save, the task's
