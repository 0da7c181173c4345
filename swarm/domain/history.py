"""Pure functions over a message list: every ``tool`` message must answer a call.

The Chat Completions API rejects a history where an assistant message's
``tool_calls`` are not each answered by a ``tool`` message with the same
``tool_call_id`` before the next non-tool message, or where a ``tool`` message
answers no call. These helpers keep histories valid across crashes and compaction;
:func:`repeats` tells an agent that goes round in circles.
"""

from __future__ import annotations

import json

from swarm.domain.messages import Message, tool_body

INTERRUPTED = (
    "[interrupted: swarm stopped before this call finished, so its result was lost. "
    "It may or may not have run; check its effects before running it again.]"
)


def call_ids(message: Message) -> list[str]:
    """The tool-call ids of an assistant message, in order."""
    return [str(c.get("id", "")) for c in message.get("tool_calls") or []]


def problems(messages: list[Message]) -> list[str]:
    """Describe every pairing problem in ``messages``; empty when the history is valid."""
    found: list[str] = []
    open_ids: list[str] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "tool":
            tid = msg.get("tool_call_id")
            if tid in open_ids:
                open_ids.remove(tid)
            else:
                found.append(f"message {i}: tool result {tid!r} answers no open call")
            continue
        if open_ids:
            found.append(f"message {i}: calls {open_ids} were never answered")
            open_ids = []
        if role == "assistant":
            open_ids = call_ids(msg)
    if open_ids:
        found.append(f"end: calls {open_ids} were never answered")
    return found


def repair(messages: list[Message], note: str = INTERRUPTED) -> list[Message]:
    """Return a valid copy of ``messages``: unanswered calls get ``note`` as their result,
    in call order, right after their results so far; orphan ``tool`` messages are dropped."""
    out: list[Message] = []
    open_ids: list[str] = []

    def close() -> None:
        for tid in open_ids:
            out.append({"role": "tool", "tool_call_id": tid, "content": note})
        open_ids.clear()

    for msg in messages:
        if msg.get("role") == "tool":
            tid = msg.get("tool_call_id")
            if tid in open_ids:
                open_ids.remove(tid)
                out.append(msg)
            continue
        close()
        out.append(msg)
        if msg.get("role") == "assistant":
            open_ids.extend(call_ids(msg))
    close()
    return out


#: A child's result in these states is a refusal or a failure (repeating it gets nowhere).
FAILED_CHILD = ("refused", "failed", "timed_out", "cancelled")


def refusal(name: str, content: object) -> str | None:
    """The refusal or error a tool result says, as a comparable text; None when the call
    did its work (an output, a child's answer: polling a command is no loop)."""
    text = str(content or "")
    if name == "agent":
        body = tool_body({"role": "tool", "content": text})
        if body is not None:
            state = body.get("state")
            return f"{state}: {body.get('error', '')}" if state in FAILED_CHILD else None
    return text if text.startswith(("denied:", "error:")) else None


def _signature(calls: list[dict[str, object]], results: dict[str, object]
               ) -> tuple[tuple[str, str, str], ...] | None:
    """(tool, arguments, refusal) of each call of one answer; None unless every call was
    refused or failed."""
    out = []
    for call in calls:
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        name, raw = str(function.get("name") or ""), function.get("arguments")
        try:
            args = json.dumps(json.loads(raw) if isinstance(raw, str) else raw, sort_keys=True,
                              ensure_ascii=False)
        except ValueError:
            args = str(raw)
        said = refusal(name, results.get(str(call.get("id", ""))))
        if said is None:
            return None
        out.append((name, args, said))
    return tuple(out) or None


def repeats(messages: list[Message]) -> tuple[int, str]:
    """How many answers in a row, at the end of ``messages``, made the same tool calls (the
    same tools with the same arguments) and got the same refusal or error for each; and
    what that call and its refusal were, in a line ("" when none)."""
    count, last, end = 0, None, len(messages)
    while end > 0:
        start = end
        while start > 0 and messages[start - 1].get("role") == "tool":
            start -= 1
        asked = messages[start - 1] if start > 0 else {}
        calls = asked.get("tool_calls") or []
        if start == end or asked.get("role") != "assistant" or not calls:
            break
        results = {str(m.get("tool_call_id")): m.get("content") for m in messages[start:end]}
        signature = _signature(calls, results)
        if signature is None or (last is not None and signature != last):
            break
        count, last, end = count + 1, signature, start - 1
    if last is None:
        return 0, ""
    name, args, said = last[0]
    more = f" (and {len(last) - 1} more calls)" if len(last) > 1 else ""
    return count, f"{name} {args[:200]}{more} -> {said.splitlines()[0][:300] if said else ''}"
