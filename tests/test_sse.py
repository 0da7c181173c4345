"""The pure SSE decoder: line splitting across chunks and the event stream rules."""

from __future__ import annotations

import pytest

from swarm.llm.sse import EventTooLarge, LineDecoder, ServerSentEvent, SSEDecoder, iter_events

# Every line ending, multi-line data, a comment, an id, a retry, a named event,
# a field without colon, and multi-byte UTF-8 characters.
STREAM = (
    ": keep-alive comment\n"
    "data: {\"a\": 1}\n\n"
    "event: update\r\n"
    "id: 7\r\n"
    "data: first line\r\n"
    "data:second line\r\n"
    "data:  two spaces\r\n"
    "\r\n"
    "retry: 1500\r"
    "data: héllo ✓ 🐝\r"
    "\r"
    "data\n"
    "\n"
    "data: [DONE]\n\n"
).encode()

EXPECTED = [
    ServerSentEvent(data='{"a": 1}'),
    ServerSentEvent(event="update", data="first line\nsecond line\n two spaces", id="7"),
    ServerSentEvent(data="héllo ✓ 🐝", id="7", retry=1500),
    ServerSentEvent(data="", id="7"),
    ServerSentEvent(data="[DONE]", id="7"),
]


def decode(chunks: list[bytes]) -> list[ServerSentEvent]:
    return list(iter_events(chunks))


def test_whole_stream() -> None:
    assert decode([STREAM]) == EXPECTED


def test_split_at_every_byte_position() -> None:
    for cut in range(len(STREAM) + 1):
        assert decode([STREAM[:cut], STREAM[cut:]]) == EXPECTED, f"split at byte {cut}"


def test_split_at_every_pair_of_positions() -> None:
    n = len(STREAM)
    for i in range(0, n + 1, 3):
        for j in range(i, n + 1, 5):
            assert decode([STREAM[:i], STREAM[i:j], STREAM[j:]]) == EXPECTED, (i, j)


def test_one_byte_at_a_time() -> None:
    assert decode([STREAM[i:i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_crlf_split_across_chunks_is_one_line_ending() -> None:
    lines = LineDecoder()
    assert lines.decode(b"data: a\r") == ["data: a"]
    # The "\n" completes the CRLF above; only the following "\r\n" is a blank line.
    assert lines.decode(b"\n") == []
    assert lines.decode(b"\r\n") == [""]
    assert decode([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]) == [
        ServerSentEvent(data="a\nb")
    ]


def test_lone_cr_then_cr_is_a_blank_line() -> None:
    lines = LineDecoder()
    assert lines.decode("data: x\r") == ["data: x"]
    assert lines.decode("\r") == [""]


def test_text_chunks_and_flush() -> None:
    lines = LineDecoder()
    assert lines.decode("a\nb") == ["a"]
    assert lines.decode("c") == []
    assert lines.flush() == ["bc"]
    assert lines.flush() == []


def test_utf8_character_split_across_chunks() -> None:
    data = "data: ✓\n\n".encode()
    split = data.index("✓".encode()) + 1
    assert decode([data[:split], data[split:]]) == [ServerSentEvent(data="✓")]


def test_invalid_utf8_is_replaced() -> None:
    assert decode([b"data: \xff\n\n"]) == [ServerSentEvent(data="\ufffd")]


def test_byte_order_mark_dropped() -> None:
    assert decode([b"\xef\xbb", b"\xbfdata: x\n\n"]) == [ServerSentEvent(data="x")]


def test_comments_and_unknown_fields_ignored() -> None:
    assert decode([b":ping\n:\nfoo: bar\ndata: x\n: inside\n\n"]) == [ServerSentEvent(data="x")]


def test_blank_line_without_data_dispatches_nothing() -> None:
    decoder = SSEDecoder()
    assert decoder.decode("event: lonely") is None
    assert decoder.decode("") is None
    # The event type of the dropped block does not leak into the next event.
    decoder.decode("data: y")
    assert decoder.decode("") == ServerSentEvent(data="y")


def test_id_persists_and_nul_id_ignored() -> None:
    events = decode([b"id: 1\ndata: a\n\ndata: b\n\nid: x\0y\ndata: c\n\nid\ndata: d\n\n"])
    assert [e.id for e in events] == ["1", "1", "1", ""]


@pytest.mark.parametrize("value", ["abc", "1.5", "-1", "", "٣"])
def test_retry_must_be_ascii_digits(value: str) -> None:
    decoder = SSEDecoder()
    decoder.decode(f"retry: {value}")
    decoder.decode("data: x")
    event = decoder.decode("")
    assert event is not None and event.retry is None


def test_unterminated_last_event_is_dropped() -> None:
    assert decode([b"data: a\n\ndata: b"]) == [ServerSentEvent(data="a")]
    assert decode([b"data: a\n\ndata: b\n"]) == [ServerSentEvent(data="a")]


@pytest.mark.parametrize("tail", [b"data: b", b"data: b\n", b"data: b\r", b"data: b\r\n"])
def test_flush_incomplete_keeps_the_unterminated_last_event(tail: bytes) -> None:
    stream = b"data: a\n\n" + tail
    for cut in range(len(stream) + 1):
        events = list(iter_events([stream[:cut], stream[cut:]], flush_incomplete=True))
        assert events == [ServerSentEvent(data="a"), ServerSentEvent(data="b")], cut


def test_flush_incomplete_adds_nothing_to_a_finished_stream() -> None:
    assert list(iter_events([STREAM], flush_incomplete=True)) == EXPECTED
    assert list(iter_events([b"data: a\n\n: comment\nevent: x"], flush_incomplete=True)) == [
        ServerSentEvent(data="a")]


def test_json() -> None:
    assert ServerSentEvent(data='{"x": [1]}').json() == {"x": [1]}
    with pytest.raises(ValueError):
        ServerSentEvent(data="{broken").json()


def test_bytes_that_are_not_utf8_are_replaced_and_told_across_chunks() -> None:
    lines = LineDecoder()
    stream = b"data: caf\xe9 ok \xe2\x9c\x93 \xff\n\n"
    got = [line for i in range(len(stream)) for line in lines.decode(stream[i:i + 1])]
    assert got == ["data: caf\ufffd ok \u2713 \ufffd", ""] and lines.replaced
    clean = LineDecoder()
    assert clean.decode("data: ✓\n".encode()[:7]) == [] and not clean.replaced
    assert clean.decode("data: ✓\n".encode()[7:]) == ["data: ✓"] and not clean.replaced


def test_an_event_past_its_bound_stops_the_stream_with_its_start() -> None:
    with pytest.raises(EventTooLarge) as info:
        list(iter_events([b"data: {\"a\": \"", b"x" * 5000, b"x" * 5000], max_event=8000))
    assert info.value.data == '{"a": "' + "x" * 7993
    events = iter_events([b"data: 1\n", b"data: 2\n"] * 3000 + [b"\n"], max_event=1000)
    with pytest.raises(EventTooLarge):  # many lines of one event count together
        list(events)
    assert [e.data for e in iter_events([b"data: short\n\n"] * 500, max_event=100)] == \
        ["short"] * 500
