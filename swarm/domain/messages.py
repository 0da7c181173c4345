"""Plain data passed between the model client and the agent loop."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Message = dict[str, Any]
"""One Chat Completions message, exactly as sent to / received from the API."""

CHARS_PER_TOKEN = 4
"""swarm's own token count, where a server's is missing or cannot be true: four characters
(of the messages' JSON, or bytes sent) a token."""
TOKENS_BEYOND_BYTES = 16_384
"""Tokens a request may count beyond one a byte it sends: the chat template, a server's own
system prompt, images sent by URL. More is a figure that cannot be true."""


def estimate_tokens(messages: list[Message]) -> int:
    """swarm's own count of the tokens ``messages`` hold (see :data:`CHARS_PER_TOKEN`)."""
    return len(json.dumps(messages, ensure_ascii=False)) // CHARS_PER_TOKEN


def tool_body(message: Message) -> dict[str, Any] | None:
    """The JSON object a ``tool`` message carries (a child's result), else None."""
    if message.get("role") != "tool":
        return None
    try:
        body = json.loads(str(message.get("content") or ""))
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


@dataclass
class Usage:
    """Token counts of one or more model calls."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.total_tokens += other.total_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Usage:
        """Counts from a ``usage`` object; anything that is not a count is taken as 0."""
        if not isinstance(data, dict):
            data = {}
        prompt = _count(data.get("prompt_tokens"))
        completion = _count(data.get("completion_tokens"))
        total = _count(data.get("total_tokens")) or prompt + completion
        return cls(prompt, completion, total)


def _count(value: Any) -> int:
    """A token count from a server's JSON: a non-negative int, else 0 (never raises)."""
    if isinstance(value, bool):
        return 0
    try:
        number = value if isinstance(value, int) else int(float(value))
    except (TypeError, ValueError, OverflowError):  # "n/a", {}, None, NaN, inf
        return 0
    return max(number, 0)


@dataclass(frozen=True)
class StreamEvent:
    """A piece of an answer as it arrives, for display only.

    ``kind`` is ``reasoning`` (thinking text), ``content`` (answer text) or
    ``tool_call`` (``text`` is the tool name, sent once per call when it is known).
    """

    kind: Literal["reasoning", "content", "tool_call"]
    text: str


OnEvent = Callable[[StreamEvent], None]


@dataclass
class ChatResult:
    """The outcome of one chat completion.

    ``message`` is the assistant message to append to the history as is:
    ``role``, ``content`` (str or None), ``tool_calls`` when present (each
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` with
    ``arguments`` the raw JSON string), and ``reasoning_content`` when the
    provider sent reasoning (DeepSeek requires it back).
    """

    message: Message
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    cut: str = ""
    """Why the answer was cut short, e.g. "it went over SWARM_ANSWER_MAX (1,000 characters)"
    (the message ends with a note saying so); "" for a whole answer."""
    notices: dict[str, str] = field(default_factory=dict)
    """What the user should know about the call, by kind ("usage", "utf8"): the agent says
    each kind once per run."""

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])

    @property
    def content(self) -> str:
        return str(self.message.get("content") or "")
