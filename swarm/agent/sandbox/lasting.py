"""A box that lasts: one bubblewrap box per command environment (a child's turn on a
worker), whose runner (:mod:`swarm.agent.sandbox.runner`) runs its commands one at a time,
instead of a box set up and torn down for each command (namespaces, mounts, slirp4netns, a
cgroup: about twice a command's CPU).

Every guarantee of a box per command holds: the box is the same (:meth:`Box.argv`, under
the same seccomp filter, uid, limits and lifeline); each command has an output pipe of its
own (its write end passed to the runner over a socket only the worker and the runner
hold), so its output ends with it and is capped by the worker as before; the runner kills
everything a command left behind before it reports the command's end, and the box, with its
private ``/tmp``, ``$HOME`` and ``/dev/shm``, ends with the environment (:meth:`close`,
at the end of a child's turn), so nothing of one child's commands reaches another's box.
A command that times out or is cancelled gets SIGTERM, then SIGKILL, through the runner;
a runner that does not answer has its whole box killed. The box dies with its worker as
a box per command does: the parent-death signal and the lifeline pipe
(:mod:`~swarm.agent.sandbox.lifeline`, watched by the runner), and the end of the socket.

It needs a python3 in the box's system folders (:func:`box_python`); without one, or when
the runner cannot make itself safe, commands get a box each as before.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import struct
import subprocess
import time
import weakref
from pathlib import Path

from swarm.agent.fds import readable
from swarm.agent.sandbox.box import PIDS, SYSTEM, Box
from swarm.agent.sandbox.launch import Launch
from swarm.agent.sandbox.seccomp import program_fd

RUNNER = Path(__file__).with_name("runner.py")
#: Seconds a box has to start its runner.
START_TIMEOUT = 30.0
#: Seconds the runner has to report a command killed (SIGKILL) before the box is.
KILL_TIMEOUT = 2.0
#: Seconds a closed box has to end on its own before it is killed.
CLOSE_TIMEOUT = 1.0
_CHUNK = 1 << 16

_LIVE: weakref.WeakSet[LastingBox] = weakref.WeakSet()


@functools.cache
def box_python() -> str:
    """A python3 the box shows (in :data:`SYSTEM`'s folders), or ""."""
    found = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if found is None:
        return ""
    real = Path(found).resolve()
    return found if any(real.is_relative_to(s) for s in SYSTEM if s != "/sys") else ""


@functools.cache
def runner_text() -> str:
    """The runner's source, read once."""
    return RUNNER.read_text()


class Failed(Exception):
    """The lasting box could not start (the message says why): use a box per command."""


class LastingBox:
    """``box``'s lasting box for commands in ``workspace``; started by :meth:`start`."""

    def __init__(self, box: Box, workspace: Path, *, linked: Path | None = None,
                 runner: int | None = None, alive: int | None = None) -> None:
        self.box, self.workspace = box, workspace
        self.linked, self.runner, self.alive = linked, runner, alive
        self.launch: Launch | None = None
        self.sock: socket.socket | None = None

    def start(self, env: dict[str, str]) -> None:
        """Start the box with ``env`` and wait for its runner; :class:`Failed` when it does
        not come."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = program_fd()
        passed = (fd, theirs.fileno(), *([self.alive] if self.alive is not None else []))
        # bubblewrap runs the runner itself (no shell between them: one process less a box).
        program = [box_python(), "-I", "-S", "-c", runner_text(), str(theirs.fileno()),
                   str(self.alive if self.alive is not None else -1), str(PIDS)]
        try:
            self.launch = Launch(
                self.box, lambda hs: self.box.argv("", self.workspace, fd, self.linked,
                                                   runner=self.runner, handshake=hs,
                                                   program=program),
                pass_fds=passed, lifeline=self.alive is not None, cwd=self.workspace, env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            ours.close()
            raise Failed(f"the box did not start: {exc}") from exc
        finally:
            os.close(fd)
            theirs.close()
        self.sock = ours
        proc = self.launch.proc
        proc.args = []  # not kept while the box lasts: it holds the runner's source (7 KiB)
        assert proc.stderr is not None
        try:
            word = ours.recv(256) if readable(ours, START_TIMEOUT) else b""
            if word != b"ready":
                said = word[1:].decode(errors="replace") if word.startswith(b"E") else ""
                notes = "; ".join(n.strip("[]") for n in self.launch.notes)
                self.close()
                with contextlib.suppress(OSError, ValueError):
                    said = said or proc.stderr.read().decode(errors="replace").strip()
                raise Failed(said or notes or f"the box's runner did not start (exit code "
                                              f"{proc.returncode})")
        finally:
            proc.stderr.close()
        _LIVE.add(self)

    @property
    def alive_now(self) -> bool:
        return self.sock is not None and self.launch is not None \
            and self.launch.proc.poll() is None

    def run(self, command: str) -> BoxedCommand:
        """Start ``command`` in the box: its process-like handle (its output to read)."""
        assert self.sock is not None
        read, write = os.pipe()
        data = command.encode("utf-8", "surrogateescape")
        try:
            first = b"R" + struct.pack(">Q", len(data)) + data[:_CHUNK]
            self.sock.sendmsg([first], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                         struct.pack("i", write))])
            for at in range(_CHUNK, len(data), _CHUNK):
                self.sock.sendall(b"C" + data[at:at + _CHUNK])
        except OSError:
            os.close(read)
            raise
        finally:
            os.close(write)
        return BoxedCommand(self, read)

    def counts(self) -> tuple[int, int]:
        group = self.launch.group if self.launch is not None else None
        return group.counts() if group is not None else (0, 0)

    def notes(self, since: tuple[int, int]) -> str:
        """What the box lacks, and the limit the kernel enforced since ``since``."""
        if self.launch is None:
            return ""
        group = self.launch.group
        verdict = group.verdict(since) if group is not None else ""
        return "\n".join([*self.launch.notes, *([verdict] if verdict else [])])

    def close(self) -> None:
        """End the box and everything in it (idempotent)."""
        _LIVE.discard(self)
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        launch, self.launch = self.launch, None
        if launch is None:
            return
        # At the end of its socket the runner kills all in the box and exits, and with it
        # the box; bubblewrap killed when it does not (the box's init dies with it).
        try:
            launch.proc.wait(timeout=CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            launch.proc.kill()
            launch.proc.wait()
        launch.finish()


class BoxedCommand:
    """A command running in a :class:`LastingBox`, as much of :class:`subprocess.Popen` as
    :class:`~swarm.agent.shell.LocalEnvironment` uses: ``stdout``, :meth:`poll`,
    :meth:`wait`, and :meth:`stop` for its process group."""

    def __init__(self, box: LastingBox, read: int) -> None:
        self.box = box
        self.stdout = os.fdopen(read, "rb", buffering=0)
        self.returncode: int | None = None
        self.lost = False
        """Set when the box ended with the command (its runner killed, the box dead)."""

    def _report(self, timeout: float) -> int | None:
        if self.returncode is not None:
            return self.returncode
        sock = self.box.sock
        if sock is None:
            return self._gone()
        if not readable(sock, timeout):
            return None
        try:
            word = sock.recv(64)
        except OSError:
            word = b""
        if word.startswith(b"X") and word[1:].isdigit():
            self.returncode = int(word[1:])
            return self.returncode
        return self._gone()

    def _gone(self) -> int:
        """The box ended (or said something no runner says): it is not used again."""
        self.lost = True
        self.box.close()
        self.returncode = 137
        return self.returncode

    def poll(self) -> int | None:
        return self._report(0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._report(1.0 if left is None else left)
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("bash", timeout or 0)

    def signal(self, kill: bool) -> None:
        sock = self.box.sock
        if sock is not None and self.returncode is None:
            with contextlib.suppress(OSError):
                sock.send(b"K" if kill else b"T")

    def stop(self, grace: float) -> None:
        """SIGTERM the command's process group, SIGKILL it after ``grace`` seconds; the
        whole box when its runner does not say the command ended."""
        self.signal(kill=False)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(grace)
            return
        self.signal(kill=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(KILL_TIMEOUT)
            return
        self._gone()


def _forget() -> None:
    """In a forked child: drop the copies of the boxes' sockets (they would keep the boxes
    of the parent alive after it died)."""
    for box in list(_LIVE):
        if box.sock is not None:
            with contextlib.suppress(OSError):
                box.sock.close()
        box.sock, box.launch = None, None
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget)

