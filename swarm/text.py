"""Counts in text shown to people: ``1 line``, ``2 lines``."""

from __future__ import annotations


def plural(count: int, noun: str, many: str = "") -> str:
    """``count`` and ``noun``, plural unless ``count`` is 1 (``many``, else ``noun + 's'``)."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"
