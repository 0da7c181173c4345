"""Work done soon, off the calling thread, by threads this module makes: one made when it
is first imported (by the worker's main thread, as it imports the sandbox), and a few for
boxes (:data:`BOXES`), which that one makes on first use.

Not a thread per job: a thread started by a run's thread shares that thread's filesystem
context, and while it lives the run's thread cannot go back to the worker's mount
namespace after working in its own (:func:`swarm.workspace.views.rejoin`: ``setns`` fails
with EINVAL)."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Threads:
    """``count`` threads that run the jobs given them, in turn; made by the thread that
    makes this object (``eager``) or, on first use, by :func:`soon`'s."""

    def __init__(self, count: int, name: str, eager: bool = False) -> None:
        self.count, self.name, self.eager = count, name, eager
        self._begin()
        os.register_at_fork(after_in_child=self._begin)  # a child has none of the parent's

    def _begin(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._started = self.eager
        if self.eager:
            self._start()

    def _start(self) -> None:
        for i in range(self.count):
            threading.Thread(target=self._run, daemon=True, name=f"{self.name}-{i}").start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException:  # the thread never ends: a box dies with its thread
                log.exception("a background job failed")

    def soon(self, job: Callable[[], object]) -> None:
        """Run ``job`` on one of the threads (errors are logged)."""
        with self._lock:
            if not self._started:
                self._started = True
                _LATER.soon(self._start)
        self._jobs.put(job)

    def submit(self, job: Callable[[], T]) -> futures.Future[T]:
        """Run ``job`` on one of the threads; its future (cancelled while still queued,
        it does not run)."""
        future: futures.Future[T] = futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:
                    future.set_exception(exc)

        self.soon(run)
        return future


_LATER = Threads(1, "swarm-later", eager=True)

BOXES = Threads(8, "swarm-box")
"""Threads that start and close the sandbox's lasting boxes for runs (a box dies with the
thread that started it: its parent-death signal is the thread's)."""


def soon(job: Callable[[], object]) -> None:
    """Run ``job`` on the background thread (errors are logged)."""
    _LATER.soon(job)
