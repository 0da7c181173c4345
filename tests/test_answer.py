"""Tool-call and message assembly from chat.completion.chunk deltas, in several dialects."""

from __future__ import annotations

import json
from typing import Any

import pytest

from swarm.domain.messages import StreamEvent
from swarm.errors import ModelResponseError
from swarm.llm.answer import MessageAssembler, from_completion


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def calls(*parts: dict[str, Any]) -> dict[str, Any]:
    return chunk({"tool_calls": list(parts)})


def assemble(chunks: list[dict[str, Any]]) -> tuple[MessageAssembler, list[StreamEvent]]:
    events: list[StreamEvent] = []
    assembler = MessageAssembler(on_event=events.append)
    for c in chunks:
        assembler.feed(c)
    return assembler, events


def test_text_answer() -> None:
    assembler, events = assemble([
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk({}, "stop"),
    ])
    result = assembler.result()
    assert result.message == {"role": "assistant", "content": "Hello"}
    assert result.finish_reason == "stop"
    assert events == [StreamEvent("content", "Hel"), StreamEvent("content", "lo")]


def test_openai_style_tool_call() -> None:
    assembler, events = assemble([
        chunk({"role": "assistant", "content": None}),
        calls({"index": 0, "id": "call_abc", "type": "function",
               "function": {"name": "run_cli", "arguments": ""}}),
        calls({"index": 0, "function": {"arguments": '{"comm'}}),
        calls({"index": 0, "function": {"arguments": 'and": "ls"}'}}),
        chunk({}, "tool_calls"),
    ])
    assert assembler.result().message == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_abc", "type": "function",
                        "function": {"name": "run_cli", "arguments": '{"command": "ls"}'}}],
    }
    assert events == [StreamEvent("tool_call", "run_cli")]


def test_llamacpp_style_first_delta_carries_first_argument_piece() -> None:
    call_id = "Xq3kP0aZ9mB2cD4eF6gH8iJ1kL3mN5oP"
    assembler, _ = assemble([
        calls({"index": 0, "id": call_id, "type": "function",
               "function": {"name": "run_cli", "arguments": '{"command"'}}),
        calls({"index": 0, "function": {"arguments": ': "pwd"}'}}),
        chunk({}, "tool_calls"),
    ])
    (call,) = assembler.result().tool_calls
    assert call["id"] == call_id  # kept as is: the tool result must echo it
    assert json.loads(call["function"]["arguments"]) == {"command": "pwd"}


def test_two_parallel_calls_interleaved_by_index() -> None:
    assembler, events = assemble([
        chunk({"content": "Running both."}),
        calls({"index": 0, "id": "call_a", "type": "function",
               "function": {"name": "run_cli", "arguments": ""}}),
        calls({"index": 1, "id": "call_b", "type": "function",
               "function": {"name": "agent", "arguments": '{"mes'}}),
        calls({"index": 0, "function": {"arguments": '{"command": '}}),
        calls({"index": 1, "function": {"arguments": 'sage": "hi"}'}}),
        calls({"index": 0, "function": {"arguments": '"ls"}'}}),
        chunk({}, "tool_calls"),
    ])
    message = assembler.result().message
    assert message["content"] == "Running both."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [
        ("call_a", "run_cli", {"command": "ls"}),
        ("call_b", "agent", {"message": "hi"}),
    ]
    assert [e for e in events if e.kind == "tool_call"] == [
        StreamEvent("tool_call", "run_cli"), StreamEvent("tool_call", "agent")]


def test_missing_index_falls_back_to_id_then_to_the_latest_call() -> None:
    assembler, _ = assemble([
        calls({"id": "a", "function": {"name": "one", "arguments": '{"x"'}}),
        calls({"function": {"arguments": ": 1}"}}),
        calls({"id": "b", "function": {"name": "two", "arguments": "{"}}),
        calls({"id": "b", "function": {"arguments": "}"}}),
        chunk({}, "tool_calls"),
    ])
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in assembler.result().tool_calls] == [
        ("a", "one", '{"x": 1}'), ("b", "two", "{}")]


