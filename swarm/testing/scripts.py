"""Responders for many concurrent conversations (a swarm), for tests, demos and benchmarks.

The queue of :class:`~swarm.testing.server.ScriptedModelServer` answers requests in
arrival order, which is no use when fifty children talk to the model at once. A
:class:`ByTask` responder picks a script per conversation by its task (the first user
message) and answers by turn (how many assistant messages the conversation has).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from swarm.testing.server import Reply, message_text

Step = Reply | Callable[[dict[str, Any]], Reply]


def task_of(request: dict[str, Any]) -> str:
    """The first user message of the conversation in ``request``."""
    for message in request.get("messages") or []:
        if message.get("role") == "user":
            return message_text(message)
    return ""


def turn_of(request: dict[str, Any]) -> int:
    """How many answers the model has given in this conversation so far."""
    return sum(1 for m in request.get("messages") or [] if m.get("role") == "assistant")


def tool_results(request: dict[str, Any]) -> list[str]:
    """The tool results that follow the last assistant message."""
    out: list[str] = []
    for message in reversed(request.get("messages") or []):
        if message.get("role") != "tool":
            break
        out.append(message_text(message))
    return out[::-1]


class ByTask:
    """Answer each conversation from the script whose key occurs in its task.

    ``scripts`` maps a substring of the task to the replies for turns 0, 1, 2, ...; the
    last reply repeats. A step may be a function of the request (to answer from the
    tool results, say). Keys are tried in order; ``default`` answers the rest.
    """

    def __init__(self, scripts: Mapping[str, Sequence[Step]],
                 default: Step | None = None) -> None:
        self.scripts = dict(scripts)
        self.default = default
        self.lock = threading.Lock()
        self.seen: dict[str, int] = {}

    def __call__(self, request: dict[str, Any]) -> Reply:
        task = task_of(request)
        for key, steps in self.scripts.items():
            if key in task:
                with self.lock:
                    self.seen[key] = self.seen.get(key, 0) + 1
                step = steps[min(turn_of(request), len(steps) - 1)]
                return step(request) if callable(step) else step
        if self.default is None:
            return Reply(content=f"[scripted model: no script for task {task[:80]!r}]")
        return self.default(request) if callable(self.default) else self.default
