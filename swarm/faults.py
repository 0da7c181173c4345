"""Fault points for the fault-injection tests: a process dies for real at a named point.

``SWARM_FAULT=<point>`` makes the process that reaches ``point`` exit at once with
``os._exit(137)`` (as if SIGKILLed: no cleanup, no acknowledgement). Unset, a fault
point costs one dictionary lookup. Points: ``coordinator-after-first-dispatch``,
``worker-after-first-command``, ``worker-before-resume-claim``.
"""

from __future__ import annotations

import os
import sys


def point(name: str) -> None:
    """Die here if ``SWARM_FAULT`` names this point."""
    if os.environ.get("SWARM_FAULT") == name:
        sys.stderr.write(f"SWARM_FAULT: dying at {name}\n")
        sys.stderr.flush()
        os._exit(137)
