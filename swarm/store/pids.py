"""The processes of the embedded server: is a pid alive (not a zombie, not reused), is it
a Valkey server, and stopping one (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from swarm import procs

# Servers started by this process, so their exit is reaped (no zombies) and their
# Popen objects are not garbage-collected while they run.
CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def proc_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), to detect pid reuse."""
    stat = procs.read_stat(pid)
    return stat.start if stat is not None else None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs: not gone, and not a zombie (exited, not reaped yet)."""
    if pid <= 0:
        return False
    child = CHILDREN.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        del CHILDREN[pid]
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = procs.read_stat(pid)  # a zombie (exited, not yet reaped) is dead for us
    return stat is None or not stat.zombie


def looks_like_server(pid: int) -> bool:
    """True when ``pid``'s command line is a Valkey (or Redis) server's."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        if sys.platform.startswith("linux"):
            return False
        try:  # macOS: no /proc
            cmdline = subprocess.run(
                ["ps", "-p", str(pid), "-o", "command="],
                capture_output=True, check=False, timeout=5,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return False
    return b"valkey-server" in cmdline or b"redis-server" in cmdline


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``pid`` to end; False if it still runs."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def kill(pid: int) -> None:
    """SIGTERM, then SIGKILL after 3 s."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if wait_gone(pid, wait):
            return
