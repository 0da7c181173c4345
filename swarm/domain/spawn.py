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
    empty: bool = False
    """The model asked for a child that starts in an empty folder (``seed: false``)."""
    type: str = ""
    """The declared agent type it asks for ("": a copy of its parent)."""
    seed: str = ""
    """The snapshot of the parent's workspace the child starts from ("" : empty), set by
    the spawner when it takes the snapshot."""
