"""What the user sees while an agent works: thinking dim, commands, their output.

Everything goes to stderr except, in ``chat``, the streamed answer (stdout), so
``answer=$(swarm run ...)`` captures the answer alone.
"""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING

from swarm.agent.loop import Observer
from swarm.agent.tools import Call
from swarm.llm.types import ChatResult, StreamEvent

if TYPE_CHECKING:
    from redis import Redis

    from swarm.cli.live import LiveTree

DIM, BOLD, CYAN, RESET = "\033[2m", "\033[1m", "\033[36m", "\033[0m"
#: Lines of a command's output shown on the terminal (the model sees all of it).
SHOWN_LINES = 12


class TerminalView(Observer):
    """Renders the loop's progress as plain text, coloured when the stream is a terminal."""

    def __init__(self, err: IO[str] | None = None, out: IO[str] | None = None,
                 stream_answer: bool = False, color: bool | None = None) -> None:
        self.err = err or sys.stderr
        self.out = out or sys.stdout
        self.stream_answer = stream_answer
        self.color = self.err.isatty() if color is None else color
        self._mode = ""  # what the current line is: "", "reasoning" or "content"
        self._text: list[str] = []
        self.used = 0
        self.context = 0

    def _c(self, code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if self.color else text

    def _end_line(self) -> None:
        if self._mode:
            stream = self.out if self._mode == "content" and self.stream_answer else self.err
            stream.write(RESET + "\n" if self.color and self._mode == "reasoning" else "\n")
            stream.flush()
            self._mode = ""

    def on_event(self, event: StreamEvent) -> None:
        if event.kind == "reasoning":
            if self._mode != "reasoning":
                self._end_line()
                self.err.write(DIM + "thinking: " if self.color else "thinking: ")
                self._mode = "reasoning"
            self.err.write(event.text)
            self.err.flush()
        elif event.kind == "content":
            if self.stream_answer:
                if self._mode != "content":
                    self._end_line()
                    self._mode = "content"
                self.out.write(event.text)
                self.out.flush()
            else:
                self._text.append(event.text)

    def on_model_result(self, result: ChatResult) -> None:
        self._end_line()
        text, self._text = "".join(self._text).strip(), []
        if result.tool_calls and text and not self.stream_answer:
            self.err.write(text + "\n")

    def on_tool_start(self, call: Call, summary: str) -> None:
        self._end_line()
        label = "$ " if call.name == "run_cli" else "> "
        self.err.write(self._c(BOLD + CYAN, label + summary) + "\n")
        self.err.flush()

    def on_tool_result(self, call: Call, result: str) -> None:
        lines = result.rstrip("\n").splitlines()
        shown = lines[:SHOWN_LINES]
        if len(lines) > SHOWN_LINES:
            shown.append(f"... ({len(lines) - SHOWN_LINES} more lines)")
        self.err.write(self._c(DIM, "\n".join("  " + line for line in shown)) + "\n")
        self.err.flush()

    def on_usage(self, used_tokens: int, context_length: int) -> None:
        self.used, self.context = used_tokens, context_length

    def on_notice(self, text: str) -> None:
        self._end_line()
        self.err.write(self._c(DIM, f"[{text}]") + "\n")
        self.err.flush()

    def on_swarm_event(self, event: dict[str, str]) -> None:
        """A child's progress, one dim line each."""
        from swarm.coordinator.root import describe

        self._end_line()
        self.err.write(self._c(DIM, describe(event)) + "\n")
        self.err.flush()

    def swarm_view(self, redis_: Redis, swarm_id: str) -> LiveTree:
        """The live tree of ``swarm_id`` on this view's stderr when it is a terminal; else
        its events go to :meth:`on_swarm_event` as plain lines. Pass its ``on_swarm_event``
        to the root and ``close()`` it at the end."""
        from rich.console import Console

        from swarm.cli.live import LiveTree

        console = Console(file=self.err, force_terminal=self.color or None)
        return LiveTree(redis_, swarm_id, console=console, fallback=self.on_swarm_event,
                        enabled=self.color and not console.is_dumb_terminal)

    def context_bar(self, width: int = 20) -> str:
        """A dim bar of how full the context is, e.g. ``[####......] 41% of 128k``."""
        used, context = self.used, self.context
        if not context:
            return ""
        frac = min(used / context, 1.0)
        filled = round(frac * width)
        bar = "#" * filled + "." * (width - filled)
        return self._c(DIM, f"[{bar}] {frac:.0%} of {context // 1000}k context")
