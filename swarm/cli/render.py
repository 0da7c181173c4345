"""What the user sees while an agent works: thinking dim, text, commands, their output,
and a "waiting for MODEL at URL" line while the model is silent.

Everything goes to stderr except the answer (stdout), so ``answer=$(swarm run ...)``
captures the answer alone. Text streams as it comes: to stdout when the answer does
(``chat``, or stdout and stderr going to one place), else to stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING

from swarm.agent.loop import Observer
from swarm.agent.protocols import Model
from swarm.agent.tools import Call
from swarm.cli.waiting import Waiting
from swarm.domain.messages import ChatResult, StreamEvent
from swarm.text import plural

if TYPE_CHECKING:
    from redis import Redis

    from swarm.cli.live import LiveTree
    from swarm.config import Settings

DIM, BOLD, CYAN, RESET = "\033[2m", "\033[1m", "\033[36m", "\033[0m"
#: Lines of a command's output shown on the terminal (the model sees all of it).
SHOWN_LINES = 12


def same_destination(a: IO[str], b: IO[str]) -> bool:
    """Whether two streams write to the same file, pipe or terminal (``2>&1``, a tty)."""
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (OSError, ValueError):  # not a real file (io.StringIO, a test runner's capture)
        return False


class TerminalView(Observer):
    """Renders the loop's progress as plain text, coloured when the stream is a terminal.

    ``stream_answer`` sends the text to ``out`` as it comes (see :meth:`shown`); otherwise
    it streams to ``err``, unless ``err`` and ``out`` go to one place: then the text before
    tool calls shows when its message is whole, and the answer is left to the caller.
    ``waiting`` shows that a model call waits (None: nothing).
    """

    def __init__(self, err: IO[str] | None = None, out: IO[str] | None = None,
                 stream_answer: bool = False, color: bool | None = None,
                 waiting: Waiting | None = None) -> None:
        self.err = err or sys.stderr
        self.out = out or sys.stdout
        self.stream_answer = stream_answer
        self.color = self.err.isatty() if color is None else color
        self.waiting = waiting
        self._text_to: IO[str] | None = (
            self.out if stream_answer else None if same_destination(self.err, self.out)
            else self.err)
        self._mode = ""  # what the current line is: "", "reasoning" or "content"
        self._text: list[str] = []
        self._answer: str | None = None
        self._trees: list[LiveTree] = []
        self.used = 0
        self.context = 0

    @classmethod
    def for_settings(cls, settings: Settings, *, stream_answer: bool = False) -> TerminalView:
        """The view of ``swarm run`` / ``chat`` on this process's stderr and stdout."""
        return cls(stream_answer=stream_answer,
                   waiting=Waiting(sys.stderr, settings.base_url, interval=settings.wait_notice))

    def shown(self, answer: str) -> bool:
        """Whether ``answer`` (the last model message, without tool calls) already went whole
        to ``out`` as it streamed, so the caller need not print it again."""
        return self.stream_answer and bool(answer) and self._answer == answer

    def _c(self, code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if self.color else text

    def _end_line(self) -> None:
        if self._mode:
            stream = self._text_to if self._mode == "content" and self._text_to else self.err
            stream.write(RESET + "\n" if self.color and self._mode == "reasoning" else "\n")
            stream.flush()
            self._mode = ""

    @contextlib.contextmanager
    def model_call(self, model: Model) -> Iterator[None]:
        """Show that the model is waited for until its first piece (or its end)."""
        for tree in self._trees:
            tree.pause()  # never draw over a live tree (it pauses itself when the root wakes)
        self._text, self._answer = [], None
        if self.waiting is not None:
            self.waiting.start(lambda: model.model)
        try:
            yield
        finally:
            if self.waiting is not None:
                self.waiting.stop()

    def on_event(self, event: StreamEvent) -> None:
        if self.waiting is not None:
            self.waiting.stop()
        if event.kind == "reasoning":
            if self._mode != "reasoning":
                self._end_line()
                self.err.write(DIM + "thinking: " if self.color else "thinking: ")
                self._mode = "reasoning"
            self.err.write(event.text)
            self.err.flush()
        elif event.kind == "content":
            self._text.append(event.text)
            if self._text_to is not None:
                if self._mode != "content":
                    self._end_line()
                    self._mode = "content"
                self._text_to.write(event.text)
                self._text_to.flush()

    def on_model_result(self, result: ChatResult) -> None:
        self._end_line()
        text, self._text = "".join(self._text), []
        if not result.tool_calls:
            self._answer = text
        elif text.strip() and self._text_to is None:
            self.err.write(text.strip() + "\n")

    def on_tool_start(self, call: Call, summary: str) -> None:
        self._end_line()
        label = "$ " if call.name == "run_cli" else "> "
        self.err.write(self._c(BOLD + CYAN, label + summary) + "\n")
        self.err.flush()

    def on_tool_result(self, call: Call, result: str) -> None:
        lines = result.rstrip("\n").splitlines()
        shown = lines[:SHOWN_LINES]
        if len(lines) > SHOWN_LINES:
            shown.append(f"... ({plural(len(lines) - SHOWN_LINES, 'more line')})")
        self.err.write(self._c(DIM, "\n".join("  " + line for line in shown)) + "\n")
        self.err.flush()

    def on_usage(self, used_tokens: int, context_length: int) -> None:
        self.used, self.context = used_tokens, context_length

    def on_retry(self, text: str) -> None:
        """On the waiting line (one line redrawn on a terminal, a line a retry elsewhere),
        not a warning in the log."""
        if self.waiting is None:
            super().on_retry(text)
            return
        self._end_line()
        self.waiting.retrying(text)

    def on_notice(self, text: str) -> None:
        self._end_line()
        self.err.write(self._c(DIM, f"[{text}]") + "\n")
        self.err.flush()

    def on_swarm_event(self, event: dict[str, str]) -> None:
        """A child's progress, one dim line each."""
        from swarm.runtime.root import describe

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
        tree = LiveTree(redis_, swarm_id, console=console, fallback=self.on_swarm_event,
                        enabled=self.color and not console.is_dumb_terminal)
        self._trees.append(tree)
        return tree

    def context_bar(self, width: int = 20) -> str:
        """A dim bar of how full the context is, e.g. ``[####......] 41% of 128k``."""
        used, context = self.used, self.context
        if not context:
            return ""
        frac = min(used / context, 1.0)
        filled = round(frac * width)
        bar = "#" * filled + "." * (width - filled)
        return self._c(DIM, f"[{bar}] {frac:.0%} of {context // 1000}k context")
