"""Build one assistant message from ``chat.completion.chunk`` deltas (or a whole completion).

Servers differ in small ways; this module absorbs them so the message stored in
the history is always the same shape::

    {"role": "assistant", "content": str | None,
     "reasoning_content": str,              # only when reasoning came (or "reasoning")
     "tool_calls": [{"id", "type": "function",
                     "function": {"name", "arguments": raw JSON string}}]}  # only when calls came
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from swarm.domain.messages import ChatResult, Message, OnEvent, StreamEvent, Usage
from swarm.errors import ModelResponseError

REASONING_KEYS = ("reasoning_content", "reasoning")
"""Delta fields that carry thinking text: DeepSeek/llama.cpp use the first, vLLM/OpenRouter the
second. The finished message keeps whichever name the provider used, so it goes back as it came."""


@dataclass
class _Call:
    id: str = ""
    type: str = "function"
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    announced: bool = False


class MessageAssembler:
    """Feed parsed stream chunks with :meth:`feed`; take the answer with :meth:`result`.

    ``limit`` (0: none) caps the characters kept of text, thinking, tool names and arguments
    together: what goes over it is dropped (``on_event`` never sees it), :attr:`cut` is
    set, and a tool call cut short is left out of the message. :meth:`cut_here` cuts the
    answer where it stands (its source was cut)."""

    def __init__(self, on_event: OnEvent | None = None, limit: int = 0) -> None:
        self._on_event = on_event
        self.limit = limit
        self.size = 0
        """Characters kept so far."""
        self.cut = False
        self._current: _Call | None = None
        self._dropped: _Call | None = None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._reasoning_key = ""
        self._calls: list[_Call] = []
        self._by_index: dict[int, _Call] = {}
        self._by_id: dict[str, _Call] = {}
        self._events: list[StreamEvent] = []
        self._held: dict[str, str] = {}
        self.finish_reason: str | None = None
        self.usage = Usage()
        self.raw_usage: Any = None
        """The last ``usage`` the server sent, as it came (to be checked)."""

    def feed(self, chunk: dict[str, Any]) -> None:
        """Take one ``chat.completion.chunk``; raise ModelResponseError for an error chunk.

        A chunk is read whole before ``on_event`` sees any of it, so a malformed chunk raises
        ModelResponseError and an exception of ``on_event`` itself passes through unchanged.
        """
        if not isinstance(chunk, dict):
            raise ModelResponseError(f"the model server sent a chunk that is not an object: "
                                     f"{str(chunk)[:200]}")
        if chunk.get("error"):
            raise ModelResponseError(f"the model server reported an error mid-answer: "
                                     f"{_error_text(chunk['error'])}")
        try:
            self._feed_chunk(chunk)
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
            self._events.clear()
            raise ModelResponseError(f"the model server sent a chunk that cannot be read "
                                     f"({type(exc).__name__}: {exc}): {str(chunk)[:200]}") from exc
        events, self._events = self._events, []
        if self._on_event is not None:
            for event in events:
                self._on_event(event)

    def _feed_chunk(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if usage is not None:
            self.raw_usage = usage
            self.usage = Usage.from_dict(usage)
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # we always ask for n=1
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._feed_delta(delta)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])

    def cut_here(self) -> None:
        """End the answer here, as if it went over the limit: a tool call being received is
        left out (its arguments may be unfinished)."""
        if not self.cut:
            self.cut = True
            self._dropped = self._current

    def _take(self, piece: str) -> str:
        """The part of ``piece`` within the limit (cutting the answer there)."""
        if self.cut:
            return ""
        if self.limit and self.size + len(piece) > self.limit:
            piece = piece[:self.limit - self.size]
            self.cut_here()
        self.size += len(piece)
        return piece

    def _feed_delta(self, delta: dict[str, Any]) -> None:
        for key in REASONING_KEYS:
            piece = delta.get(key)
            if isinstance(piece, str) and piece:
                # Some servers send both names with the same text; keep the first name seen.
                if self._reasoning_key and key != self._reasoning_key:
                    continue
                self._current = None
                piece = self._take(piece)
                if piece:
                    self._reasoning_key = key
                    self._reasoning.append(piece)
                    self._emit("reasoning", piece)
        piece = delta.get("content")
        if isinstance(piece, str) and piece:
            self._current = None
            piece = self._take(piece)
            self._content.append(piece)
            if piece:
                self._emit("content", piece)
        parts = delta.get("tool_calls")
        for position, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict):
                self._feed_call(position, part)

    def _feed_call(self, position: int, part: dict[str, Any]) -> None:
        if self.cut:
            return
        call = self._current = self._find_call(position, part)
        call_id = part.get("id")
        if isinstance(call_id, str) and call_id and not call.id:
            call.id = call_id
            self._by_id.setdefault(call_id, call)
        if isinstance(part.get("type"), str) and part["type"]:
            call.type = part["type"]
        function = part.get("function")
        if not isinstance(function, dict):
            return
        name = function.get("name")
        if isinstance(name, str) and name and name != call.name:
            # Names normally arrive whole, once; a server that repeats it must not double it.
            call.name += self._take(name)
        arguments = function.get("arguments")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if isinstance(arguments, str) and arguments:
            call.arguments.append(self._take(arguments))
        if self.cut:
            return
        if call.name and not call.announced:
            call.announced = True
            self._emit("tool_call", _clean(call.name))

    def _find_call(self, position: int, part: dict[str, Any]) -> _Call:
        index = part.get("index")
        raw_id = part.get("id")
        call_id = raw_id if isinstance(raw_id, str) else ""
        if isinstance(index, int) and not isinstance(index, bool):
            call = self._by_index.get(index)
            # A new index is always a new call, even when it repeats the id of another one
            # (ids are made unique in `message`). A new id at a used index is a new call too
            # (servers that send index 0 for every call).
            if call is None or (call_id and call.id and call_id != call.id):
                call = self._by_index[index] = self._new_call()
            return call
        # No index: match by id; a fragment with neither continues the latest call,
        # unless it is not the first fragment of its delta (then it starts another).
        if call_id:
            return self._by_id.get(call_id) or self._new_call()
        if position > 0 or not self._calls:
            return self._new_call()
        return self._calls[-1]

    def _new_call(self) -> _Call:
        call = _Call()
        self._calls.append(call)
        return call

    def _emit(self, kind: Literal["reasoning", "content", "tool_call"], text: str) -> None:
        if self._on_event is None:
            return
        # A surrogate pair split across chunks: hold the high half until the low one comes.
        text = self._held.pop(kind, "") + text
        if "\ud800" <= text[-1] <= "\udbff":
            self._held[kind], text = text[-1], text[:-1]
        if text:
            self._events.append(StreamEvent(kind, _clean(text)))

    @property
    def message(self) -> Message:
        """The assistant message so far, in its storable shape.

        Text is joined, then cleaned of lone UTF-16 surrogates (a pair split across chunks
        joins back; a lone half becomes U+FFFD), so the message always encodes as UTF-8.
        """
        content = _clean("".join(self._content))
        message: Message = {"role": "assistant", "content": content}
        if self._reasoning:
            message[self._reasoning_key] = _clean("".join(self._reasoning))
        kept = [call for call in self._calls if call is not self._dropped]
        if kept:
            if not content:
                message["content"] = None
            used: set[str] = set()
            calls = []
            for call in kept:
                call_id = _clean(call.id)
                if not call_id or call_id in used:  # tool results pair with calls by id
                    call_id = f"call_{uuid.uuid4().hex[:24]}"
                used.add(call_id)
                calls.append({
                    "id": call_id,
                    "type": _clean(call.type),
                    "function": {"name": _clean(call.name),
                                 "arguments": _clean("".join(call.arguments)) or "{}"},
                })
            message["tool_calls"] = calls
        return message

    @property
    def dropped_call(self) -> str | None:
        """The name of the tool call left out because the answer was cut in it, if any."""
        return _clean(self._dropped.name) or "?" if self._dropped is not None else None

    def result(self, cut: str = "", note: str = "") -> ChatResult:
        """The finished answer; when :attr:`cut`, ``note`` ends its text and ``cut`` says
        why (see :attr:`ChatResult.cut`)."""
        message = self.message
        if self.cut and note:
            text = message.get("content") or ""
            message["content"] = f"{text}\n\n{note}" if text else note
        return ChatResult(message=message, usage=self.usage, finish_reason=self.finish_reason,
                          cut=cut if self.cut else "")


def from_completion(data: Any, on_event: OnEvent | None = None) -> ChatResult:
    """Normalise a non-streamed ``chat.completion`` the same way as a stream.

    ``on_event`` still receives the text, so a caller shows a non-streamed answer too.
    """
    return completion_assembler(data, on_event).result()


def completion_assembler(data: Any, on_event: OnEvent | None = None, *, limit: int = 0,
                         cut: bool = False) -> MessageAssembler:
    """:func:`from_completion`'s assembler, holding the answer (``result()`` takes it);
    ``limit`` as for :class:`MessageAssembler`; ``cut``: ``data`` is the start of a body
    that was cut (closed by :func:`swarm.llm.bounds.close_cut_json`)."""
    if not isinstance(data, dict):
        raise ModelResponseError(f"the model server's answer is not a JSON object: "
                                 f"{str(data)[:200]}")
    if data.get("error"):
        raise ModelResponseError(
            f"the model server reported an error: {_error_text(data['error'])}"
        )
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ModelResponseError(f"the model server's answer has no choices: {str(data)[:200]}")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ModelResponseError(f"the model server's answer has no message: {str(data)[:200]}")
    delta = dict(message)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        delta["tool_calls"] = [
            {**call, "index": i} for i, call in enumerate(calls) if isinstance(call, dict)
        ]
    assembler = MessageAssembler(on_event, limit)
    assembler.feed({
        "choices": [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}],
        "usage": data.get("usage"),
    })
    if cut:
        assembler.cut_here()
    return assembler


def _clean(text: str) -> str:
    """``text`` with surrogate pairs joined and lone surrogates replaced by U+FFFD."""
    if text.isascii():
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)[:500]
    return str(error)[:500]
