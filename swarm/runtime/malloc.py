"""glibc's allocator for a worker process (:data:`WORKER_MALLOC`), set before it starts.

A worker runs each live child in a thread of its own. glibc gives every thread a cache of
freed blocks (tcache) that only that thread reuses, and up to eight arenas a core: memory
each child's thread freed stayed in its cache or arena while the child waited on its
command or its model (``python -m bench --only memory --memory-sizes 100``: about 15 KiB
of a worker's 130 a live child). Python's own allocator serves small objects, and the
interpreter's lock serializes most of the rest, so neither is worth that here. glibc
reads the settings only as a process starts: ``swarm worker`` starts itself again with
them (:func:`tune`) unless ``GLIBC_TUNABLES`` is set already (even empty: the operator's
choice is kept), and the commands it runs do not inherit them (:func:`untune`).
"""

from __future__ import annotations

import os
import sys

TUNABLES = "GLIBC_TUNABLES"
WORKER_MALLOC = "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=2"


def glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # not a glibc system
        return False


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a worker process to start with (:data:`WORKER_MALLOC` unless ``env``
    sets ``GLIBC_TUNABLES``), so it need not start itself again."""
    return env if TUNABLES in env or not glibc() else {**env, TUNABLES: WORKER_MALLOC}


def tune(argv: list[str]) -> None:
    """Re-exec ``python -m swarm *argv`` with :data:`WORKER_MALLOC` where glibc's
    allocator runs without it; return at once where it runs with it, or with the
    operator's ``GLIBC_TUNABLES``, or on another C library."""
    env = worker_env(dict(os.environ))
    if env.get(TUNABLES) == os.environ.get(TUNABLES):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "swarm", *argv], env)


def untune() -> None:
    """Keep :data:`WORKER_MALLOC` from the processes this one starts (the agents'
    commands): it is this process's setting, not theirs."""
    if os.environ.get(TUNABLES) == WORKER_MALLOC:
        del os.environ[TUNABLES]