def test_several_whole_calls_in_one_delta_without_index_or_id() -> None:
    assembler, _ = assemble([
        calls({"function": {"name": "one", "arguments": "{}"}},
              {"function": {"name": "two", "arguments": '{"y": 2}'}}),
        chunk({}, "tool_calls"),
    ])
    result = assembler.result().tool_calls
    assert [c["function"]["name"] for c in result] == ["one", "two"]
    # A call without an id gets one, so the tool result can refer to it.
    assert all(c["id"].startswith("call_") for c in result)
    assert result[0]["id"] != result[1]["id"]


def test_same_index_with_a_new_id_is_a_new_call() -> None:
    assembler, _ = assemble([
        calls({"index": 0, "id": "a", "function": {"name": "one", "arguments": "{}"}}),
        calls({"index": 0, "id": "b", "function": {"name": "two", "arguments": "{}"}}),
    ])
    assert [c["id"] for c in assembler.result().tool_calls] == ["a", "b"]


def test_repeated_name_and_id_are_not_doubled_and_dict_arguments_are_json() -> None:
    assembler, events = assemble([
        calls({"index": 0, "id": "a", "function": {"name": "run_cli"}}),
        calls({"index": 0, "id": "a", "function": {"name": "run_cli",
                                                    "arguments": {"command": "ls"}}}),
    ])
    (call,) = assembler.result().tool_calls
    assert call == {"id": "a", "type": "function",
                    "function": {"name": "run_cli", "arguments": '{"command": "ls"}'}}
    assert events == [StreamEvent("tool_call", "run_cli")]


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_kept_under_the_providers_key(key: str) -> None:
    assembler, events = assemble([
        chunk({key: "Let me "}), chunk({key: "think."}),
        chunk({"content": "42"}), chunk({}, "stop"),
    ])
    assert assembler.result().message == {"role": "assistant", "content": "42",
                                          key: "Let me think."}
    assert events == [StreamEvent("reasoning", "Let me "), StreamEvent("reasoning", "think."),
                      StreamEvent("content", "42")]


def test_reasoning_sent_under_both_names_is_not_doubled() -> None:
    assembler, _ = assemble([chunk({"reasoning_content": "hm", "reasoning": "hm"})])
    assert assembler.result().message == {"role": "assistant", "content": "",
                                          "reasoning_content": "hm"}


def test_usage_chunk_with_empty_choices() -> None:
    assembler, _ = assemble([
        chunk({"content": "hi"}), chunk({}, "stop"),
        {"object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}},
    ])
    result = assembler.result()
    assert result.usage.as_dict() == {"prompt_tokens": 11, "completion_tokens": 2,
                                      "total_tokens": 13}
    assert result.finish_reason == "stop" and result.content == "hi"


def test_null_usage_on_every_chunk_is_ignored() -> None:
    assembler, _ = assemble([{**chunk({"content": "x"}), "usage": None}])
    assert assembler.result().usage.total_tokens == 0


def test_error_chunk_raises() -> None:
    with pytest.raises(ModelResponseError, match="overloaded"):
        assemble([chunk({"content": "a"}), {"error": {"message": "provider overloaded"}}])


def test_from_completion_matches_the_streamed_shape() -> None:
    result = from_completion({
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "", "reasoning_content": "plan",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "run_cli", "arguments": '{"command": "ls"}'}},
                           {"id": "call_2", "type": "function",
                            "function": {"name": "run_cli", "arguments": ""}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    })
    assert result.message == {
        "role": "assistant", "content": None, "reasoning_content": "plan",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "run_cli", "arguments": '{"command": "ls"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "run_cli", "arguments": "{}"}},
        ],
    }
    assert result.usage.total_tokens == 8
    assert result.finish_reason == "tool_calls"


def test_from_completion_text_and_events() -> None:
    events: list[StreamEvent] = []
    result = from_completion({"choices": [{"message": {"role": "assistant", "content": "hi"},
                                           "finish_reason": "stop"}]}, events.append)
    assert result.message == {"role": "assistant", "content": "hi"}
    assert events == [StreamEvent("content", "hi")]


@pytest.mark.parametrize("data", [[], {"choices": []}, {"choices": [{"text": "x"}]},
                                  {"error": {"message": "nope"}}])
