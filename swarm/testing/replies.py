"""What the scripted model server is scripted with: replies, and faults to inject.

``server.script(Reply("hi"), Fault(429, retry_after=1))``; from JSON (``--script FILE``)
with :func:`parse_script`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """A tool call the model makes; ``arguments`` as a dict or a raw (maybe broken) JSON string."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None
    """Fixed call id; None makes one in the server's id style."""


@dataclass
class Reply:
    """One answer of the model."""

    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    usage: dict[str, int] | None = None
    """None counts roughly four characters a token."""
    finish_reason: str | None = None
    """None means ``tool_calls`` when there are calls, else ``stop``."""


@dataclass
class Fault:
    """Answer with an HTTP error status (and ``Retry-After`` when given)."""

    status: int = 500
    retry_after: float | str | None = None
    body: str | dict[str, Any] | None = None
    """None gives an OpenAI-style error object."""


@dataclass
class CutStream:
    """Start the answer, then stop after ``after_chunks`` SSE events without ``[DONE]``.

    ``clean=False`` drops the connection mid-body; ``clean=True`` ends the HTTP body
    properly, so the client sees a plain end of stream without a finish_reason.
    """

    after_chunks: int = 3
    clean: bool = False


@dataclass
class Garbage:
    """Answer 200 with a body (or stream chunk) that is not JSON."""


@dataclass
class Slow:
    """Wait ``seconds`` before answering with ``reply`` (None: the responder's answer)."""

    seconds: float
    reply: Reply | None = None
    after_thinking: bool = False
    """When streaming, send the reply's thinking first and wait before the rest."""


Item = Reply | Fault | CutStream | Garbage | Slow
Responder = Callable[[dict[str, Any]], Item]
"""Answers a request: a reply, or a fault (``Fault``, ``CutStream``, ...) to inject."""
Reviewer = Callable[[str], str]


def parse_script(items: Iterable[dict[str, Any]]) -> list[Item]:
    """Script items from JSON objects: ``{"content"|"tool_calls"|"reasoning": ...}``,
    ``{"fault": 429, "retry_after": 1}``, ``{"cut": 3}``, ``{"garbage": true}``, ``{"slow": 2}``."""
    out: list[Item] = []
    for raw in items:
        if "fault" in raw:
            out.append(Fault(int(raw["fault"]), raw.get("retry_after"), raw.get("body")))
        elif "cut" in raw:
            out.append(CutStream(int(raw["cut"]), bool(raw.get("clean", False))))
        elif raw.get("garbage"):
            out.append(Garbage())
        elif "slow" in raw:
            out.append(Slow(float(raw["slow"])))
        else:
            calls = [ToolCall(c["name"], c.get("arguments", {}), c.get("id"))
                     for c in raw.get("tool_calls", [])]
            out.append(Reply(raw.get("content"), calls, raw.get("reasoning"), raw.get("usage")))
    return out
