"""A worker's stdio MCP servers start in its box, as its children's commands do.

A server's command comes from the swarm's recorded configuration (what the user gave when
the swarm started or the job was submitted), but it is a program the worker starts on the
model's behalf, next to the workspaces its boxes write: it runs in bubblewrap like a
command (:meth:`swarm.agent.sandbox.Box.argv`: uid 65534, no capabilities, seccomp; the
environment the MCP SDK gives a server, ``PATH``, ``HOME``, ``USER`` and the like, plus
its own ``env``), in a folder the worker makes for
it under ``SWARM_HOME/mcp`` (never a child's workspace), so it reads neither the worker's
memory nor its files. One server per configuration per worker, shared by its children, as
before (:mod:`swarm.mcp_client.pool`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.agent.boxlaunch import write_spec
from swarm.agent.sandbox import Box, seccomp_program

if TYPE_CHECKING:  # the MCP SDK takes seconds to import: only agents with servers load it
    from swarm.mcp_client.config import ServerSpec
    from swarm.mcp_client.pool import Launch

#: The descriptor the box's seccomp program is read from: opened by a shell from
#: :data:`PROGRAM_FILE` just before bubblewrap runs (the SDK starts the server's process
#: and passes it no descriptor of ours).
SECCOMP_FD = 3
PROGRAM_FILE = "seccomp.bpf"
#: The spec of a server's launch (:mod:`swarm.agent.boxlaunch`), named for its folder.
LAUNCH_FILE = "launch.json"
OPEN_PROGRAM = 'exec 3<"$0" || exit 126; exec "$@"'

_LOCK = threading.Lock()


class BoxedServers:
    """Starts stdio servers in ``box`` (a worker's), each in its own folder under
    ``folder``; a :class:`swarm.mcp_client.pool.Launcher`."""

    def __init__(self, box: Box, folder: Path) -> None:
        # Not a child's parent's workspace: the server is shared by every child.
        self.box = dataclasses.replace(box, read_only=())
        self.folder = folder

    @property
    def key(self) -> str:
        return f"box uid {self.box.run_as} network {self.box.net.mode} in {self.folder}"

    def __call__(self, spec: ServerSpec) -> Launch:
        from swarm.mcp_client.pool import Launch

        where = self.folder / server_folder(spec)
        where.mkdir(parents=True, exist_ok=True)
        self.box.prepare(where)
        program = self._program()
        command = "exec " + shlex.join([spec.command, *spec.args])
        if self.box.handshake:  # its network and cgroup need the worker's half: a launcher
            # Beside the server's folder, never in it: the box writes that one, and the
            # launcher (the worker's user, unconfined) obeys the spec.
            launch = self.folder / f"{where.name}.{LAUNCH_FILE}"
            write_spec(launch, self.box, command, where, program)
            return Launch(sys.executable, ("-m", "swarm.agent.boxlaunch", str(launch)), where)
        argv = self.box.argv(command, where, SECCOMP_FD)
        return Launch("/bin/sh", ("-c", OPEN_PROGRAM, str(program), *argv), where)

    def _program(self) -> Path:
        """The seccomp program in a file only this worker's user may read."""
        path = self.folder / PROGRAM_FILE
        program = seccomp_program()
        with _LOCK:
            try:
                if path.read_bytes() == program:
                    return path
            except OSError:
                pass
            tmp = path.with_name(f".{PROGRAM_FILE}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, program)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        return path


def server_folder(spec: ServerSpec) -> str:
    """The name of a server's folder: its name and a digest of its command line (not of
    its environment, which may hold secrets)."""
    digest = hashlib.sha256(json.dumps([spec.command, *spec.args]).encode()).hexdigest()
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.name)[:40]}-{digest[:12]}"
