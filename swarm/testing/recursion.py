"""The scripted model's recursion mode: a model that always calls the ``agent`` tool.

Asked ``recurse N`` (a task that says it, outside backticks), or served with
``--recurse N``, it answers every request of the conversation with ``N`` ``agent`` calls
whose children are told the same, whatever came back: refusals, failures, answers. It
shows that a misbehaving model cannot hurt the swarm: its limits end it by themselves
(the depth and children limits, ``SWARM_REPEAT_LIMIT``, the turn limits, the token
budget).
"""

from __future__ import annotations

import re
from typing import Any

from swarm.testing.replies import Reply, Responder, ToolCall
from swarm.testing.responders import message_text
from swarm.text import plural

MAX_RECURSE = 200
"""The most ``agent`` calls one answer makes."""
_RECURSE = re.compile(r"\brecurse\b\W*(\d+)?", re.I)
_QUOTED = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def recursion_of(request: dict[str, Any]) -> int:
    """N when the conversation's task says ``recurse N`` (``recurse`` alone: 1), else 0.
    The task is the latest user message that is not one of swarm's bracketed notes (a
    wrap-up, a resume): the model ignores those and goes on."""
    for message in reversed(request.get("messages") or []):
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        text = message_text(message)
        if text.lstrip().startswith("["):
            continue
        found = _RECURSE.search(_QUOTED.sub("", text))
        return max(1, min(int(found[1] or 1), MAX_RECURSE)) if found else 0
    return 0


def recursion_reply(request: dict[str, Any], count: int | None = None) -> Reply | None:
    """``count`` (default: what the task asks, :func:`recursion_of`) ``agent`` calls, each
    child told to do the same; None when the task does not ask to recurse. The calls are
    the same at every answer, as a model stuck in a loop makes them."""
    count = recursion_of(request) if count is None else count
    if not count:
        return None
    offered = {str((t.get("function") or {}).get("name")) for t in request.get("tools") or []
               if isinstance(t, dict)}
    if "agent" not in offered:
        return Reply("I would recurse, but this request does not offer the `agent` tool.")
    return Reply(content=f"Recursing into {plural(count, 'child agent')}.",
                 tool_calls=[ToolCall("agent", {"message": f"recurse {count}: child {i} of "
                                                           f"{count}; do as your parent did"})
                             for i in range(1, count + 1)])


def recursing(count: int) -> Responder:
    """A responder that answers every request with ``count`` ``agent`` calls (``--recurse``)."""
    def respond(request: dict[str, Any]) -> Reply:
        reply = recursion_reply(request, count)
        assert reply is not None
        return reply

    return respond
