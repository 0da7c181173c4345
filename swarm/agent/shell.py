"""Run shell commands in a workspace: capped, binary-safe, killable as a process group.

Never ``os.chdir``: a worker runs many agents in threads of one process, so every
command gets ``cwd=`` instead.

Over 400 lines because capping the output, decoding it binary-safe, timing out and killing
the process group are the parts of one command's run (:meth:`LocalEnvironment.execute`), each
needed by the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path

from swarm import procs
from swarm.agent import later
from swarm.agent.boxnet import Network
from swarm.agent.cgroups import Limits
from swarm.agent.protocols import CommandResult
from swarm.agent.sandbox import (
    UID,
    Box,
    Launch,
    add_git_stat_check,
    choose,
    environment,
    netslots,
    pdeathsig_setpriv,
    program_fd,
    runner_pipe,
)
from swarm.agent.sandbox.box import Handshake
from swarm.agent.sandbox.lasting import BoxedCommand, Failed, LastingBox, box_python
from swarm.errors import PathRefused, ToolError
from swarm.secrets import SECRET_VARS

QUIET_VARS = {"PAGER": "cat", "GIT_PAGER": "cat", "TERM": "dumb", "GIT_TERMINAL_PROMPT": "0"}
"""Set for every command so nothing pages or waits for a prompt."""

BACKGROUND_DRAIN = 0.5
"""Seconds to keep reading after bash exits while a background child holds the output open."""

KILL_GRACE = 1.0
"""Seconds between SIGTERM and SIGKILL when a process group is killed."""

_CHUNK = 65536
_TICK = 0.05
_CONTINUATION = bytes(range(0x80, 0xC0))

DIE_WITH_RUNNER = ('trap "kill -KILL 0" USR1; trap : TERM; [ "$PPID" = "$2" ] || exit 137; '
                   'bash -c "$1" & p=$!; '
                   'while :; do wait $p; s=$?; kill -0 $p 2>/dev/null || exit $s; done')
"""The shell an unconfined command runs in: when its runner dies (``setpriv --pdeathsig
USR1``: the thread that started it is gone, say the worker was SIGKILLed), it kills the
command's whole process group, so a command never goes on after its worker's lease can
have been handed over. A runner that died before ``setpriv`` set the signal (between the
fork and the ``prctl``) sends none: the shell, whose parent is then no longer the runner
(``$2``, its pid), does not start the command. (A sandboxed command dies with its runner
by bubblewrap's ``--die-with-parent``.) A SIGTERM to the group (cancel, timeout) stops the
command; this shell outlives it to reap it and exit with its status (no zombie left to
init)."""

BACKGROUND_NOTE = "[bash exited; background processes still hold the output open: not waited for]"
CANCEL_NOTE = "[cancelled: the command and its children were killed]"
LOST_NOTE = ("[the sandbox's box ended with the command (was its runner killed?): the next "
             "command starts in a new one]")


def child_env(extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` without secrets, plus the no-pager/no-prompt settings and ``extra_env``."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARS}
    env.update(QUIET_VARS)
    if extra_env:
        env.update(extra_env)
    return env


def unconfined_argv(command: str) -> list[str]:
    """How this process runs an unconfined command: in a shell that dies with it, taking
    the command's process group along (:data:`DIE_WITH_RUNNER`); plain ``bash -c`` where
    ``setpriv`` is missing."""
    setpriv = pdeathsig_setpriv()
    if not setpriv:
        return ["bash", "-c", command]
    return [setpriv, "--pdeathsig", "USR1", "--", "bash", "-c", DIE_WITH_RUNNER, "bash",
            command, str(os.getpid())]


def clamp_timeout(requested: int | None, default: int, ceiling: int) -> int:
    """The timeout to use: ``requested`` (or ``default`` when missing or not positive),
    at most ``ceiling`` and at least 1 second."""
    value = default if requested is None or requested <= 0 else requested
    return max(1, min(int(value), ceiling))


def _char_count(data: bytes | bytearray) -> int:
    """Characters in UTF-8 ``data`` (bytes that do not continue a character)."""
    return len(data.translate(None, _CONTINUATION))


class _CappedBuffer:
    """Keeps the first and last ``half`` characters of a byte stream, counting what is dropped.

    Bytes are kept (up to 4 per character, the UTF-8 maximum) and decoded only at the end,
    so a character split across two reads decodes fine.
    """

    def __init__(self, cap: int) -> None:
        self.half = max(cap // 2, 1)
        self.limit = self.half * 4
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped_chars = 0

    def add(self, data: bytes) -> None:
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        excess = len(self.tail) - self.limit
        if excess > 0:
            # Cut on a character boundary so the kept tail starts with a whole character.
            while excess < len(self.tail) and 0x80 <= self.tail[excess] < 0xC0:
                excess += 1
            self.dropped_chars += _char_count(self.tail[:excess])
            del self.tail[:excess]

    def text(self) -> tuple[str, int]:
        """The kept output (with a marker where it was cut) and the number of characters cut."""
        if not self.dropped_chars:
            whole = _decode(bytes(self.head + self.tail))
            if len(whole) <= 2 * self.half:
                return whole, 0
            head, tail = whole[: self.half], whole[-self.half :]
            cut = len(whole) - 2 * self.half
        else:
            head_all = _decode(bytes(self.head))
            tail_all = _decode(bytes(self.tail))
            head, tail = head_all[: self.half], tail_all[-self.half :]
            cut = (
                len(head_all) - len(head) + self.dropped_chars + len(tail_all) - len(tail)
            )
        return f"{head}\n[... {cut} characters cut ...]\n{tail}", cut


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").replace("\x00", "\ufffd")


def _kill_group(proc: subprocess.Popen[bytes] | BoxedCommand) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL whatever is left after a grace."""
    if isinstance(proc, BoxedCommand):
        proc.stop(KILL_GRACE)
        return
    pgid = proc.pid  # start_new_session=True: the child leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.poll()
        return
    group = _Group(pgid)
    deadline = time.monotonic() + KILL_GRACE
    while time.monotonic() < deadline:
        proc.poll()  # reap bash, so a zombie leader does not look alive
        if not group.alive():
            return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE)


