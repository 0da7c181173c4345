"""Fault points for the fault-injection tests: a process dies, or waits, for real at a named point.

``SWARM_FAULT=<point>`` makes the process that reaches ``point`` exit at once with
``os._exit(137)`` (as if SIGKILLed: no cleanup, no acknowledgement).
``SWARM_FAULT=<point>:<file>`` makes it write its pid to ``file`` the first time it reaches
``point``, and wait there until ``file`` is removed (at most :data:`PAUSE_MAX` seconds):
the test does something meanwhile (restarts Redis, say). Unset, a fault point costs one
dictionary lookup. Points: ``coordinator-after-first-dispatch``,
``worker-after-first-command``, ``worker-before-resume-claim``, ``worker-seeding`` (a new
child's workspace about to be fetched and checked out, its agent started),
``spawner-before-park`` (a parent saved parked, before its request is written), and a root's
``root-children-settled`` (woken, before it loads its session), ``root-before-finish``
(its answer saved, before its swarm is finished) and ``lock-renewal`` (its session lock's
renewal thread, before it renews).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

#: Seconds a paused process waits for its file to go before it goes on anyway.
PAUSE_MAX = 120.0
_paused: set[str] = set()
_lock = threading.Lock()


def point(name: str) -> None:
    """Die here, or wait here once, if ``SWARM_FAULT`` names this point."""
    fault = os.environ.get("SWARM_FAULT")
    if not fault:
        return
    target, _, file = fault.partition(":")
    if target != name:
        return
    if not file:
        sys.stderr.write(f"SWARM_FAULT: dying at {name}\n")
        sys.stderr.flush()
        os._exit(137)
    with _lock:
        if name in _paused:
            return
        _paused.add(name)
    flag = Path(file)
    flag.write_text(str(os.getpid()))
    deadline = time.monotonic() + PAUSE_MAX
    while flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
