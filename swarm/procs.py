"""Reading ``/proc/<pid>/stat`` (Linux): one parser for everything that looks at processes.

Every function returns None (or an empty answer) where there is no ``/proc``, as on macOS,
so callers fall back to what ``os.kill(pid, 0)`` tells.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` swarm uses."""

    state: str
    """``R``, ``S``, ``D``, ``T``, ``Z`` (zombie: exited, not reaped yet), ..."""
    ppid: int
    """The parent's pid."""
    pgrp: int
    """The process group id."""
    start: str
    """Start time in clock ticks since boot: with the pid, it names a process across pid reuse."""

    @property
    def zombie(self) -> bool:
        return self.state == "Z"


def parse_stat(text: str) -> ProcStat | None:
    """Parse the text of a ``stat`` file; None when it is not one.

    The command name (second field) is in parentheses and may hold spaces and ``)``,
    so the fields are counted from the last ``)``.
    """
    _, paren, rest = text.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) < 20:
        return None
    try:
        ppid, pgrp = int(fields[1]), int(fields[2])
    except ValueError:
        return None
    return ProcStat(state=fields[0], ppid=ppid, pgrp=pgrp, start=fields[19])


def read_stat(pid: int) -> ProcStat | None:
    """The stat of ``pid``; None when it is gone, there is no ``/proc``, or it cannot be read."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    return parse_stat(text)


def group_members(pgid: int) -> dict[int, ProcStat] | None:
    """Every process of group ``pgid`` by pid (a scan of all of ``/proc``); None without /proc."""
    try:
        names = os.listdir(PROC)
    except OSError:
        return None
    members: dict[int, ProcStat] = {}
    for name in names:
        if name.isdigit():
            stat = read_stat(int(name))
            if stat is not None and stat.pgrp == pgid:
                members[int(name)] = stat
    return members