class _Group:
    """Whether process group ``pgid`` still has a live (non-zombie) member, cheaply.

    ``os.killpg(pgid, 0)`` says whether any member exists, zombies included (an orphan
    waits for init to reap it; some container inits never do). Only when it says yes does
    this look closer: at the members seen before, and, when none of them is alive, at most
    every ``RESCAN`` seconds at a scan of ``/proc`` for members not seen yet.
    """

    RESCAN = 0.2

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.members: set[int] = set()
        self.scanned_at: float | None = None

    def alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        for pid in list(self.members):
            stat = procs.read_stat(pid)
            if stat is not None and stat.pgrp == self.pgid and not stat.zombie:
                return True
            self.members.discard(pid)  # gone, a zombie, or the pid was reused
        now = time.monotonic()
        if self.scanned_at is not None and now - self.scanned_at < self.RESCAN:
            return True  # a zombie not reaped yet, or a member forked since the last scan
        self.scanned_at = now
        found = procs.group_members(self.pgid)
        if found is None:
            return True  # no /proc (macOS): trust killpg
        self.members = {pid for pid, stat in found.items() if not stat.zombie}
        return bool(self.members)


Mounts = Callable[[], contextlib.AbstractContextManager[object]]
"""A block in the mount namespace a box must be started in (:attr:`LocalEnvironment.mounts`)."""


