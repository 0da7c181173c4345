"""``python -m swarm.agent.boxlaunch SPEC``: start one command in a worker's box and be
the worker's half of its handshake (:class:`swarm.agent.sandbox.Launch`: its cgroup, its
user-mode network), for a process the worker does not start itself: a stdio MCP server,
which the MCP SDK starts with no way to hand it a descriptor or to wait for it.

``SPEC`` is a JSON file the worker wrote (0600, in the server's own folder): the box
(:func:`box_to_json`), the command, its folder and the seccomp program's file. The
command's stdin and stdout are this process's (the SDK's pipes); this process waits for
it, cleans up after it and exits with its code. It dies with the worker (a parent-death
signal), and the box with it (bubblewrap's ``--die-with-parent``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from swarm.agent.boxnet import Network
from swarm.agent.cgroups import Limits
from swarm.agent.sandbox import Box, Launch

_PR_SET_PDEATHSIG = 1


def box_to_json(box: Box) -> dict[str, Any]:
    return dataclasses.asdict(box)


def box_from_json(data: dict[str, Any]) -> Box:
    fields = dict(data)
    net = fields.pop("net")
    limits = fields.pop("limits")
    for name in ("hide", "read_only", "show"):
        fields[name] = tuple(fields.get(name) or ())
    return Box(**fields, net=Network(net["mode"], tuple(net["deny"]), tuple(net["allow"])),
               limits=Limits(**limits) if limits is not None else None)


def write_spec(path: Path, box: Box, command: str, folder: Path, program: Path) -> None:
    """The spec file of one launch (readable by the worker's user only)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"box": box_to_json(box), "command": command, "folder": str(folder),
                   "program": str(program)}, out)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m swarm.agent.boxlaunch SPEC", file=sys.stderr)
        return 2
    # The worker's death ends this process, and with it the box.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        return 137
    spec = json.loads(Path(argv[0]).read_text())
    box, folder = box_from_json(spec["box"]), Path(spec["folder"])
    program = os.open(spec["program"], os.O_RDONLY)
    launch = Launch(box, lambda handshake: box.argv(spec["command"], folder, program,
                                                    handshake=handshake),
                    pass_fds=(program,), cwd=folder)
    os.close(program)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the SDK stops the server
        signal.signal(sig, lambda signum, _frame: launch.proc.send_signal(signum))
    code = launch.proc.wait()
    said = launch.finish()
    if said:
        print(said, file=sys.stderr)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
