"""Waiting for a file descriptor to be readable, whatever its number: ``select()`` refuses
those of 1,024 and up, which a worker with a few hundred children's boxes open reaches (and
``select.select`` leaves three 16 KiB arrays on the stack of each thread that calls it)."""

from __future__ import annotations

import math
import select
from typing import Protocol


class HasFileno(Protocol):
    def fileno(self) -> int: ...


def readable(fd: int | HasFileno, timeout: float | None) -> bool:
    """Whether ``fd`` is readable (or at its end, or in error) within ``timeout`` seconds
    (None: no limit)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))
