"""A stop signal that also acts at once: a :class:`threading.Event` whose :meth:`set` runs
the callbacks registered with :meth:`StopEvent.on_set`.

What polls (a running command, an MCP call, the loop between steps) reads ``is_set()``
as before; what blocks in a call that cannot poll (a model call waiting for its answer)
registers a callback that cuts the call short, for as long as it runs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


class StopEvent(threading.Event):
    """An event that, when set, runs its registered callbacks (in the setting thread)."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._guard = threading.Lock()
        self._next = 0

    def set(self) -> None:
        super().set()
        with self._guard:
            callbacks = list(self._callbacks.values())
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one broken callback must not keep the others from stopping
                log.exception("a stop callback failed")

    @contextlib.contextmanager
    def on_set(self, callback: Callable[[], object]) -> Iterator[None]:
        """Run ``callback`` when the event is set while the block runs (at once if it is set
        already). It may run twice if the event is set as the block starts: make it
        idempotent, and quick (it runs in the thread that sets the event)."""
        with self._guard:
            key = self._next
            self._next += 1
            self._callbacks[key] = callback
        try:
            if self.is_set():
                callback()
            yield
        finally:
            with self._guard:
                del self._callbacks[key]
