"""What ``GET /models`` lists, read the same way whichever server answers: the entries, the
one of the configured model, and its context window in each server's dialect."""

from __future__ import annotations

from typing import Any

from swarm.errors import ModelNotFoundError, ModelResponseError


def model_entries(data: Any, *, where: str) -> list[dict[str, Any]]:
    """The entries of a parsed ``/models`` answer that have an ``id``."""
    entries = data.get("data") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ModelResponseError(
            f"GET {where}/models has no 'data' list; is SWARM_BASE_URL an "
            "OpenAI-compatible endpoint ending in /v1?"
        )
    return [e for e in entries if isinstance(e, dict) and e.get("id")]


def find_entry(models: list[dict[str, Any]], model: str, *,
               where: str) -> dict[str, Any] | None:
    """``model``'s entry (``name`` also matches Ollama's ``name:latest``); None when nothing
    is listed; ModelNotFoundError when others are but not this one."""
    if not models:
        return None
    wanted = (model,) if ":" in model else (model, f"{model}:latest")
    for entry in models:
        if entry.get("id") in wanted:
            return entry
    ids = [str(entry["id"]) for entry in models]
    raise ModelNotFoundError(
        f"the model server at {where} does not list SWARM_MODEL={model!r}; "
        f"it lists: {listing(ids)}. Set SWARM_MODEL to one of them."
    )


def context_of(entry: dict[str, Any]) -> int | None:
    """The context window an entry of ``/models`` states, in the known dialects."""
    candidates: list[Any] = [entry.get(key) for key in (
        "max_model_len",  # vLLM
        "context_length",  # OpenRouter, LiteLLM, SGLang
        "max_context_length",  # LM Studio
        "context_window",  # Groq
    )]
    meta = entry.get("meta")
    if isinstance(meta, dict):  # llama.cpp
        candidates += [meta.get("n_ctx"), meta.get("n_ctx_train")]
    provider = entry.get("top_provider")
    if isinstance(provider, dict):
        candidates.append(provider.get("context_length"))
    for value in candidates:
        if isinstance(value, bool):
            continue
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: 1e999 is inf
            continue
        if number > 0:
            return number
    return None


def listing(ids: list[str], limit: int = 20) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f" (and {len(ids) - limit} more)" if len(ids) > limit else "")
