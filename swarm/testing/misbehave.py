"""A model server that misbehaves, to show that a bad model cannot hurt the swarm.

A mode applies to every chat request with ``ScriptedModelServer(misbehave=MODE)``
(``python -m swarm.testing.server --misbehave MODE``), or to one conversation whose latest
task holds ``misbehave: MODE`` (``swarm run 'misbehave: endless'``). Safety reviews never
misbehave. Each mode answers a streamed request with a stream and a whole one with a body:
see :data:`MODES`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from swarm.testing.replies import Item, Reply, Slow
from swarm.testing.responders import message_text

if TYPE_CHECKING:
    from swarm.testing.handler import Handler

MODES = {
    "endless": "1 KB text deltas forever, no finish_reason nor [DONE] (or a body "
               "without end)",
    "trickle": "5 bytes of the answer every 2 s (--trickle-every), forever",
    "absurd-usage": "the usual answer, claiming 10^12 prompt and completion tokens",
    "huge": "an answer of 50 MB of text (--huge-size) in 1 MB deltas (or one body)",
    "retry-after": "HTTP 429 asking for Retry-After: 3600, every time",
    "bad-utf8": "an answer whose text holds bytes that are not UTF-8",
}
ABSURD_USAGE = {"prompt_tokens": 10**12, "completion_tokens": 10**12,
                "total_tokens": 2 * 10**12}
BAD_UTF8 = b"caf\xe9 au lait, \xff\xfe and a lone \xed\xa0\x80 surrogate"
"""The text of ``bad-utf8`` answers: Latin-1, two bytes UTF-8 never has, an encoded surrogate."""
_LINE = b"This answer never stops growing; it is here to fill memory. " * 17 + b"\n"
_MARK = re.compile(r"\bmisbehave:\s*([a-z0-9-]+)")


def mode_of(default: str | None, request: dict[str, Any]) -> str | None:
    """The mode for ``request``: ``misbehave: MODE`` in its latest user message, else
    ``default`` (the server's)."""
    for message in reversed(request.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            found = _MARK.search(message_text(message))
            if found and found[1] in MODES:
                return found[1]
            break
    return default


def answer(handler: Handler, request: dict[str, Any], stream: bool,
           take: Callable[[], Item]) -> Item | None:
    """Misbehave on ``handler``'s connection, as :func:`mode_of` says: None when it
    answered, else the item to answer with as usual (``take()``: the next scripted or
    responder item, changed by the mode)."""
    owner = handler.owner
    mode = mode_of(owner.misbehave, request)
    if mode is None:
        return take()
    if mode == "absurd-usage":
        item: Item = take()
        if isinstance(item, Slow) and item.reply is not None:
            return replace(item, reply=replace(item.reply, usage=dict(ABSURD_USAGE)))
        return replace(item, usage=dict(ABSURD_USAGE)) if isinstance(item, Reply) else item
    if mode == "retry-after":
        body = json.dumps({"error": {"message": "rate limited: try again in an hour",
                                     "type": "rate_limit_error", "code": 429}}).encode()
        handler.send_response(429)
        for name, value in (("Content-Type", "application/json"), ("Retry-After", "3600"),
                            ("Content-Length", str(len(body)))):
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)
        return None
    handler.close_connection = True  # the client gives up reading: never reuse this one
    _start(handler, stream)
    head, tail = _envelope(request, stream)
    if mode == "endless":
        piece = _LINE.decode()[:1024]
        if not stream:
            _write(handler, head)
        while True:
            _write(handler, _event(request, {"content": piece}) if stream
                   else json.dumps(piece)[1:-1].encode())
    if mode == "trickle":
        data = b"".join(_event(request, {"content": "slow "}) for _ in range(200)) \
            if stream else head + b"slow " * 1000
        while True:
            for at in range(0, len(data), 5):
                _write(handler, data[at:at + 5])
                time.sleep(owner.trickle_every)
    if mode == "huge":
        size, sent = owner.huge_size, 0
        block = _LINE * (2**20 // len(_LINE) + 1)
        _write(handler, head)
        while sent < size:
            text = block[:min(2**20, size - sent)]
            sent += len(text)
            _write(handler, _event(request, {"content": text.decode()}) if stream
                   else text.replace(b"\n", b"\\n"))
        _write(handler, tail)
    else:  # bad-utf8
        _write(handler, head)
        _write(handler, _event(request, {"content": "@@"}).replace(b"@@", BAD_UTF8)
               if stream else BAD_UTF8)
        _write(handler, tail)
    _write(handler, b"")
    return None


def _start(handler: Handler, stream: bool) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream" if stream else "application/json")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()


def _write(handler: Handler, data: bytes) -> None:
    """One HTTP chunk (an empty one ends the body)."""
    handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


def _event(request: dict[str, Any], delta: dict[str, Any], finish: str | None = None,
           usage: dict[str, int] | None = None) -> bytes:
    chunk: dict[str, Any] = {
        "id": "chatcmpl-misbehave", "object": "chat.completion.chunk",
        "created": int(time.time()), "model": request.get("model") or "scripted-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None
        else []}
    if usage is not None:
        chunk["usage"] = usage
    return b"data: %s\n\n" % json.dumps(chunk, ensure_ascii=False).encode()


def _envelope(request: dict[str, Any], stream: bool) -> tuple[bytes, bytes]:
    """What goes before and after the text: a stream's first and last events, or a whole
    completion's JSON around its content string."""
    usage = {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
    if stream:
        return (_event(request, {"role": "assistant", "content": ""}),
                _event(request, {}, "stop") + _event(request, {}, usage=usage)
                + b"data: [DONE]\n\n")
    marker = f"@@{uuid.uuid4().hex}@@"
    body = json.dumps({
        "id": "chatcmpl-misbehave", "object": "chat.completion", "created": int(time.time()),
        "model": request.get("model") or "scripted-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": marker},
                     "finish_reason": "stop"}],
        "usage": usage}).encode()
    head, _, tail = body.partition(marker.encode())
    return head, tail
