"""Compaction keeps every tool result paired with its call, parallel calls included."""

from __future__ import annotations

import json

from swarm.agent import compaction
from swarm.domain.history import problems, repair
from swarm.domain.messages import Message


def call(cid: str, command: str) -> dict[str, object]:
    return {"id": cid, "type": "function",
            "function": {"name": "run_cli", "arguments": json.dumps({"command": command})}}


def conversation(rounds: int, parallel: int = 3, big: int = 1000) -> list[Message]:
    msgs: list[Message] = [{"role": "system", "content": "old system"},
                           {"role": "user", "content": "first task"},
                           {"role": "assistant", "content": "done"},
                           {"role": "user", "content": "the task"}]
    for r in range(rounds):
        ids = [f"r{r}c{i}" for i in range(parallel)]
        msgs.append({"role": "assistant", "content": None,
                     "tool_calls": [call(i, f"cmd {i}") for i in ids]})
        msgs.extend({"role": "tool", "tool_call_id": i, "content": "x" * big} for i in ids)
    return msgs


def test_rebuild_keeps_pairs_valid_with_parallel_calls() -> None:
    msgs = conversation(rounds=20)
    crisis = len(msgs)
    msgs.append({"role": "user", "content": compaction.EMERGENCY})
    msgs.append({"role": "assistant", "content": None,
                 "tool_calls": [call("h1", "save notes"), call("h2", "x")]})
    msgs.append({"role": "tool", "tool_call_id": "h1", "content": "ok"})
    # A budget that forces dropping groups: any cut that split a group would leave orphans.
    for budget in (50, 400, 1000, 5000, 100_000):
        out = compaction.rebuild("NEW SYSTEM", msgs, crisis, budget)
        assert problems(out) == [], budget
        assert out[0] == {"role": "system", "content": "NEW SYSTEM"}
        assert out[1]["role"] == "user"
        assert compaction.NOTE in out[1]["content"] and "the task" in out[1]["content"]
        assert all(m.get("content") != compaction.EMERGENCY for m in out)
        assert "first task" not in json.dumps(out)


def test_tool_results_in_the_tail_are_cut_to_200_chars() -> None:
    msgs = conversation(rounds=2, big=5000)
    out = compaction.rebuild("S", msgs, len(msgs), 100_000)
    tools = [m for m in out if m["role"] == "tool"]
    assert len(tools) == 6
    for m in tools:
        assert m["content"].startswith("x" * 200)
        assert "[... 4800 characters cut]" in m["content"]


def test_budget_drops_oldest_groups_first() -> None:
    msgs = conversation(rounds=10, parallel=1, big=100)
    out = compaction.rebuild("S", msgs, len(msgs), 400)
    ids = [m["tool_call_id"] for m in out if m["role"] == "tool"]
    assert ids and ids[-1] == "r9c0"
    assert "r0c0" not in ids


def test_tail_without_a_leading_user_message_gets_the_note_alone() -> None:
    msgs: list[Message] = [{"role": "assistant", "content": None, "tool_calls": [call("a", "x")]},
                           {"role": "tool", "tool_call_id": "a", "content": "r"}]
    out = compaction.rebuild("S", msgs, 2, 100_000)
    assert out[1] == {"role": "user", "content": compaction.NOTE}
    assert problems(out) == []


def test_repair_answers_dangling_calls_and_drops_orphans() -> None:
    msgs: list[Message] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [call("a", "1"), call("b", "2")]},
        {"role": "tool", "tool_call_id": "b", "content": "two"},
        {"role": "tool", "tool_call_id": "ghost", "content": "?"},
    ]
    assert len(problems(msgs)) == 2
    fixed = repair(msgs)
    assert problems(fixed) == []
    assert [m.get("tool_call_id") for m in fixed[2:]] == ["b", "a"]
    assert "interrupted" in fixed[3]["content"]
