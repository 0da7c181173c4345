"""One conversation of an agent, as it is saved."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.domain.messages import Message


@dataclass
class Session:
    """One conversation, keyed by its workspace. Saved after every step."""

    id: str
    workspace: str
    messages: list[Message]
    usage: dict[str, int]
    created: float
    updated: float
    turns: int = 0
    parked: str = ""
    """Set while the agent waits for its children: the id of its spawn request. The last
    assistant message's calls are answered when they settle, so no repair at load."""
    said: str = ""
    """The id of the last message people sent it (its mailbox) that the conversation holds;
    those after it are still to be read."""