def test_from_completion_rejects_answers_without_a_message(data: Any) -> None:
    with pytest.raises(ModelResponseError):
        from_completion(data)


def test_a_new_index_repeating_an_id_is_a_new_call_with_a_unique_id() -> None:
    assembler, events = assemble([
        calls({"index": 0, "id": "call_0", "function": {"name": "one", "arguments": '{"a"'}}),
        calls({"index": 1, "id": "call_0", "function": {"name": "two", "arguments": '{"b"'}}),
        calls({"index": 0, "function": {"arguments": ": 1}"}}),
        calls({"index": 1, "function": {"arguments": ": 2}"}}),
        chunk({}, "tool_calls"),
    ])
    tool_calls = assembler.result().tool_calls
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls] == [
        ("one", '{"a": 1}'), ("two", '{"b": 2}')]
    assert tool_calls[0]["id"] == "call_0"
    assert tool_calls[1]["id"].startswith("call_") and tool_calls[1]["id"] != "call_0"
    assert events == [StreamEvent("tool_call", "one"), StreamEvent("tool_call", "two")]


def test_a_surrogate_pair_split_across_chunks_joins_and_lone_halves_are_replaced() -> None:
    # json.loads turns the escapes "\ud83d" and "\ude00" of two chunks into lone surrogates.
    wire = [chunk({"reasoning_content": "think \ud83d"}), chunk({"reasoning_content": "\ude00"}),
            chunk({"content": "smile \ud83d"}), chunk({"content": "\ude00 lone \udc00"}),
            calls({"index": 0, "id": "a", "function": {"name": "run_cli",
                                                      "arguments": '{"c": "\ud83d'}}),
            calls({"index": 0, "function": {"arguments": '\ude00 \ud800"}'}}),
            chunk({}, "tool_calls")]
    assembler, events = assemble([json.loads(json.dumps(c)) for c in wire])
    message = assembler.result().message
    assert message["reasoning_content"] == "think \U0001f600"
    assert message["content"] == "smile \U0001f600 lone \ufffd"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"c": "\U0001f600 \ufffd"}'
    json.dumps(message, ensure_ascii=False).encode()  # saving and sending need valid UTF-8
    shown = "".join(e.text for e in events if e.kind == "content")
    assert shown == "smile \U0001f600 lone \ufffd"
    for event in events:
        event.text.encode()


@pytest.mark.parametrize("garbage", [
    {"choices": 5},
    {"choices": [{"index": 0, "delta": {"content": "ok", "tool_calls": 7}}]},
])
def test_malformed_parts_of_a_chunk_are_ignored(garbage: dict[str, Any]) -> None:
    assembler = MessageAssembler()
    assembler.feed(garbage)
    assert assembler.result().message["role"] == "assistant"


def test_a_chunk_that_cannot_be_read_is_a_model_response_error() -> None:
    events: list[StreamEvent] = []
    assembler = MessageAssembler(on_event=events.append)
    unserialisable = {"index": 0, "function": {"name": "x", "arguments": {"a": {1, 2}}}}
    with pytest.raises(ModelResponseError, match=r"cannot be read.*TypeError"):
        assembler.feed(chunk({"content": "seen?", "tool_calls": [unserialisable]}))
    assert events == []


def test_garbage_usage_counts_as_zero() -> None:
    assembler, _ = assemble([
        chunk({"content": "x"}, "stop"),
        {"choices": [], "usage": {"prompt_tokens": "n/a", "completion_tokens": {},
                                  "total_tokens": None}},
    ])
    assert assembler.result().usage.as_dict() == {"prompt_tokens": 0, "completion_tokens": 0,
                                                  "total_tokens": 0}
    result = from_completion({"choices": [{"message": {"content": "y"}}],
                              "usage": {"prompt_tokens": "7", "completion_tokens": [1]}})
    assert result.usage.as_dict() == {"prompt_tokens": 7, "completion_tokens": 0,
                                      "total_tokens": 7}


def test_an_exception_of_on_event_passes_through_unchanged() -> None:
    def boom(event: StreamEvent) -> None:
        raise ValueError("renderer bug")

    with pytest.raises(ValueError, match="renderer bug"):
        MessageAssembler(on_event=boom).feed(chunk({"content": "x"}))
