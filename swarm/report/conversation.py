"""An agent's conversation as the views show it: its task, what it said and thought, each
tool call with its output, its answer. ``swarm logs`` prints it as text; the page of
``swarm serve`` gets it as :func:`entries`, each call paired with its result and every
text capped (:func:`cap`)."""

from __future__ import annotations

import json
from typing import Any

from swarm.report.view import content_text


def call_line(call: dict[str, Any]) -> str:
    """One tool call as a line: ``$ COMMAND``, ``> agent: MESSAGE`` or ``> TOOL {args}``."""
    function = call.get("function") or {}
    name = str(function.get("name", "?"))
    raw = str(function.get("arguments") or "")
    try:
        args = json.loads(raw) if raw else {}
    except ValueError:
        args = raw
    if name == "run_cli" and isinstance(args, dict) and "command" in args:
        return f"$ {args['command']}"
    if name == "agent" and isinstance(args, dict):
        target = f" (continue {args['agent_id']})" if args.get("agent_id") else ""
        return f"> agent{target}: {args.get('message', '')}"
    shown = json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else args
    return f"> {name} {shown}"


def cap(text: str, limit: int) -> str:
    """``text`` whole when it has at most ``limit`` characters, else its head and tail with
    a marker saying how much was cut."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n... {len(text) - limit} characters cut ...\n{text[-tail:]}"


def entries(messages: list[dict[str, Any]], *, tail: int, text_cap: int
            ) -> tuple[list[dict[str, Any]], int]:
    """The last ``tail`` entries of the conversation and how many came before them. Each
    is ``{"kind", "text"}``: ``user`` (its task, or a message), ``thinking``, ``said``,
    ``call`` (with ``tool``, ``id`` and the ``output`` of its result, ``None`` while it
    has none), ``answer`` (its last message without a call) or ``assistant``; the system
    prompt is left out. Texts are capped at ``text_cap`` characters."""
    out: list[dict[str, Any]] = []
    calls: dict[str, dict[str, Any]] = {}
    answer_at = max((i for i, m in enumerate(messages)
                     if m.get("role") == "assistant" and not m.get("tool_calls")), default=-1)
    for i, message in enumerate(messages):
        role = message.get("role")
        text = content_text(message.get("content")).strip()
        if role == "user":
            out.append({"kind": "user", "text": text})
        elif role == "assistant":
            reasoning = str(message.get("reasoning_content") or "").strip()
            if reasoning:
                out.append({"kind": "thinking", "text": reasoning})
            tool_calls = message.get("tool_calls") or []
            if tool_calls and text:
                out.append({"kind": "said", "text": text})
            for call in tool_calls:
                name = str((call.get("function") or {}).get("name", "?"))
                entry: dict[str, Any] = {"kind": "call", "tool": name,
                                         "id": str(call.get("id", "")),
                                         "text": call_line(call), "output": None}
                calls[entry["id"]] = entry
                out.append(entry)
            if not tool_calls:
                out.append({"kind": "answer" if i == answer_at else "assistant", "text": text})
        elif role == "tool":
            call_entry = calls.get(str(message.get("tool_call_id", "")))
            if call_entry is not None:
                call_entry["output"] = text
            else:
                out.append({"kind": "output", "text": text})
    before = max(0, len(out) - tail)
    shown = out[before:]
    for entry in shown:
        entry["text"] = cap(str(entry["text"]), text_cap)
        if entry.get("output") is not None:
            entry["output"] = cap(str(entry["output"]), text_cap)
    return shown, before
