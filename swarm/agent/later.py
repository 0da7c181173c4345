"""Work done soon, off the calling thread, by one thread made when this module is first
imported (by the worker's main thread, as it imports the sandbox).

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

log = logging.getLogger(__name__)

_JOBS: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()


def soon(job: Callable[[], object]) -> None:
    """Run ``job`` on the background thread (errors are logged)."""
    _JOBS.put(job)


def _run() -> None:
    while True:
        job = _JOBS.get()
        try:
            job()
        except Exception:
            log.exception("a background job failed")


def _start() -> None:
    threading.Thread(target=_run, daemon=True, name="swarm-later").start()


_start()
os.register_at_fork(after_in_child=_start)  # a forked child has no thread of its parent's
