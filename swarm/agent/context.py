"""How full an agent's context is, and what the loop does about it: past ``compact_at``
it asks the model to leave memory hints (:data:`compaction.EMERGENCY`), then rebuilds the
conversation around them (:func:`compaction.rebuild`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from swarm.agent import compaction
from swarm.domain.messages import TOKENS_BEYOND_BYTES, ChatResult, Message, estimate_tokens

if TYPE_CHECKING:
    from swarm.agent.loop import Agent

#: Past this share of the context, compaction happens even without hints.
FORCE_AT = 0.92


def used_tokens(agent: Agent, result: ChatResult, since: int | None = None) -> int:
    """Tokens the context holds after ``result``: the model's count, plus an estimate of
    the messages appended since (tool results), else an estimate of everything.

    Never more than a token a byte of the messages and tools (and a chat template): a
    figure alone must not make the loop compact the conversation away."""
    if not result.usage.total_tokens:
        return estimate_tokens(agent.messages)
    extra = agent.messages[since:] if since is not None else []
    used = result.usage.total_tokens + estimate_tokens(extra)
    if used <= TOKENS_BEYOND_BYTES or used <= TOKENS_BEYOND_BYTES + text_size(agent.messages):
        return used  # under the cap however the messages encode: they need not be
    most = len(json.dumps(agent.messages, ensure_ascii=False).encode())
    return min(used, most + agent.tools_bytes + TOKENS_BEYOND_BYTES)


def text_size(messages: list[Message]) -> int:
    """Characters of the messages' text contents: at most the bytes of their JSON."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def crisis_index(messages: list[Message]) -> int | None:
    """Where the emergency instruction stands, when the context is in crisis."""
    for i in range(len(messages) - 1, -1, -1):
        msg = messages[i]
        if msg.get("role") == "user" and msg.get("content") == compaction.EMERGENCY:
            return i
    return None


def manage(agent: Agent, result: ChatResult, hints: str | None, since: int) -> None:
    """Start the emergency at ``compact_at``; compact once hints are left (or, past
    :data:`FORCE_AT`, with the hints there are)."""
    context = agent.model.context_length()
    used = used_tokens(agent, result, since=since)
    agent.observer.on_usage(used, context)
    crisis = crisis_index(agent.messages)
    fraction = compaction.used_fraction(used, context)
    if crisis is not None and (hints is not None or fraction >= FORCE_AT):
        compact(agent, crisis, hints)
    elif crisis is None and fraction >= agent.config.compact_at:
        agent.messages.append({"role": "user", "content": compaction.EMERGENCY})
        agent.save()
        agent.observer.on_notice(
            f"context {fraction:.0%} full: asked the model to save its memory and compact")


def compact(agent: Agent, crisis: int, hints: str | None) -> None:
    """Rebuild the conversation around the memory hints (those just left, else the saved)."""
    if hints is None:
        hints = agent.hints.load() if agent.hints is not None else ""
    before = len(agent.messages)
    budget = int(agent.model.context_length() * 0.25)
    agent.session.messages = compaction.rebuild(
        agent.system_prompt(hints), agent.messages, crisis, budget)
    agent.save()
    agent.observer.on_notice(
        f"compacted the conversation: {before} messages -> {len(agent.messages)}")

