"""Keep secrets out of a long-running process's ``/proc/<pid>/environ``.

A command an agent runs is a child of its worker, and can read the worker's initial
environment from ``/proc/$PPID/environ``. :func:`hide_from_proc` re-executes the process
without the secret variables, handing them over through an inherited pipe; they are then
set in ``os.environ`` in memory only (which ``/proc/<pid>/environ`` does not show), and
commands never get them (:data:`SECRET_VARS`). :func:`handover` starts a process that way
from the outset (the local coordinator and workers of ``swarm run``).
"""

from __future__ import annotations

import json
import os
import sys

SECRET_VARS = ("SWARM_API_KEY", "OPENAI_API_KEY", "EVA_API_KEY", "SWARM_REDIS_URL")
"""Environment variables a command never sees (a Redis URL may carry a password)."""

FD_VAR = "SWARM_SECRETS_FD"


def handover(env: dict[str, str]) -> tuple[dict[str, str], int]:
    """``env`` without its secrets, and the read end of a pipe holding them (-1 when there
    are none) for a process that calls :func:`hide_from_proc`: pass the fd to it
    (``pass_fds``), then close it here. Its secrets are then never in its ``/proc``."""
    found = {name: env[name] for name in SECRET_VARS if env.get(name)}
    if not found:
        return env, -1
    read, write = os.pipe()
    os.write(write, json.dumps(found).encode())  # a few hundred bytes: fits the pipe buffer
    os.close(write)
    clean = {k: v for k, v in env.items() if k not in found}
    clean[FD_VAR] = str(read)
    return clean, read


def hide_from_proc(argv: list[str]) -> None:
    """Re-exec ``python -m swarm *argv`` without secrets in the environment, or, in the
    re-executed process, take them back from the pipe. Returns when that is done."""
    fd = os.environ.pop(FD_VAR, "")
    if fd:
        with os.fdopen(int(fd), "r") as pipe:
            os.environ.update(json.load(pipe))
        return
    env, read = handover(dict(os.environ))
    if read < 0:
        return
    os.set_inheritable(read, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "swarm", *argv], env)
