"""Keep secrets out of a long-running process's ``/proc/<pid>/environ``.

A command an agent runs is a child of its worker, and can read the worker's initial
environment from ``/proc/$PPID/environ``. :func:`hide_from_proc` re-executes the process
without the secret variables, handing them over through an inherited pipe; they are then
set in ``os.environ`` in memory only (which ``/proc/<pid>/environ`` does not show), and
commands never get them (:data:`SECRET_VARS`).
"""

from __future__ import annotations

import json
import os
import sys

SECRET_VARS = ("SWARM_API_KEY", "OPENAI_API_KEY", "EVA_API_KEY", "SWARM_REDIS_URL")
"""Environment variables a command never sees (a Redis URL may carry a password)."""

FD_VAR = "SWARM_SECRETS_FD"


def handover(env: dict[str, str]) -> tuple[dict[str, str], int | None]:
    """For a process about to be started that calls :func:`hide_from_proc`: ``env`` without
    the secret variables, and the read end of a pipe holding them (pass it to the process
    with ``pass_fds``, then close it), so it need not re-execute itself to hide them.
    (``env``, None) when there is no secret."""
    found = {name: env[name] for name in SECRET_VARS if env.get(name)}
    if not found:
        return env, None
    read, write = os.pipe()
    os.write(write, json.dumps(found).encode())  # a few hundred bytes: fits the pipe buffer
    os.close(write)
    out = {k: v for k, v in env.items() if k not in found}
    out[FD_VAR] = str(read)
    return out, read


def hide_from_proc(argv: list[str]) -> None:
    """Re-exec ``python -m swarm *argv`` without secrets in the environment, or, in the
    re-executed process, take them back from the pipe. Returns when that is done."""
    fd = os.environ.pop(FD_VAR, "")
    if fd:
        with os.fdopen(int(fd), "r") as pipe:
            os.environ.update(json.load(pipe))
        return
    env, read = handover(dict(os.environ))
    if read is None:
        return
    os.set_inheritable(read, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "swarm", *argv], env)
