"""A pure Server-Sent Events decoder (WHATWG HTML, "event stream interpretation").

No I/O here: feed byte or text chunks to :class:`LineDecoder`, each line to
:class:`SSEDecoder`, and collect the :class:`ServerSentEvent` objects it returns.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

_NEWLINE = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class ServerSentEvent:
    """One dispatched event."""

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None

    def json(self) -> Any:
        """``data`` parsed as JSON (raises ``ValueError`` when it is not)."""
        return json.loads(self.data)


class LineDecoder:
    """Split byte or text chunks into lines on ``\\n``, ``\\r\\n`` or ``\\r``.

    Lines may be split anywhere across chunks, including between the ``\\r`` and
    ``\\n`` of a CRLF and inside a multi-byte UTF-8 character. Bytes that are not
    UTF-8 are replaced. A leading byte-order mark is dropped.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._after_cr = False
        self._started = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, chunk: bytes | str) -> list[str]:
        """The lines completed by ``chunk``, without their line endings."""
        text = self._utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
        if not text:
            return []
        if not self._started:
            self._started = True
            text = text.removeprefix("\ufeff")
        if self._after_cr:
            # The previous chunk ended in "\r" and that line is already out;
            # a "\n" here is the second half of the same CRLF.
            self._after_cr = False
            text = text.removeprefix("\n")
        parts = _NEWLINE.split(self._buffer + text)
        self._buffer = parts.pop()
        self._after_cr = text.endswith("\r")
        return parts

    def flush(self) -> list[str]:
        """The unterminated last line, if any; resets the decoder."""
        tail = self._buffer + self._utf8.decode(b"", final=True)
        self._buffer = ""
        self._after_cr = False
        return [tail] if tail else []


class SSEDecoder:
    """Turn lines into events: ``decode(line)`` returns an event when a blank line ends one."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._last_event_id = ""
        self._retry: int | None = None

    def decode(self, line: str) -> ServerSentEvent | None:
        """Process one line (without its line ending)."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon:
            value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self._last_event_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        # Per the spec an event without any data line is dropped; the last
        # event id carries over to later events.
        if not self._data:
            self._event = ""
            self._retry = None
            return None
        event = ServerSentEvent(
            event=self._event or "message",
            data="\n".join(self._data),
            id=self._last_event_id,
            retry=self._retry,
        )
        self._event = ""
        self._data = []
        self._retry = None
        return event


def iter_events(
    chunks: Iterable[bytes | str], flush_incomplete: bool = False
) -> Iterator[ServerSentEvent]:
    """Every event in a stream of chunks.

    Per the spec an event not ended by a blank line is dropped at the end of the stream;
    with ``flush_incomplete`` it counts (model servers that close right after a last
    ``data: [DONE]`` line without its blank line).
    """
    lines = LineDecoder()
    decoder = SSEDecoder()
    for chunk in chunks:
        for line in lines.decode(chunk):
            event = decoder.decode(line)
            if event is not None:
                yield event
    for line in lines.flush():
        decoder.decode(line)  # not blank, so it never ends an event by itself
    if flush_incomplete:
        event = decoder.decode("")
        if event is not None:
            yield event
