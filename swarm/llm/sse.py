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
    UTF-8 are replaced (U+FFFD), and :attr:`replaced` says so. A leading byte-order mark
    is dropped. A long line costs its length, not its length times its chunks.
    """

    def __init__(self) -> None:
        self._buffer: list[str] = []
        self.pending = 0
        """Characters of the unterminated line so far."""
        self.replaced = False
        """Some bytes were not UTF-8 (each such sequence became U+FFFD)."""
        self._after_cr = False
        self._started = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    def _text(self, chunk: bytes, final: bool = False) -> str:
        try:
            return self._utf8.decode(chunk, final)
        except UnicodeDecodeError as exc:
            # Decode what the decoder held plus the chunk again, replacing; an unfinished
            # character at the end stays held for the next chunk.
            self.replaced = True
            again = codecs.getincrementaldecoder("utf-8")(errors="replace")
            text = again.decode(exc.object, final)
            self._utf8.setstate(again.getstate())
            return text

    def decode(self, chunk: bytes | str) -> list[str]:
        """The lines completed by ``chunk``, without their line endings."""
        text = self._text(chunk) if isinstance(chunk, bytes) else chunk
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
        parts = _NEWLINE.split(text)
        self._buffer.append(parts[0])
        if len(parts) == 1:
            self.pending += len(text)
            return []
        parts[0] = "".join(self._buffer)
        self._buffer = [parts.pop()]
        self.pending = len(self._buffer[0])
        self._after_cr = text.endswith("\r")
        return parts

    def flush(self) -> list[str]:
        """The unterminated last line, if any; resets the decoder."""
        tail = "".join(self._buffer) + self._text(b"", final=True)
        self._buffer = []
        self.pending = 0
        self._after_cr = False
        return [tail] if tail else []

    def partial(self) -> str:
        """The unterminated line so far (without taking it)."""
        return "".join(self._buffer)


class SSEDecoder:
    """Turn lines into events: ``decode(line)`` returns an event when a blank line ends one."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self.pending = 0
        """Characters of data of the event being read."""
        self._last_event_id = ""
        self._retry: int | None = None

    def partial(self, line: str = "") -> str:
        """The data of the event being read, with ``line`` (unfinished) if it is data."""
        name, colon, value = line.partition(":")
        data = [*self._data, value.removeprefix(" ")] if colon and name == "data" \
            else self._data
        return "\n".join(data)

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
            self.pending += len(value) + 1
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
            self.pending = 0
            return None
        event = ServerSentEvent(
            event=self._event or "message",
            data="\n".join(self._data),
            id=self._last_event_id,
            retry=self._retry,
        )
        self._event = ""
        self._data = []
        self.pending = 0
        self._retry = None
        return event


class EventTooLarge(Exception):
    """An event grew past the size it may have; ``data`` is its data so far."""

    def __init__(self, data: str, limit: int) -> None:
        super().__init__(f"an event of more than {limit:,} characters")
        self.data = data


def iter_events(
    chunks: Iterable[bytes | str], flush_incomplete: bool = False, *, max_event: int = 0,
    lines: LineDecoder | None = None,
) -> Iterator[ServerSentEvent]:
    """Every event in a stream of chunks.

    Per the spec an event not ended by a blank line is dropped at the end of the stream;
    with ``flush_incomplete`` it counts (model servers that close right after a last
    ``data: [DONE]`` line without its blank line). An event (or a line) that grows past
    ``max_event`` characters (0: no limit) raises :class:`EventTooLarge` with the start of
    its data. ``lines``: the decoder to split with (to read its :attr:`~LineDecoder.replaced`).
    """
    lines = lines or LineDecoder()
    decoder = SSEDecoder()
    for chunk in chunks:
        for line in lines.decode(chunk):
            event = decoder.decode(line)
            if event is not None:
                yield event
            elif max_event and decoder.pending > max_event:
                raise EventTooLarge(decoder.partial()[:max_event], max_event)
        if max_event and lines.pending + decoder.pending > max_event:
            raise EventTooLarge(decoder.partial(lines.partial())[:max_event], max_event)
    for line in lines.flush():
        decoder.decode(line)  # not blank, so it never ends an event by itself
    if flush_incomplete:
        event = decoder.decode("")
        if event is not None:
            yield event
