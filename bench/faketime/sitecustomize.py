"""Loaded (``PYTHONPATH``) by every Python process of a simulated host whose clock runs
ahead under libfaketime (:func:`bench.hosts.host_env`).

libfaketime 0.9.10 with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` shifts the absolute monotonic
deadline of ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``, which ``time.sleep`` uses,
by the wall clock's offset: the call fails with EINVAL. (Faking the monotonic clock as well
hangs every timed wait: ``sem_clockwait`` is not intercepted and waits for a deadline 56
years on.) Timed waits on a lock work with the monotonic clock left alone, so ``time.sleep``
becomes one; the wall clock (``time.time``, ``date`` in commands) stays ahead.
"""

from __future__ import annotations

import threading
import time

_NEVER = threading.Event()


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _NEVER.wait(seconds)


time.sleep = _sleep
