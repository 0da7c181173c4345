"""One ``agent`` call of a parent, as the swarm receives it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpawnCall:
    """One ``agent`` call the model made, checked against the tool's schema."""

    call_id: str
    message: str
    agent_id: str = ""
    output_schema: dict[str, Any] | None = None
    traceparent: str = ""
    """The W3C trace context of this call, when telemetry is on (see swarm.telemetry)."""
