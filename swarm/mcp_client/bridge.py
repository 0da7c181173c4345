"""One asyncio event loop per process, on a daemon thread, where the MCP SDK (asyncio) runs
under the synchronous agent loop and the worker's threads.

The SDK's sessions live in tasks of this loop; :func:`call` runs a coroutine there from any
thread (``asyncio.run_coroutine_threadsafe``) and waits for it, cancelling it when the caller
gives up (a timeout, a cancel event, Ctrl-C). A forked child starts its own loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


class Abandoned(Exception):
    """The caller stopped waiting (its timeout passed, or its cancel event was set)."""


def loop() -> asyncio.AbstractEventLoop:
    """The process's loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None:
            new = asyncio.new_event_loop()
            ready = threading.Event()
            threading.Thread(target=_run, args=(new, ready), daemon=True,
                             name="mcp-loop").start()
            ready.wait()
            _loop = new
        return _loop


def running() -> bool:
    """Whether the loop was started in this process."""
    return _loop is not None


def _run(new: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(new)
    new.call_soon(ready.set)
    new.run_forever()


def call(coro: Coroutine[Any, Any, T], timeout: float | None = None,
         cancel: threading.Event | None = None) -> T:
    """Run ``coro`` on the loop and return its result (or raise its exception).

    :class:`Abandoned` after ``timeout`` seconds or once ``cancel`` is set; the coroutine is
    then cancelled, as it is when the caller is interrupted."""
    future = asyncio.run_coroutine_threadsafe(coro, loop())
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            wait = 0.25 if cancel is not None else None
            if deadline is not None:
                left = max(deadline - time.monotonic(), 0.0)
                wait = left if wait is None else min(wait, left)
            done, _ = concurrent.futures.wait([future], timeout=wait)
            if done:
                return future.result()
            if cancel is not None and cancel.is_set():
                raise Abandoned("cancelled")
            if deadline is not None and time.monotonic() >= deadline:
                raise Abandoned(f"no answer within {timeout:g} s")
    except BaseException:
        future.cancel()
        raise


def _forget() -> None:
    """In a forked child: the parent's loop thread does not exist here."""
    global _loop, _lock
    _loop, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget)
