"""EVA's compaction, with tool-call pairs kept valid. Pure functions over messages.

When a model call uses ``compact_at`` (75%) of the context, the loop appends
:data:`EMERGENCY` and offers ``leave_memory_hints``. When the model calls it,
the history is rebuilt as: system prompt (with the new hints) + the kept tail
(from the last user message before the emergency), with a note, tool results
in the tail cut to 200 characters. The tail is cut only at whole groups
(an assistant message with all of its tool results), so every kept ``tool``
message still answers a kept ``tool_calls`` message.
"""

from __future__ import annotations

from swarm.domain.history import repair
from swarm.domain.messages import CHARS_PER_TOKEN, Message, estimate_tokens
from swarm.errors import TaskTooLarge

EMERGENCY = """[EMERGENCY: your context is nearly full. Your memory will be wiped soon.]
Do these now, in order, before anything else:
1. Save what you have learned and the state of the task (done, in progress, next steps) to files
   in your workspace (e.g. notes/progress.md).
2. Save reusable skills and knowledge to files, each with when it applies.
3. Call leave_memory_hints with the complete new memory hints: where those files are and what to
   do next. The conversation is then compacted and you continue from your hints."""

NOTE = ("[Your memory was compacted: the earlier conversation was dropped. Your memory hints are "
        "in the system prompt; the files they point to hold your notes. Below is the last part "
        "of the conversation, tool outputs shortened. Check the state of the task and carry on.]")

TOOL_RESULT_CHARS = 200
#: A task over this share of the context is taken with a warning.
WARN_AT = 0.5


def used_fraction(tokens: int, context_length: int) -> float:
    return tokens / context_length if context_length > 0 else 0.0


def check_task(task: str, context_length: int, compact_at: float) -> str:
    """Refuse a task that alone takes ``compact_at`` of the context or more: the loop would
    compact at every step (compaction always keeps the task), or the first call would not
    fit at all. Returns a one-line warning for a task over :data:`WARN_AT` of it, else "".

    The one check of every way a task comes in (``swarm run``, ``swarm chat``, a job of
    the API or a schedule, a child's message), made before any model call."""
    if context_length <= 0:
        return ""
    tokens = len(task) // CHARS_PER_TOKEN
    limit = int(context_length * compact_at)
    if tokens >= limit:
        raise TaskTooLarge(
            f"the task is too large for the model's context: about {tokens:,} tokens "
            f"({len(task):,} characters at {CHARS_PER_TOKEN} a token), and a task may take at most "
            f"{limit:,} of the {context_length:,} tokens the model holds ({compact_at:.0%}, "
            "SWARM_COMPACT_AT: past that the conversation is compacted at every step, and the "
            "task is always kept). Put the material in a file in the workspace and give a "
            "short task that tells the agent to read it, e.g. \"summarize notes.txt\"")
    if tokens > context_length * WARN_AT:
        return (f"the task takes about {tokens:,} tokens, {tokens / context_length:.0%} of the "
                f"model's {context_length:,}-token context: little is left to work in before "
                "the conversation is compacted (material in a file in the workspace, which the "
                "agent reads as it needs, costs less)")
    return ""


def _groups(messages: list[Message]) -> list[list[Message]]:
    """Split into units that must stay together: an assistant message with its tool results."""
    groups: list[list[Message]] = []
    for msg in messages:
        if msg.get("role") == "tool" and groups and groups[-1][0].get("role") == "assistant":
            groups[-1].append(msg)
        else:
            groups.append([msg])
    return groups


def _shorten(msg: Message) -> Message:
    if msg.get("role") != "tool":
        return msg
    content = str(msg.get("content") or "")
    if len(content) <= TOOL_RESULT_CHARS:
        return msg
    cut = len(content) - TOOL_RESULT_CHARS
    return {**msg, "content": f"{content[:TOOL_RESULT_CHARS]}[... {cut} characters cut]"}


def kept_tail(messages: list[Message], crisis: int, budget_tokens: int) -> list[Message]:
    """The messages to keep: from the last user message before index ``crisis`` up to it,
    tool results shortened, oldest whole groups dropped while over ``budget_tokens``
    (the first user message, the task, is always kept)."""
    start = 0
    for i in range(min(crisis, len(messages)) - 1, -1, -1):
        if messages[i].get("role") == "user":
            start = i
            break
    window = [m for m in messages[start:crisis] if m.get("role") != "system"]
    groups = [[_shorten(m) for m in g] for g in _groups(window)]
    head = groups[:1] if groups and groups[0][0].get("role") == "user" else []
    rest = groups[len(head):]
    while rest and estimate_tokens([m for g in head + rest for m in g]) > budget_tokens:
        rest.pop(0)
    return repair([m for g in head + rest for m in g])


def rebuild(system_prompt: str, messages: list[Message], crisis: int,
            budget_tokens: int) -> list[Message]:
    """The compacted history: the new system prompt, then the note and the kept tail."""
    tail = kept_tail(messages, crisis, budget_tokens)
    if tail and tail[0].get("role") == "user":
        # Merged rather than a second user message in a row: some chat templates
        # (Mistral's, for one) reject roles that do not alternate.
        first = {**tail[0], "content": f"{NOTE}\n\n{tail[0].get('content') or ''}"}
        tail = [first, *tail[1:]]
    else:
        tail = [{"role": "user", "content": NOTE}, *tail]
    return [{"role": "system", "content": system_prompt}, *tail]
