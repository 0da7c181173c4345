"""What the views (status, top, the live tree, reports) share to show a number or a line:
durations, token counts, costs and the prices behind them, a first line.

Prices: ``SWARM_PRICE_INPUT`` and ``SWARM_PRICE_OUTPUT`` are US dollars per million prompt
(input) and completion (output) tokens; when either is set, views show an estimated cost.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PRICE_VARS = ("SWARM_PRICE_INPUT", "SWARM_PRICE_OUTPUT")


# -- formatting ------------------------------------------------------------------------------

def fmt_duration(seconds: float) -> str:
    """``4.2s``, ``3m05s``, ``2h07m``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def fmt_tokens(count: int) -> str:
    """``812``, ``12.3k``, ``1.24M``."""
    if count < 1000:
        return str(count)
    if count < 1_000_000:
        return f"{count / 1000:.1f}k"
    return f"{count / 1_000_000:.2f}M"


def fmt_cost(dollars: float) -> str:
    return f"${dollars:.4f}" if dollars < 1 else f"${dollars:,.2f}"


def first_line(text: str, width: int = 120) -> str:
    """The first non-empty line of ``text``, cut to ``width`` characters."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[:width - 3] + "..."


# -- prices ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prices:
    """Dollars per million input (prompt) and output (completion) tokens."""

    input: float | None = None
    output: float | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Prices:
        """Read ``SWARM_PRICE_INPUT`` / ``SWARM_PRICE_OUTPUT``; ValueError names a bad one."""
        env = os.environ if environ is None else environ
        values: list[float | None] = []
        for name in PRICE_VARS:
            raw = (env.get(name) or "").strip()
            if not raw:
                values.append(None)
                continue
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not value >= 0:
                raise ValueError(f"{name}={raw!r} is not a price: give US dollars per million "
                                 f"tokens, e.g. {name}=0.15")
            values.append(value)
        return cls(values[0], values[1])

    @classmethod
    def from_env_or_none(cls) -> Prices:
        """Like :meth:`from_env`, but a bad value means no prices (a view must not fail)."""
        try:
            return cls.from_env()
        except ValueError:
            return cls()

    @property
    def configured(self) -> bool:
        return self.input is not None or self.output is not None

    def cost(self, usage: Mapping[str, int]) -> float | None:
        """Estimated dollars for ``usage``; None when no price is configured."""
        if not self.configured:
            return None
        return (usage.get("prompt_tokens", 0) * (self.input or 0.0)
                + usage.get("completion_tokens", 0) * (self.output or 0.0)) / 1_000_000
