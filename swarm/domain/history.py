"""Pure functions over a message list: every ``tool`` message must answer a call.

The Chat Completions API rejects a history where an assistant message's
``tool_calls`` are not each answered by a ``tool`` message with the same
``tool_call_id`` before the next non-tool message, or where a ``tool`` message
answers no call. These helpers keep histories valid across crashes and compaction.
"""

from __future__ import annotations

from swarm.domain.messages import Message

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
