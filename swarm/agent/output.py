"""Structured answers: a task may come with a JSON Schema its final answer must match.

The task's message asks for it (:func:`ask_for`); the answer is checked with
:func:`check_output`, and a mismatch is sent back once with :func:`retry_message`.
"""

from __future__ import annotations

import json
from typing import Any

SCHEMA_PROMPT = """

Your final answer must be ONLY a JSON value (no prose, no code fences) that matches this JSON
Schema:
{schema}"""

SCHEMA_RETRY = ("Your answer does not match the output schema: {problem}. Answer again with "
                "only the JSON value, nothing else.")


def ask_for(message: str, schema: dict[str, Any] | None) -> str:
    """``message`` with the instruction to answer in ``schema``'s shape (when there is one)."""
    return message + SCHEMA_PROMPT.format(schema=json.dumps(schema)) if schema else message


def retry_message(problem: str) -> str:
    return SCHEMA_RETRY.format(problem=problem)


def check_output(answer: str, schema: dict[str, Any]) -> tuple[Any, str]:
    """Parse ``answer`` as JSON and validate it; returns (value, "") or (None, problem)."""
    text = answer.strip()
    if text.startswith("```"):
        text = text.strip("`")
        text = text[text.find("\n") + 1:] if "\n" in text else text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"the answer is not JSON ({exc.msg} at char {exc.pos})"
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        return None, "; ".join(
            (f"{'/'.join(map(str, e.path))}: " if e.path else "") + e.message for e in errors[:5])
    return value, ""