class LocalEnvironment:
    """An :class:`~swarm.agent.protocols.Environment` running ``bash -c`` on this host."""

    def __init__(
        self,
        workspace: Path,
        output_cap: int = 20_000,
        cancel: threading.Event | None = None,
        extra_env: dict[str, str] | None = None,
        sandbox: str = "none",
        network: bool | str | Network = True,
        hide: tuple[Path, ...] = (),
        pass_env: tuple[str, ...] = (),
        read_only: tuple[Path, ...] = (),
        sandbox_uid: int = UID,
        die_with_runner: bool = False,
        linked: Path | None = None,
        beneath: Path | None = None,
        limits: Limits | None = None,
        show: tuple[str, ...] = (),
        lasting: bool = True,
    ) -> None:
        if output_cap <= 0:
            raise ValueError("output_cap must be positive")
        self.workspace = Path(workspace)
        self.output_cap = output_cap
        self.cancel = cancel
        self.extra_env = dict(extra_env or {})
        self.choice = choose(sandbox, network=network, hide=hide, read_only=read_only,
                             uid=sandbox_uid, limits=limits, show=show)
        """Where commands run (``SWARM_SANDBOX``: ``none``, ``auto`` or ``bwrap``; as host
        uid ``sandbox_uid`` when this process is root; ``network``: the box's, see
        :func:`~swarm.agent.sandbox.choose`; ``limits``: its cgroup's)."""
        self._prepared = False
        self.pass_env = pass_env
        self.die_with_runner = die_with_runner
        """Unconfined commands die with this process (:func:`unconfined_argv`): a worker's.
        (Off in a terminal, where a command's ``$PPID`` stays the agent's process.)"""
        self.linked = linked
        """The folder whose ``.git`` the workspace's git worktree is registered on, when the
        workspace is a copy-on-write view of it (the sandbox binds that worktree's git)."""
        self.beneath = beneath
        """The folder the workspace must lie in (a job's jobs root): the sandbox opens the
        workspace from there without following a symbolic link before it grants it."""
        self._env: dict[str, str] | None = None
        self.lasting = lasting and bool(box_python())
        """Sandboxed commands run in one box that lasts until :meth:`close`
        (:mod:`swarm.agent.sandbox.lasting`); False: a box each (where the box shows no
        python3 for its runner, or its runner fails to start, it is so anyway)."""
        self._box: LastingBox | None = None
        self._box_lock = threading.Lock()
        self._warming: futures.Future[None] | None = None
        self._closed = False
        """Set by :meth:`close`: no box is started ahead after it."""
        self.mounts: Mounts | None = None
        """The mount namespace the boxes start in, entered for each start (a run's in a
        view: :class:`swarm.workspace.views.Isolation`); None: the starting thread's."""

    def warm(self) -> None:
        """Start the lasting box now, before any command (a child's model thinks
        meanwhile), on one of this process's threads for boxes
        (:data:`~swarm.agent.later.BOXES`: a box dies with the thread that started it,
        whose parent-death signal it has, so never on a thread that ends); its first
        command waits for it, or starts it itself while it is still queued. Nothing to do
        unconfined, for a box per command, or called from a thread in a mount namespace of
        its own without :attr:`mounts`, which the box must copy: the first command starts
        it there."""
        if self.choice.box is None or not self.lasting or self._warming is not None \
                or self._closed or (self.mounts is None and netslots.own_mounts(unknown=True)):
            return
        self._warming = later.BOXES.submit(self._warm)

    def _warm(self) -> None:
        box = self.choice.box
        assert box is not None
        with self._box_lock:
            if self._box is None and not self._closed:
                # A failure here is the first command's to report: it tries again.
                with contextlib.suppress(ToolError, OSError):
                    self._prepare(box)
                    self._lasting(box)

    def _mounted(self) -> contextlib.AbstractContextManager[object]:
        """Where a box starts: in :attr:`mounts`, else where the calling thread is. (An
        OSError: its run has ended.)"""
        return self.mounts() if self.mounts is not None else contextlib.nullcontext()

    def _warmed(self) -> None:
        """:meth:`warm`'s start withdrawn while still queued, else waited for."""
        warming, self._warming = self._warming, None
        if warming is not None and not warming.cancel():
            futures.wait([warming])

    def close(self) -> None:
        """End the box the commands ran in, and whatever is left in it (idempotent)."""
        self._warmed()  # a box starting now would outlive the close
        with self._box_lock:
            self._closed = True
            box, self._box = self._box, None
        if box is not None:
            box.close()

    def env(self) -> dict[str, str]:
        """The commands' environment, built at the first command (copying ``os.environ``
        for each was a quarter of a command's CPU in a worker): unconfined, all of it but
        secrets (:func:`child_env`); sandboxed, what :data:`~swarm.agent.sandbox.PASSED` names."""
        if self._env is None:
            self._env = self._new_env()
        return self._env

    def _new_env(self) -> dict[str, str]:
        if self.choice.box is None:
            return child_env(self.extra_env)
        env = environment(os.environ, self.pass_env)
        env.update(QUIET_VARS)
        env.update(self.extra_env)
        add_git_stat_check(env)
        return env

    def execute(self, command: str, timeout: int, *,
                output_cap: int | None = None) -> CommandResult:
        """Run ``command`` in the workspace for at most ``timeout`` seconds, keeping
        ``output_cap`` characters of its output (default: :attr:`output_cap`).

        Never raises for the command's own failure; raises :class:`ToolError` when the
        workspace is missing, and re-raises KeyboardInterrupt after killing the command.
        """
        if not self.workspace.is_dir():
            raise ToolError(
                f"workspace {self.workspace} does not exist or is not a directory; "
                "create it or run swarm from an existing folder"
            )
        if "\0" in command:
            raise ToolError(
                "the command contains a NUL byte (\\0), which no program argument can hold; "
                "remove it, or produce the byte inside the command, e.g. printf '\\0'"
            )
        box = self.choice.box
        if box is not None:
            self._warmed()
            self._prepare(box)
        if box is not None and self.lasting and self._box_lock.acquire(blocking=False):
            try:  # a command started while another runs (another thread) gets a box of its own
                result = self._execute_in(box, command, timeout, output_cap or self.output_cap)
                if result is not None:
                    return result
            finally:
                self._box_lock.release()
        fd = program_fd() if box is not None else -1
        alive = (runner_pipe(),) if box is not None and self.die_with_runner else ()
        launch: Launch | None = None
        try:
            popen = {"cwd": self.workspace, "stdin": subprocess.DEVNULL,
                     "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT,
                     "start_new_session": True, "env": self.env()}
            if box is None:
                proc = subprocess.Popen(self.argv(command, fd), **popen)  # type: ignore[call-overload]
            else:
                with self._mounted():
                    launch = Launch(box, lambda hs: self.argv(command, fd, hs),
                                    pass_fds=(fd, *alive), lifeline=bool(alive), **popen)
                proc = launch.proc
        except OSError as exc:
            raise ToolError(f"cannot start bash: {exc}; is bash installed and on PATH?") from exc
        except ValueError as exc:  # a NUL byte in the environment or the workspace path
            raise ToolError(f"cannot start bash: {exc}") from exc
        finally:
            if fd >= 0:
                os.close(fd)
        try:
            result = self._run(proc, timeout, output_cap or self.output_cap)
        finally:
            said = launch.finish() if launch is not None else ""
        if said:
            sep = "" if not result.output or result.output.endswith("\n") else "\n"
            result = dataclasses.replace(result, output=f"{result.output}{sep}{said}")
        return result

    def _prepare(self, box: Box) -> None:
        """Give the box's uid the workspace, once (:meth:`Box.prepare`); ToolError."""
        if self._prepared:
            return
        try:
            box.prepare(self.workspace, self.linked, self.beneath)
        except PathRefused as exc:
            raise ToolError(f"the workspace is refused: {exc}") from exc
        except OSError as exc:
            raise ToolError(f"cannot give the sandbox's uid {box.run_as} the workspace "
                            f"{self.workspace}: {exc}; put SWARM_HOME and the workspace on "
                            "a filesystem with POSIX ACLs (ext4, xfs, btrfs, tmpfs), or "
                            "run the worker as a user of its own") from exc
        self._prepared = True

    def _lasting(self, box: Box) -> LastingBox | None:
        """The lasting box, started when there is none (or it ended); None where it cannot
        start (then commands get a box each from now on)."""
        if self._box is not None and self._box.alive_now:
            return self._box
        if self._box is not None:
            self._box.close()
        self._box = LastingBox(box, self.workspace, linked=self.linked,
                               runner=os.getpid() if self.die_with_runner else None,
                               alive=runner_pipe() if self.die_with_runner else None)
        try:  # its environment is not kept: a box starts once a child (a command otherwise)
            with self._mounted():
                self._box.start(self._env or self._new_env())
        except Failed:
            self._box, self.lasting = None, False
            return None
        except OSError:  # from mounts: the run has ended, or its thread is stuck away
            started, self._box = self._box, None
            if started is not None:
                started.close()
            raise
        weakref.finalize(self, self._box.close)  # one dropped without close() (a test's)
        return self._box

    def _execute_in(self, box: Box, command: str, timeout: int,
                    output_cap: int) -> CommandResult | None:
        """:meth:`execute` in the lasting box (a new one when it ended since the last
        command); None where there can be none."""
        lasting = self._lasting(box)
        if lasting is None:
            return None
        since = lasting.counts()
        try:
            proc = lasting.run(command)
        except OSError:  # it ended since the last command: a new one, once
            lasting.close()
            lasting = self._lasting(box)
            if lasting is None:
                return None
            since = lasting.counts()
            try:
                proc = lasting.run(command)
            except OSError as exc:
                lasting.close()
                raise ToolError(f"the sandbox's box ended before the command started ({exc}); "
                                "run it again") from exc
        result = self._run(proc, timeout, output_cap)
        said = lasting.notes(since)
        if proc.lost and result.exit_code is not None:
            said = "\n".join(filter(None, [said, LOST_NOTE]))
        if said:
            sep = "" if not result.output or result.output.endswith("\n") else "\n"
            result = dataclasses.replace(result, output=f"{result.output}{sep}{said}")
        return result

    def argv(self, command: str, seccomp_fd: int = -1,
             handshake: Handshake | None = None) -> list[str]:
        """How ``command`` starts: in its box (``seccomp_fd``: the filter's pipe;
        ``handshake``: see :meth:`~swarm.agent.sandbox.Box.argv`), in a shell that dies
        with this process (:func:`unconfined_argv`), or in plain bash."""
        box = self.choice.box
        if box is None:
            return unconfined_argv(command) if self.die_with_runner else ["bash", "-c", command]
        if not self.die_with_runner:
            return box.argv(command, self.workspace, seccomp_fd, self.linked,
                            handshake=handshake)
        return box.argv(command, self.workspace, seccomp_fd, self.linked, runner=os.getpid(),
                        alive_fd=runner_pipe(), handshake=handshake)

    def _run(self, proc: subprocess.Popen[bytes] | BoxedCommand, timeout: int,
             output_cap: int) -> CommandResult:
        """Collect the output of the started ``proc`` (see :meth:`execute`)."""
        assert proc.stdout is not None
        buffer = _CappedBuffer(output_cap)
        try:
            exit_code, note, timed_out = self._collect(proc, buffer, timeout)
        except BaseException:
            _kill_group(proc)
            proc.stdout.close()
            raise
        proc.stdout.close()
        output, cut = buffer.text()
        if note:
            sep = "" if not output or output.endswith("\n") else "\n"
            output = f"{output}{sep}{note}"
        return CommandResult(output=output, exit_code=exit_code, timed_out=timed_out,
                             cut_chars=cut, cancelled=note == CANCEL_NOTE)

    def _collect(
        self, proc: subprocess.Popen[bytes] | BoxedCommand, buffer: _CappedBuffer,
        timeout: float
    ) -> tuple[int | None, str, bool]:
        """Read output until the command ends; return (exit code, note, timed out)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        background_deadline: float | None = None
        eof = False
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                if self.cancel is not None and self.cancel.is_set():
                    _kill_group(proc)
                    _drain(fd, buffer)
                    return None, CANCEL_NOTE, False
                now = time.monotonic()
                if now >= deadline:
                    _kill_group(proc)
                    _drain(fd, buffer)
                    return None, "", True
                wait = min(_TICK, deadline - now)
                if eof:
                    try:
                        return proc.wait(timeout=wait), "", False
                    except subprocess.TimeoutExpired:
                        continue
                if sel.select(timeout=wait):
                    data = os.read(fd, _CHUNK)
                    if data:
                        buffer.add(data)
                    else:
                        eof = True
                        continue
                code = proc.poll()
                if code is None:
                    continue
                # bash is gone; if something it started still holds the pipe open, stop
                # reading after a short drain and leave that process alone.
                if background_deadline is None:
                    background_deadline = time.monotonic() + BACKGROUND_DRAIN
                elif time.monotonic() >= background_deadline:
                    return code, BACKGROUND_NOTE, False


def _drain(fd: int, buffer: _CappedBuffer, limit: float = 0.2) -> None:
    """Read what is already in the pipe after a kill, for at most ``limit`` seconds."""
    end = time.monotonic() + limit
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while time.monotonic() < end and sel.select(timeout=0.01):
            data = os.read(fd, _CHUNK)
            if not data:
                return
            buffer.add(data)
