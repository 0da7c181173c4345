"""A box: how bubblewrap wraps a command (:meth:`Box.argv`: the namespaces, the folders
shown, hidden and bound, the seccomp filter, the lifeline to the runner, the handshake with
it) and how a root runner readies a workspace for it (:meth:`Box.prepare`)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from swarm.agent import boxnet
from swarm.agent.boxnet import Network
from swarm.agent.cgroups import Limits
from swarm.agent.grants import inside, open_beneath
from swarm.agent.sandbox.access import grant
from swarm.agent.sandbox.gitdirs import POINTERS, child_top, git_dirs, own_repository
from swarm.agent.sandbox.lifeline import RUNNER_ALIVE, RUNNER_GUARD, pdeathsig_setpriv

UID = 65534
"""The uid and gid commands run as inside the box (``nobody`` on most systems), and the host
uid a root runner runs the box as unless ``SWARM_SANDBOX_UID`` says otherwise."""
PIDS = 1024
"""Processes and threads one command may have at once (a fork bomb stops here)."""
TMP_SIZE = 512 << 20
"""Bytes a command may write to its private ``/tmp`` (and as much to ``/dev/shm``)."""

NO_NETWORK = Network("none", ())

#: The host's folders a box sees (read-only), where they exist: the system's programs,
#: libraries and configuration. Not ``/home``, ``/root``, ``/var``, ``/srv``, ``/mnt``,
#: ``/media``: the worker's user's files, keys and env files stay out of sight.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt",
          "/nix", "/sys")
#: Folders of :data:`SYSTEM` hidden under an empty tmpfs: an operator's swarm settings.
SYSTEM_HIDDEN = ("/etc/swarm",)


def system_binds(show: Iterable[str] = ()) -> list[str]:
    """bubblewrap's arguments showing :data:`SYSTEM` and ``show`` read-only (a link, as
    ``/bin`` to ``usr/bin``, stays a link)."""
    out: list[str] = []
    for path in (*SYSTEM, *show):
        if os.path.islink(path) and path in SYSTEM:
            out += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            out += ["--ro-bind", path, path]
    out += ["--dir", "/var", "--symlink", "../run", "/var/run"]
    for path in SYSTEM_HIDDEN:
        if os.path.isdir(path):
            out += ["--tmpfs", path, "--remount-ro", path]
    return out


class Handshake(NamedTuple):
    """How a box that waits for its worker talks to it (:class:`.Launch`)."""

    up: int
    """The write end of the pipe it says "up" on."""
    go: int
    """The read end of the pipe it reads "go" from."""
    resolv: int
    """A descriptor holding its ``/etc/resolv.conf``."""
    holder: int = 0
    """The pid of the network slot's holder whose namespace it enters
    (:mod:`~swarm.agent.sandbox.netslots`); 0: it makes its own."""
    direct: bool = False
    """bubblewrap itself waits (no shell before it): it writes its box's first process's
    pid as JSON on :attr:`up` (``--info-fd``) and, its box set up, waits for a byte or the
    end of :attr:`go` (``--block-fd``). Only for a box with no routes to set whose program
    checks the worker's lifeline first: at the end of :attr:`go` (the worker died) it goes
    on to that check."""


@dataclass(frozen=True)
class Box:
    """How to wrap a command in bubblewrap."""

    binary: str
    net: Network = NO_NETWORK
    """Its network (:class:`~swarm.agent.boxnet.Network`): ``user`` (slirp4netns, the host
    and Redis denied), ``none`` or ``host``."""
    hide: tuple[str, ...] = ()
    """Folders hidden under an empty read-only tmpfs (``SWARM_HOME``)."""
    home: str = ""
    """The runner's home, replaced by an empty private one (its keys, dotfiles and caches
    stay out of reach; tools installed under it too)."""
    read_only: tuple[str, ...] = ()
    """Folders shown read-only even where hidden (a child's parent's workspace)."""
    run_as: int | None = None
    """The host uid (and gid) bubblewrap runs as: set when the runner is root. ``setpriv``
    switches to it (``subprocess``'s ``user=`` would fork the worker instead of vforking
    it: 48 ms a command instead of 15 with a 500 MB worker)."""
    limits: Limits | None = None
    """Its cgroup's limits (:mod:`swarm.agent.cgroups`); None: no cgroup."""
    show: tuple[str, ...] = ()
    """More host folders shown read-only (``SWARM_SANDBOX_SHOW``) beside :data:`SYSTEM`."""

    @property
    def handshake(self) -> bool:
        """Whether the box's first process waits for the worker (:class:`.Launch`): to get
        its network or join its cgroup."""
        return self.net.mode == "user" or self.limits is not None

    def prepare(self, workspace: Path, linked: Path | None = None,
                beneath: Path | None = None) -> None:
        """Give :attr:`run_as` the workspace and its git folders, and a way to the folders
        the box binds (nothing to do for an unprivileged runner). ``OSError`` when the
        filesystem cannot hold the ACL entries. ``linked``: a view's upper folder (see
        :func:`git_dirs`); of a view, only that folder is granted. ``beneath``: the folder
        the workspace must lie in (a job's jobs root): the workspace is opened from there
        down following no symbolic link, and granted as opened
        (:class:`~swarm.errors.PathRefused` when a link is in the way)."""
        top = beneath if beneath is not None else workspace
        fd = open_beneath(workspace, top)
        try:
            grant(self, top.resolve() / inside(workspace, top), fd, linked)
        finally:
            os.close(fd)

    def argv(self, command: str, workspace: Path, seccomp_fd: int,
             linked: Path | None = None, runner: int | None = None,
             alive_fd: int | None = None, handshake: Handshake | None = None,
             program: list[str] | None = None) -> list[str]:
        """bubblewrap's command line for ``command`` (``linked``: see :func:`git_dirs`).
        With ``runner`` (this process's pid: a worker's), the box never runs once the
        thread that starts it died (:data:`RUNNER_GUARD`); with ``alive_fd`` too (the
        runner's :func:`runner_pipe`, passed to the box), not once the runner died, and dies
        with it (:data:`RUNNER_ALIVE`). With ``handshake`` (the write end of the "up" pipe,
        the read end of the "go" one and one holding its ``/etc/resolv.conf``:
        :class:`.Launch`), it starts in :func:`~swarm.agent.boxnet.wrapper`, which waits
        for the worker: after ``setpriv`` when it has no routes to set (in a network slot,
        or no network of its own), where it is the guard too (the worker's "go" comes only
        after its "up", said once the parent-death signal is set); else before ``setpriv``,
        root in its new network namespace; or, :attr:`Handshake.direct`, bubblewrap waits
        itself, after ``setpriv`` (no shell). With ``program`` (a lasting box's runner),
        bubblewrap runs that instead of ``bash -c command``: it must set the :data:`PIDS`
        limit itself."""
        ws = str(workspace.resolve())
        drop = [] if self.run_as is None else [
            f"--reuid={self.run_as}", f"--regid={self.run_as}", "--clear-groups"]
        guard = runner is not None and bool(pdeathsig_setpriv())
        # The parent-death signal is set after the uid change, which would clear it.
        setpriv = ["setpriv", *drop, *(["--pdeathsig", "KILL"] if guard else []), "--"] \
            if drop or guard else []
        user = self.net.mode == "user"
        if handshake is not None and handshake.direct:
            # As below, with no shell: bubblewrap says its box is up (its first process's
            # pid, for the worker to move into its cgroup) and waits for the word.
            assert not user or handshake.holder
            box = [*(boxnet.enter(handshake.holder) if user else []), *setpriv]
        elif handshake is not None and (not user or handshake.holder):
            # No route to set: the box waits for its worker after setpriv, unprivileged,
            # which makes it the guard too: the worker says "go" only once the box said
            # "up", after the parent-death signal was set (one shell less than
            # RUNNER_GUARD's).
            box = boxnet.enter(handshake.holder) if user else []
            box += [*setpriv, *boxnet.wrapper(handshake.up, handshake.go, None)]
        else:
            box = [] if handshake is None else boxnet.wrapper(
                handshake.up, handshake.go, self.net if user else None)
            box += setpriv
            if guard:
                box += ["/bin/sh", "-c", RUNNER_GUARD, "sh", str(runner)]
        box += [self.binary, "--unshare-user", "--uid", str(UID), "--gid", str(UID),
               # No UTS namespace of its own: the host's belongs to the host's user namespace,
               # where the box has no capability, so it cannot set the host's name either way.
               "--unshare-pid", "--unshare-ipc", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session", "--cap-drop", "ALL",
               *system_binds(self.show), "--dev", "/dev", "--proc", "/proc",
               "--size", str(TMP_SIZE), "--tmpfs", "/tmp", "--remount-ro", "/dev",
               "--size", str(TMP_SIZE), "--tmpfs", "/dev/shm",
               # /run holds sockets (docker's, D-Bus) and secrets (/run/secrets); DNS stays.
               "--tmpfs", "/run", "--ro-bind-try", "/run/systemd/resolve",
               "/run/systemd/resolve", "--remount-ro", "/run"]
        hidden = [str(Path(f).resolve()) for f in self.hide if os.path.isdir(f)]
        # A folder inside another hidden one is hidden with it (and bubblewrap could not
        # make its mount point in the other's read-only tmpfs).
        hidden = [h for h in hidden
                  if not any(o != h and Path(h).is_relative_to(o) for o in hidden)]
        # Outer folders first: the workspace bound back into a hidden SWARM_HOME or home,
        # or SWARM_HOME hidden again inside a workspace that holds it. A hidden folder is
        # made read-only before anything is mounted in it (a remount reaches submounts).
        mounts = [(path, "hide") for path in hidden] + [(ws, "~bind")]
        # A workspace that is a git worktree keeps its git folders elsewhere (a seeded
        # child's in SWARM_HOME's host cache, a same-host one's in its parent's repository):
        # git in the workspace reads them, and writes objects, refs and its own folder.
        git = git_dirs(Path(ws), linked)
        if git is not None:
            # A workspace below its worktree's top sees the rest of the worktree read-only
            # (git in it reads the whole work tree).
            mounts += [(str(git.repo), "ro")] + ([(str(git.top), "ro")] if str(git.top) != ws
                                                   else [])
            mounts += [(str(p), "~bind") for p in git.writable if p.is_dir()]
            mounts += [(str(git.own / n), "~file") for n in POINTERS if (git.own / n).is_file()]
        if not any(Path(ws).is_relative_to(Path(h).resolve() / "workspaces") for h in self.hide):
            # A child's repository is its own (the worker's git never uses it); a root's or a
            # job's is the user's, which the swarm's git reads.
            mounts += own_repository(Path(ws))
        top = child_top(Path(ws), self.hide)
        if top is not None:
            # A child working in a subfolder: the rest of its workspace read-only (git in it
            # reads the whole work tree), its own repository above it writable.
            mounts += [(str(top), "ro"), (str(top / ".git"), "~bind")]
        mounts += [(str(Path(p).resolve()), "ro") for p in self.read_only if os.path.isdir(p)]
        if self.home and os.path.isdir(self.home) and Path(self.home).resolve() != Path("/"):
            mounts.append((str(Path(self.home).resolve()), "home"))
        for path, kind in sorted(mounts, key=lambda m: (len(Path(m[0]).parts), m[1])):
            if kind == "~bind":
                box += ["--bind", path, path]
            elif kind == "home":
                box += ["--size", str(TMP_SIZE), "--tmpfs", path]
            elif kind in ("ro", "~file"):
                box += ["--ro-bind", path, path]
            else:  # mount points of what is shown inside it are made before it is read-only
                inside = [m for m, k in mounts if k in ("ro", "~bind") and m != path
                          and Path(m).is_relative_to(path)]
                box += ["--tmpfs", path, *(a for m in inside for a in ("--dir", m)),
                        "--remount-ro", path]
        box += ["--remount-ro", "/", "--chdir", ws, "--seccomp", str(seccomp_fd)]
        if handshake is not None and handshake.direct:
            box += ["--info-fd", str(handshake.up), "--block-fd", str(handshake.go)]
        if self.net.mode == "none" or (self.net.mode == "user" and handshake is None):
            box.append("--unshare-net")
        elif self.net.mode == "user":
            assert handshake is not None
            box += ["--ro-bind-data", str(handshake.resolv), "/etc/resolv.conf"]
        # The limit is set inside the box, where the count is of the box's namespace only,
        # by a line of the command's own shell (no second shell to start).
        if program is not None:
            return [*box, "--", *program]
        alive = RUNNER_ALIVE.format(fd=alive_fd) if alive_fd is not None else ""
        box += ["--", "bash", "-c", f"ulimit -u {PIDS} || exit 126\n{alive}{command}"]
        return box
