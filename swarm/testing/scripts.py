"""Responders for many concurrent conversations (a swarm), for tests, demos and benchmarks.

The queue of :class:`~swarm.testing.server.ScriptedModelServer` answers requests in
arrival order, which is no use when fifty children talk to the model at once. A
:class:`ByTask` responder picks a script per conversation by its task (the first user
message) and answers by turn (how many assistant messages the conversation has).
"""

from __future__ import annotations

import json
import re
import shlex
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarm.testing.replies import Item, Reply, ToolCall
from swarm.testing.responders import message_text
from swarm.text import plural

Step = Item | Callable[[dict[str, Any]], Item]


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

    def __call__(self, request: dict[str, Any]) -> Item:
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


DEMO_ROOT = "DEMO-ROOT"
DEMO_CHILD = "DEMO-CHILD"


def demo_task(paths: Sequence[str]) -> str:
    """The root task of ``swarm demo``: the files to count travel in the task itself."""
    return (f"{DEMO_ROOT}: count the lines and words of these files, one child agent per file, "
            f"and add them up.\nFILES={json.dumps(list(paths))}")


@dataclass
class DemoTally:
    """What the root of ``swarm demo`` found when it added the children's counts up."""

    files: int = 0
    counted: int = 0
    uncounted: int = 0
    """Children that are done but whose answer is not a count (say, an unreadable file)."""
    unfinished: dict[str, int] = field(default_factory=dict)
    """Children that did not finish, by state (failed, refused, cancelled, timed_out)."""


def demo_responder(tally: DemoTally | None = None) -> ByTask:
    """The scripted model of ``swarm demo``: fan out one child per file, then add up
    (and record what it found in ``tally``)."""

    def fan_out(request: dict[str, Any]) -> Reply:
        paths = json.loads(task_of(request).split("FILES=", 1)[1])
        return Reply(
            content=f"I will hand each of the {plural(len(paths), 'file')} to a child agent.",
            tool_calls=[ToolCall("agent", {
                "message": f"{DEMO_CHILD}: count the lines and words of the file {p} with wc "
                           "and answer with the two numbers.",
            }, id=f"call_demo_{i}") for i, p in enumerate(paths)])

    def count(request: dict[str, Any]) -> Reply:
        path = task_of(request).split("of the file ", 1)[1].rsplit(" with wc", 1)[0]
        command = f"wc -l -w < {shlex.quote(path)}"
        return Reply(tool_calls=[ToolCall("run_cli", {"command": command})])

    def report(request: dict[str, Any]) -> Reply:
        output = tool_results(request)[0]
        match = re.fullmatch(r"\s*(\d+)\s+(\d+)\s*\[exit code: 0\]\s*", output)
        if match is None:
            return Reply(content=f"could not count: {' '.join(output.split())[:200]}")
        return Reply(content=f"lines={match[1]} words={match[2]}")

    def add_up(request: dict[str, Any]) -> Reply:
        paths = json.loads(task_of(request).split("FILES=", 1)[1])
        found = DemoTally(files=len(paths))
        rows, lines, words = [], 0, 0
        for path, text in zip(paths, tool_results(request), strict=False):
            result = _object(text)
            state = str(result.get("state") or "unknown")
            who = f"agent {result.get('agent_id', '?')}"
            if state != "done":
                found.unfinished[state] = found.unfinished.get(state, 0) + 1
                rows.append(f"  {path}: {state}: {result.get('error') or 'no reason given'} "
                            f"({who})")
                continue
            answer = " ".join(str(result.get("answer") or "").split())
            match = re.search(r"lines=(\d+) words=(\d+)", answer)
            if match is None:
                found.uncounted += 1
                rows.append(f"  {path}: done, but its answer is not a count: {answer[:200]!r} "
                            f"({who})")
                continue
            found.counted += 1
            lines, words = lines + int(match[1]), words + int(match[2])
            rows.append(f"  {path}: {plural(int(match[1]), 'line')}, "
                        f"{plural(int(match[2]), 'word')} ({who})")
        totals = f"{plural(lines, 'line')}, {plural(words, 'word')}"
        head = (f"{plural(found.files, 'file')}, {totals} in all" if found.counted == found.files
                else f"{plural(found.files, 'file')}, {found.counted} counted: {totals}")
        notes = [f"{plural(found.uncounted, 'child', 'children')} done without a count"
                 ] if found.uncounted else []
        notes += [f"{plural(n, 'child', 'children')} {state}"
                  for state, n in found.unfinished.items()]
        if tally is not None:
            tally.files, tally.counted = found.files, found.counted
            tally.uncounted, tally.unfinished = found.uncounted, found.unfinished
        return Reply(content="; ".join([head, *notes]) + ":\n" + "\n".join(rows))

    return ByTask({DEMO_ROOT: [fan_out, add_up], DEMO_CHILD: [count, report]})


def _object(text: str) -> dict[str, Any]:
    """A tool result as a JSON object (an empty one when it is not)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
