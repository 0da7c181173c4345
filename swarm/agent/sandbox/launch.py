"""Starting a box command: for a box that waits for its worker, its cgroup joined and its
user-mode network served before it is let go, and both cleaned up after it
(:class:`Launch`)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

from swarm import procs
from swarm.agent import boxnet, cgroups
from swarm.agent.cgroups import Limits
from swarm.agent.sandbox import netslots
from swarm.agent.sandbox.box import Box, Handshake
from swarm.agent.sandbox.seccomp import data_fd


@functools.cache
def cgroup_tree(limits: Limits) -> cgroups.Tree | str:
    """This process's cgroup subtree for boxes with ``limits`` (made once, removed at
    exit), or why there is none and how to fix it."""
    try:
        tree = cgroups.Tree(limits)
    except (cgroups.Unavailable, OSError) as exc:
        return str(exc)
    atexit.register(tree.remove)
    return tree


class Launch:
    """A box command started: its process, and, for a box that waits for its worker
    (:attr:`Box.handshake`), its cgroup joined and its network served by slirp4netns
    before it is let go. :meth:`finish` once the command ended: it stops slirp4netns,
    removes the cgroup and says which limit, if any, the kernel enforced."""

    def __init__(self, box: Box, build: Callable[[Handshake | None], list[str]],
                 pass_fds: tuple[int, ...] = (), lifeline: bool = False, **popen: Any) -> None:
        """Start ``build(handshake)``'s command (``handshake``: see :meth:`Box.argv`; None
        for a box that waits for nothing) with ``popen`` (:class:`subprocess.Popen`'s
        arguments); OSError when its cgroup cannot be made or it cannot start. A box with
        the user-mode network enters a network slot of this process's
        (:mod:`~swarm.agent.sandbox.netslots`), or makes its own where none can be made.
        ``lifeline``: the command checks this process's lifeline before all else
        (:data:`~swarm.agent.sandbox.lifeline.RUNNER_ALIVE`, a lasting box's runner), so
        bubblewrap may wait for the worker itself where the box has no routes to set
        (:attr:`Handshake.direct`): a shell less a box."""
        self.slirp: boxnet.Slirp | None = None
        self.slot: netslots.Slot | None = None
        self.group: cgroups.Group | None = None
        self.since = (0, 0)
        """The group's :meth:`~swarm.agent.cgroups.Group.counts` when this box got it."""
        self.notes: list[str] = []
        if not box.handshake:
            self.proc: subprocess.Popen[Any] = subprocess.Popen(
                build(None), pass_fds=pass_fds, **popen)
            return
        tree = cgroup_tree(box.limits) if box.limits is not None else None
        if isinstance(tree, cgroups.Tree):
            self.group = tree.group()
            self.since = self.group.counts()
        elif tree is not None:
            self.notes.append(f"[no cgroup limits: {tree}]")
        if box.net.mode == "user":
            with contextlib.suppress(netslots.Unavailable):
                self.slot = netslots.POOL.take(box.net)
        up_r, up_w = os.pipe()
        go_r, go_w = os.pipe()
        resolv = data_fd(boxnet.RESOLV.encode())
        direct = lifeline and (box.net.mode != "user" or self.slot is not None)
        try:
            shake = Handshake(up_w, go_r, resolv, self.slot.holder.pid if self.slot else 0,
                              direct)
            self.proc = subprocess.Popen(build(shake), pass_fds=(*pass_fds, up_w, go_r, resolv),
                                         **popen)
        except BaseException:
            for fd in (up_r, go_w):
                os.close(fd)
            self._drop_group()
            if self.slot is not None:  # nothing entered it
                netslots.POOL.give(self.slot)
                self.slot = None
            raise
        finally:
            for fd in (up_w, go_r, resolv):
                os.close(fd)
        try:
            if direct:
                self._let_go(up_r, go_w)
            elif boxnet.await_word(up_r):
                if self.group is not None:
                    try:
                        self.group.join(self.proc.pid)
                    except OSError as exc:  # it runs nothing without its limits
                        self.notes.append(f"[the box could not join its cgroup: {exc}]")
                        return
                if box.net.mode == "user" and self.slot is None:
                    self.slirp = boxnet.Slirp(self.proc.pid)
                    if self.slirp.error:
                        self.notes.append(f"[no network: {self.slirp.error}; "
                                          f"{boxnet.SLIRP_FIX}]")
                os.write(go_w, b"go\n")
        finally:
            os.close(up_r)
            os.close(go_w)

    def _let_go(self, info: int, go: int) -> None:
        """bubblewrap waits itself (:attr:`Handshake.direct`): the box's first process,
        named on ``info`` once made, joins the cgroup, then the word on ``go``. Where it
        cannot, or anything else stops this meanwhile (an exception, an interrupt), the box
        is killed before ``go`` ends: at its end bubblewrap goes on."""
        first = 0
        try:
            said = boxnet.read_json(info, boxnet.UP_TIMEOUT)
            named = said.get("child-pid") if isinstance(said, dict) else None
            if isinstance(named, int) and not isinstance(named, bool) and self._ours(named):
                first = named
            if not first:  # it died first (its error is on its stderr), or said nonsense
                self._kill(0)
                return
            if self.group is not None:
                try:
                    self.group.join(first)
                except OSError as exc:  # it runs nothing without its limits
                    self.notes.append(f"[the box could not join its cgroup: {exc}]")
                    self._kill(first)
                    return
            os.write(go, b"g")
        except BaseException:
            self._kill(first)
            self.finish()
            raise

    def _ours(self, pid: int) -> bool:
        """Whether process ``pid`` is bubblewrap's child (its box's first process), not one
        that got its number after it died (bubblewrap reaps it)."""
        stat = procs.read_stat(pid) if pid > 0 else None
        return stat is not None and stat.ppid == self.proc.pid

    def _kill(self, first: int) -> None:
        """Kill the box that waits: its first process (while it is still bubblewrap's),
        then bubblewrap."""
        if first and self._ours(first):
            with contextlib.suppress(OSError):
                os.kill(first, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.remove()
            self.group = None

    def finish(self) -> str:
        """Stop what served the box; a line on what stopped it or what it lacked, or ""."""
        if self.slirp is not None:
            self.slirp.stop()
            self.slirp = None
        if self.slot is not None:
            # Lent again only once the box ended on its own: bubblewrap exits after its
            # init, whose end the kernel holds until every process of its pid namespace
            # is gone. A box killed from outside (a timeout, a close that waited too long)
            # leaves its processes to die a moment later: its slot is closed instead.
            slot, self.slot = self.slot, None
            code = self.proc.poll()
            if code is not None and code >= 0:
                netslots.POOL.give(slot)
            else:
                slot.close()
        verdict = self.group.verdict(self.since) if self.group is not None else ""
        if self.group is not None:
            if self.proc.poll() is None:  # what is in it may still run
                self.group.remove_soon()
            else:
                self.group.release()
            self.group = None
        return "\n".join([*self.notes, *([verdict] if verdict else [])])

