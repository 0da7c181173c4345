"""What the views (status, top, the live tree, reports) share to show a number or a line:
durations, token counts, costs and the prices behind them, a first line.

Prices: ``SWARM_PRICE_INPUT`` and ``SWARM_PRICE_OUTPUT`` are US dollars per million prompt
(input) and completion (output) tokens; ``SWARM_PRICES`` prices models by name
(``gpt-4o-mini=0.15/0.6,gpt-4o=2.5/10``: an agent type with a cheaper model costs less).
When any is set, views show an estimated cost, each agent's at its model's price.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PRICE_VARS = ("SWARM_PRICE_INPUT", "SWARM_PRICE_OUTPUT")
MODEL_PRICES_VAR = "SWARM_PRICES"


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
    """Dollars per million input (prompt) and output (completion) tokens: one pair for any
    model, and pairs for named models (``SWARM_PRICES``), which win for their model."""

    input: float | None = None
    output: float | None = None
    models: tuple[tuple[str, float, float], ...] = ()
    """(model, input, output) for each model priced by name."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Prices:
        """Read ``SWARM_PRICE_INPUT`` / ``SWARM_PRICE_OUTPUT`` and ``SWARM_PRICES``
        (``MODEL=IN/OUT,MODEL=IN/OUT``); ValueError names a bad one."""
        env = os.environ if environ is None else environ
        values: list[float | None] = []
        for name in PRICE_VARS:
            raw = (env.get(name) or "").strip()
            values.append(_price(name, raw) if raw else None)
        models = []
        for item in (env.get(MODEL_PRICES_VAR) or "").split(","):
            if not item.strip():
                continue
            model, eq, pair = item.strip().rpartition("=")
            given, slash, taken = pair.partition("/")
            if not eq or not model.strip() or not slash:
                raise ValueError(f"{MODEL_PRICES_VAR}: {item.strip()!r} is not MODEL=IN/OUT: "
                                 f"give each model's US dollars per million prompt and "
                                 f"completion tokens, e.g. {MODEL_PRICES_VAR}="
                                 "gpt-4o-mini=0.15/0.6,gpt-4o=2.5/10")
            models.append((model.strip(), _price(MODEL_PRICES_VAR, given.strip()),
                           _price(MODEL_PRICES_VAR, taken.strip())))
        return cls(values[0], values[1], tuple(models))

    @classmethod
    def from_env_or_none(cls) -> Prices:
        """Like :meth:`from_env`, but a bad value means no prices (a view must not fail)."""
        try:
            return cls.from_env()
        except ValueError:
            return cls()

    @property
    def configured(self) -> bool:
        return self.input is not None or self.output is not None or bool(self.models)

    def cost(self, usage: Mapping[str, int], model: str = "") -> float | None:
        """Estimated dollars for ``usage`` of ``model`` (its own price when it has one, else
        the price for any model); None when neither is configured."""
        named = next(((i, o) for m, i, o in self.models if m == model), None) \
            if model else None
        if named is None and self.input is None and self.output is None:
            return None
        given, taken = named if named is not None else (self.input or 0.0, self.output or 0.0)
        return (usage.get("prompt_tokens", 0) * given
                + usage.get("completion_tokens", 0) * taken) / 1_000_000


def total_cost(costs: list[float | None]) -> float | None:
    """The sum of the costs known; None when none is."""
    known = [c for c in costs if c is not None]
    return sum(known) if known else None


def _price(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{name}={raw!r} is not a price: give US dollars per million "
                         "tokens, e.g. SWARM_PRICE_INPUT=0.15")
    return value
