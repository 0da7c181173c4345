"""Signs of life while a model call has not answered yet (a slow model is not a hang).

After ``threshold`` seconds without a first token, :class:`Waiting` says on stderr which
model it waits for and where: on a terminal, one line redrawn in place (a spinner and the
elapsed time) and erased when the answer starts; elsewhere (CI logs), one plain line and
then one every ``interval`` seconds. A try that failed and will be tried again
(:meth:`Waiting.retrying`) joins the line on a terminal, and is one line elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import IO

from swarm.text import public_url

DIM, RESET, ERASE = "\033[2m", "\033[0m", "\r\033[K"
SPINNER = "|/-\\"


class Waiting:
    """Shows on ``stream`` that a model call waits for its first token; :meth:`start` when
    the request goes out, :meth:`stop` when the answer starts or the call ends.

    ``tty`` (default: ``stream.isatty()`` outside a dumb terminal) draws in place every
    ``tick`` seconds; ``interval`` 0 or less shows nothing. A daemon thread per wait draws;
    once :meth:`stop` returns it writes nothing more, so the caller may write right after.
    """

    def __init__(self, stream: IO[str], endpoint: str, *, threshold: float = 2.0,
                 interval: float = 10.0, tty: bool | None = None, color: bool | None = None,
                 tick: float = 0.1) -> None:
        self.stream = stream
        self.endpoint = public_url(endpoint)
        self.threshold = threshold
        self.interval = interval
        self.tty = (stream.isatty() and os.environ.get("TERM") != "dumb") if tty is None \
            else tty
        self.color = self.tty if color is None else color
        self.tick = tick
        self._lock = threading.Lock()
        self._done: threading.Event | None = None
        self._drawn = False
        self._retry = ""
        self._active = False  # between start and stop: a line drawn now is erased by stop
        self._quiet_until = 0.0  # a retry's line was a sign of life: no waiting line before
        self._started = time.monotonic()
        self._model: Callable[[], str] = str

    def start(self, model: Callable[[], str]) -> None:
        """A request went out; ``model`` names the model when a line is drawn (a client may
        learn it only once the call started)."""
        self.stop()
        started = time.monotonic()
        with self._lock:
            self._started, self._model, self._active = started, model, True
        if self.interval <= 0:
            return
        done = threading.Event()
        with self._lock:
            self._done = done
        threading.Thread(target=self._run, args=(done, model, started),
                         name="swarm-waiting", daemon=True).start()

    def retrying(self, text: str) -> None:
        """A try failed and another follows (``text`` says why and when): on a terminal the
        waiting line shows it, drawn now and redrawn in place; elsewhere (or when no wait
        is shown, as the answer had begun) one line."""
        with self._lock:
            try:
                if not self.tty or not self._active:
                    self._write(text + "\n")
                    self._quiet_until = time.monotonic() + self.interval
                    return
                self._retry = " ".join(text.split())
                self._draw(self._line(0, time.monotonic() - self._started))
            except (OSError, ValueError):
                pass

    def stop(self) -> None:
        """The answer started (or the call ended): stop, and erase the line on a terminal."""
        with self._lock:
            done, self._done = self._done, None
            self._retry, self._active = "", False
            if done is not None:
                done.set()
            if self._drawn:
                self._drawn = False
                with contextlib.suppress(OSError, ValueError):
                    self._write(ERASE)

    def text(self, model: str, elapsed: float) -> str:
        """E.g. ``waiting for my-model at http://127.0.0.1:8080/v1 ... 12 s``."""
        return f"waiting for {model or 'the model'} at {self.endpoint} ... {int(elapsed)} s"

    def _line(self, frame: int, elapsed: float) -> str:
        """The line drawn on a terminal (hold the lock): the wait, or the last retry (what
        failed first: the end of the line may not fit)."""
        spinner = SPINNER[frame % len(SPINNER)]
        if self._retry:
            return f"{spinner} {int(elapsed)} s, {self._retry}"
        return f"{spinner} {self.text(self._model(), elapsed)}"

    def _run(self, done: threading.Event, model: Callable[[], str], started: float) -> None:
        due = started + self.threshold
        frame = 0
        while not done.wait(max(0.0, due - time.monotonic())):
            now = time.monotonic()
            with self._lock:
                if done.is_set():
                    return
                if not self.tty and now < self._quiet_until:
                    due = self._quiet_until
                    continue
                try:
                    if self.tty:
                        self._draw(self._line(frame, now - started))
                    else:
                        self._write(self.text(model(), now - started) + "\n")
                except (OSError, ValueError):  # stderr went away: nothing left to tell
                    return
            frame += 1
            due = now + self.tick if self.tty else due + self.interval

    def _draw(self, line: str) -> None:
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns or 80  # 0: not set
        except (OSError, ValueError):
            width = 80
        line = line[:max(width - 1, 10)]
        self._write(ERASE + (f"{DIM}{line}{RESET}" if self.color else line))
        self._drawn = True

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
