"""The sandbox of agents' commands: bubblewrap, a seccomp filter, an allowlisted environment.

A sandboxed command runs (docs/deploy.md has the table of what is and is not confined):

- as uid/gid 65534 in its own user namespace, with no capabilities and ``no_new_privs``, in
  its own session and pid/ipc namespaces with a private ``/proc``, killed with its runner
  (a worker: even when it died while bubblewrap set the box up, :data:`RUNNER_ALIVE`)
  (the host's UTS namespace, which it cannot change);
  on the host, as the runner's uid, or, when the runner is root, as ``SWARM_SANDBOX_UID``
  (:data:`UID`; never 0, whose files the box could otherwise read wherever the owner may),
  given the workspace and its git folders by ACL entries (:mod:`swarm.agent.grants`);
- seeing of the host's files only the system's folders (:data:`SYSTEM`, read-only), the
  workspace (a child also sees its parent's workspace, read-only), with a private
  ``/tmp``, ``/dev/shm`` and ``$HOME`` (tmpfs of :data:`TMP_SIZE` bytes each) and
  ``SWARM_HOME`` and ``/run`` hidden under empty read-only tmpfs (the workspace is bound
  back when it lies under one);
- under a seccomp filter: the calls of :data:`REFUSED` and ``clone`` of a namespace fail
  with EPERM (``clone3`` with ENOSYS, so libc falls back to ``clone``);
- with at most :data:`PIDS` processes and threads: ``RLIMIT_NPROC`` set inside the box, where
  it counts the box's own user namespace only (one per command; the kernel holds every
  host uid but 0 to it, and the box never runs as host uid 0);
- with an environment built from :data:`PASSED` (plus ``SWARM_SANDBOX_ENV`` names);
- in a network namespace of its own: user-mode internet from slirp4netns where the
  worker's host and the swarm's Redis are unreachable (:mod:`swarm.agent.boxnet`), none
  with ``SWARM_SANDBOX_NETWORK=0``, the host's with ``host``;
- in a cgroup of its own with memory, pids and CPU limits (:mod:`swarm.agent.cgroups`).

Whether this works here is tried once per process with a real command (:func:`probe`).
Workers default to ``auto`` and refuse children when it fails (:func:`for_worker`); the
root in a terminal keeps the user's ``SWARM_SANDBOX`` (default ``none``), and the local
workers it starts on its own embedded server then run its children unconfined where it
fails (:data:`FALLBACK`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fnmatch
import functools
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.agent import boxnet, cgroups
from swarm.agent.boxnet import Network
from swarm.agent.cgroups import Limits
from swarm.agent.grants import grant_search, grant_tree, inside, open_beneath
from swarm.config import Settings, parse_size
from swarm.errors import ConfigError

UID = 65534
"""The uid and gid commands run as inside the box (``nobody`` on most systems), and the host
uid a root runner runs the box as unless ``SWARM_SANDBOX_UID`` says otherwise."""
PIDS = 1024
"""Processes and threads one command may have at once (a fork bomb stops here)."""
TMP_SIZE = 512 << 20
"""Bytes a command may write to its private ``/tmp`` (and as much to ``/dev/shm``)."""

REFUSED = (
    # mounts: the filesystem stays as the box was built
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev",
    # the kernel
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "acct", "swapon", "swapoff", "reboot", "syslog",
    "quotactl", "lookup_dcookie", "uselib", "open_by_handle_at", "name_to_handle_at",
    # keyrings
    "add_key", "request_key", "keyctl",
    # new namespaces (clone with namespace flags is refused by argument below)
    "unshare", "setns",
)
"""System calls a sandboxed command gets EPERM from."""

#: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME (linux/sched.h).
CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                    0x20000000, 0x40000000, 0x00000080)

PASSED = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ",
          "TERM", "COLORTERM", "TMPDIR", "EDITOR", "VISUAL",
          "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
          "http_proxy", "https_proxy", "no_proxy", "all_proxy",
          "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
          "NODE_EXTRA_CA_CERTS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "UV_INDEX_URL",
          "VIRTUAL_ENV", "PYTHONPATH", "JAVA_HOME", "GOPATH", "GOROOT", "CARGO_HOME",
          "RUSTUP_HOME", "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME",
          "GIT_COMMITTER_EMAIL")
"""Variables of the runner's environment a sandboxed command gets (patterns allowed)."""

FALLBACK = "SWARM_SANDBOX_FALLBACK"
"""Set to ``1`` by a root in a terminal that runs its commands unconfined (no
``SWARM_SANDBOX`` given) in the environment of the local workers it starts on its own
embedded server: where the box cannot be had, they run the children of such roots
unconfined too, rather than refuse them (:attr:`Choice.fallback`). Never set on a
deployment's workers, and out of reach of the commands they run."""
UNBOXED = "none for unconfined roots' children, others refused: "
"""How :attr:`Choice.summary` begins on a worker that falls back (:func:`unboxed`)."""

_TRIAL = ('id -u; grep -E "^(CapEff|NoNewPrivs|Seccomp):" /proc/self/status; '
          'touch /.swarm-sandbox-trial 2>/dev/null && echo root-writable; '
          'cat .trial-secret 2>/dev/null && echo secret-readable; '
          'touch trial && echo workspace-writable')
_FIX = ("install bubblewrap and slirp4netns (apt-get install bubblewrap slirp4netns); in a "
        "container, allow user namespaces (docs/deploy.md, 'The sandbox')")
_USERNS_FIX = ("a root worker runs the box as SWARM_SANDBOX_UID, which needs unprivileged user "
               "namespaces: sysctl user.max_user_namespaces above 0, "
               "kernel.unprivileged_userns_clone=1 where it exists, "
               "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04")
_ACL_FIX = ("put SWARM_HOME (and the workspace) on a filesystem with POSIX ACLs (ext4, xfs, "
            "btrfs, tmpfs), or run the worker as a user of its own")


def environment(source: Mapping[str, str], extra_names: Iterable[str] = ()) -> dict[str, str]:
    """The variables of ``source`` that :data:`PASSED` or ``extra_names`` name."""
    patterns = (*PASSED, *extra_names)
    return {k: v for k, v in source.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


@functools.cache
def seccomp_program() -> bytes:
    """The BPF program of the filter (built with libseccomp through pyseccomp)."""
    import pyseccomp as sc

    refuse = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in REFUSED:
        try:
            flt.add_rule(refuse, name)
        except (ValueError, RuntimeError, OSError):  # not a call of this architecture
            continue
    for flag in CLONE_NAMESPACES:
        flt.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.seek(0)
        return out.read()


def program_fd() -> int:
    """A pipe's read end holding :func:`seccomp_program`, for ``bwrap --seccomp FD``."""
    program = seccomp_program()
    read, write = os.pipe()
    try:
        os.write(write, program)  # well under a pipe's buffer
    finally:
        os.close(write)
    return read


#: The box's git tells a file changed since its index entry by size and whole-second
#: mtime and ctime only. The worker's files show the overflow uid in the box (and the index
#: holds the worker's uid 0): with git's default check, a command's first ``git status``
#: found every file changed, hashed the whole tree again and wrote the box's stat data into
#: the index, and then each capture by the worker hashed it all again (0.27 s a
#: ``git status`` and 0.25 s a capture of a 50 MB checkout, against 0.09 and 0.03). A
#: change within the index's own second is still caught: git reads such "racily clean"
#: entries' contents.
GIT_STAT_CHECK = ("core.checkStat", "minimal")


def add_git_stat_check(env: dict[str, str]) -> None:
    """Give git :data:`GIT_STAT_CHECK` through ``env``'s ``GIT_CONFIG_COUNT`` entries, after
    any the command's environment already has."""
    try:
        n = max(0, int(env.get("GIT_CONFIG_COUNT", "0")))
    except ValueError:
        n = 0
    env["GIT_CONFIG_COUNT"] = str(n + 1)
    env[f"GIT_CONFIG_KEY_{n}"], env[f"GIT_CONFIG_VALUE_{n}"] = GIT_STAT_CHECK


@functools.cache
def pdeathsig_setpriv() -> str:
    """``setpriv`` (util-linux 2.33 or later) if it can set a parent-death signal here,
    else ""."""
    path = shutil.which("setpriv")
    if path is None:
        return ""
    try:
        done = subprocess.run([path, "--pdeathsig", "USR1", "--", "true"],
                              capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return path if done.returncode == 0 else ""

#: A worker's box starts under ``setpriv --pdeathsig KILL``, then this shell runs
#: bubblewrap (``$2...``) only if its parent is still the worker (``$1``). bubblewrap's own
#: ``--die-with-parent`` is set later, inside it: a worker killed between the fork and that
#: point left the box running its command, orphaned, after the child's lease could have
#: been handed over; a worker killed before ``setpriv`` set the signal sends none.
RUNNER_GUARD = '[ "$PPID" = "$1" ] || exit 137; shift; exec "$@"'

#: The first lines of a worker's box command, given (as ``{fd}``) the read end of a pipe
#: whose write end only the worker holds (:func:`runner_pipe`; nothing is ever written):
#: at its end of file the worker is gone. bubblewrap sets the box's first process's
#: parent-death signal only once the box is set up (tens of ms, more under load), and
#: checks nothing after it: a worker killed meanwhile left the box to start its command
#: orphaned (the sandboxed chaos campaign saw commands start 0.04-0.22 s after their
#: worker was SIGKILLed). So the command does not start once the worker is gone, and a watcher
#: kills every process of the box (``kill -1``: the box's own pid namespace, in which the
#: command's shell is pid 2; outside one it kills nothing) when the worker goes later.
#: Its output is closed, so a command's output ends when the command does.
RUNNER_ALIVE = ("read -t 0 -u {fd} && exit 137\n"
                "( (read -u {fd}; [ $$ = 2 ] && kill -KILL -1) </dev/null >/dev/null 2>&1 & )\n"
                "exec {fd}<&-\n")

_PIPE: tuple[int, int] | None = None
_PIPE_LOCK = threading.Lock()


def runner_pipe() -> int:
    """The read end of this process's pipe for :data:`RUNNER_ALIVE` (made once per
    process; not inheritable: only the boxes it is passed to get the read end)."""
    global _PIPE
    with _PIPE_LOCK:
        if _PIPE is None:
            _PIPE = os.pipe()
        return _PIPE[0]


def _forget_pipe() -> None:
    """In a forked child: close the pipe it inherited (its copy of the write end would
    keep its parent's boxes alive after the parent died); it makes its own."""
    global _PIPE, _PIPE_LOCK
    _PIPE_LOCK = threading.Lock()  # another thread of the parent may have held it
    for end in _PIPE or ():
        with contextlib.suppress(OSError):
            os.close(end)
    _PIPE = None


os.register_at_fork(after_in_child=_forget_pipe)

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


#: What git in a worktree writes in its repository's folder. The rest of it (``config``,
#: ``hooks``, ``info``) stays read-only in the box: the worker's own git reads it.
REPO_WRITABLE = ("objects", "refs", "logs")
#: Files of a worktree's own git folder that name its repository and its work tree: read-only
#: in the box, so the worker's git is never pointed elsewhere.
POINTERS = ("commondir", "gitdir")


@dataclass(frozen=True)
class GitDirs:
    """The git folders of a worktree: its own, ``REPO/worktrees/NAME``, and ``REPO``; and
    its top folder (the workspace, or a folder above it)."""

    own: Path
    repo: Path
    top: Path

    @property
    def writable(self) -> list[Path]:
        return [self.own, *(self.repo / name for name in REPO_WRITABLE)]


def git_dirs(workspace: Path, linked: Path | None = None) -> GitDirs | None:
    """The git folders of the worktree holding ``workspace``: its own (named by its
    ``.git`` file, and naming that file back) and its repository's; None for anything
    else. A command in the box may have written that ``.git`` file: a folder it names that
    is not such a pair
    is never bound writable nor granted. A workspace that is a copy-on-write view has its
    worktree registered on the view's upper folder, ``linked`` (the one the view shows its
    ``.git`` from): its folder may name that one's ``.git`` back instead."""
    # Its own .git, or its worktree's above it (a child seeded from a subfolder of its
    # parent's repository works in that subfolder of its worktree).
    dot = next((p / ".git" for p in (workspace, *workspace.parents)
                if os.path.lexists(p / ".git")), workspace / ".git")
    try:
        text = dot.read_text(errors="replace").strip() if dot.is_file() else ""
        if not text.startswith("gitdir:"):
            return None
        own = (dot.parent / text.removeprefix("gitdir:").strip()).resolve()
        back = (own / (own / "gitdir").read_text(errors="replace").strip()).resolve()
    except (OSError, ValueError):
        return None
    repo = own.parent.parent
    named = {dot.resolve(), *([(linked / ".git").resolve()] if linked is not None else [])}
    if own.parent.name != "worktrees" or back not in named \
            or not (repo / "objects").is_dir():
        return None
    return GitDirs(own, repo, dot.parent)


#: What git obeys in a repository's own ``.git`` folder: read-only in the box when the
#: workspace is the repository's top (a root's folder, a job's), as the swarm's git and
#: the user's read it there.
OBEYED = ("config", "config.worktree", "commondir", "hooks", "info")


def own_repository(workspace: Path) -> list[tuple[str, str]]:
    """Binds that keep the workspace's own ``.git`` (a folder or a worktree's ``.git``
    file) where it is: its ``.git`` cannot be moved or replaced, and what git obeys in it
    (:data:`OBEYED`) cannot be changed. Links are never bound."""
    dot = workspace / ".git"
    try:
        mode = os.lstat(dot).st_mode
    except OSError:
        return []
    if stat.S_ISREG(mode):
        return [(str(dot), "~file")]
    if not stat.S_ISDIR(mode):
        return []
    out = [(str(dot), "~bind")]
    for name in OBEYED:
        try:
            kind = stat.S_IFMT(os.lstat(dot / name).st_mode)
        except OSError:
            continue
        if kind in (stat.S_IFREG, stat.S_IFDIR):
            out.append((str(dot / name), "~file"))
    return out


def child_top(workspace: Path, hide: Iterable[str | Path]) -> Path | None:
    """The top folder of the child's workspace ``workspace`` is in, when ``workspace`` is
    a subfolder of it (its parent worked in a subfolder of a repository) and it holds the
    child's own repository (``.git``, a folder): found from where the worker makes
    children's workspaces (``SWARM_HOME/workspaces/<swarm>/<agent>``, a hidden folder),
    never from what a command wrote. None otherwise."""
    for home in hide:
        base = Path(home).resolve() / "workspaces"
        if not workspace.is_relative_to(base):
            continue
        parts = workspace.relative_to(base).parts
        if len(parts) <= 2:
            return None
        top = base / parts[0] / parts[1]
        dot = top / ".git"
        return top if dot.is_dir() and not dot.is_symlink() else None
    return None


#: Repository folders granted to a uid by this process: (device, inode, uid).
_GRANTED: set[tuple[int, int, int]] = set()


def _folder_key(path: Path, uid: int) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, uid) if stat.S_ISDIR(st.st_mode) else None


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
        """Whether the box's first process waits for the worker (:class:`Launch`): to get
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
            self._grant(top.resolve() / inside(workspace, top), fd, linked)
        finally:
            os.close(fd)

    def _grant(self, ws: Path, fd: int, linked: Path | None) -> None:
        """:meth:`prepare` of the workspace ``ws`` (its real path), open as ``fd``."""
        git = git_dirs(ws, linked)
        if git is not None:  # a repository without reflogs yet: git in the box makes them
            (git.repo / "logs").mkdir(exist_ok=True)
        if self.run_as is None:
            return
        # A view's files are its lower layer's (granted once when its host made it, see
        # swarm.workspace.views) until written: an ACL set through the view would copy every
        # file up. What the view itself holds is its upper folder.
        writable = [ws, *(git.writable if git is not None else [])]
        top = child_top(ws, self.hide)
        if top is not None and linked is None:  # a view's is in its upper folder
            writable.append(top / ".git")
        shared = {str(git.repo / n) for n in REPO_WRITABLE} if git is not None else set()
        for path in [linked if linked is not None else ws, *writable[1:]]:
            # A repository's objects, refs and logs are shared by its worktrees' boxes:
            # walked once per process (thousands of objects at width), as what root adds
            # in them later takes their folders' default entries.
            key = _folder_key(path, self.run_as) if str(path) in shared else None
            if key is None or key not in _GRANTED:
                grant_tree(fd if path is ws else path, self.run_as)
                if key is not None:
                    _GRANTED.add(key)
        # The operator's folders as they resolve; read-only ones (the objects a child's
        # repository borrows) as recorded: a link swapped into one ends the walk there.
        bound = [Path(p).resolve() for p in (*self.hide, *([self.home] if self.home else []))]
        grant_search([*writable, *bound, *map(Path, self.read_only),
                      *([git.top] if git is not None else []),
                      *([top] if top is not None else [])], self.run_as)

    def argv(self, command: str, workspace: Path, seccomp_fd: int,
             linked: Path | None = None, runner: int | None = None,
             alive_fd: int | None = None, handshake: tuple[int, int, int] | None = None
             ) -> list[str]:
        """bubblewrap's command line for ``command`` (``linked``: see :func:`git_dirs`).
        With ``runner`` (this process's pid: a worker's), the box never runs once the
        thread that starts it died (:data:`RUNNER_GUARD`); with ``alive_fd`` too (the
        runner's :func:`runner_pipe`, passed to the box), not once the runner died, and dies
        with it (:data:`RUNNER_ALIVE`). With ``handshake`` (the write end of the "up" pipe,
        the read end of the "go" one and one holding its ``/etc/resolv.conf``:
        :class:`Launch`), it starts in :func:`~swarm.agent.boxnet.wrapper`, which waits
        for the worker."""
        ws = str(workspace.resolve())
        drop = [] if self.run_as is None else [
            f"--reuid={self.run_as}", f"--regid={self.run_as}", "--clear-groups"]
        guard = runner is not None and bool(pdeathsig_setpriv())
        # The parent-death signal is set after the uid change, which would clear it.
        box = [] if handshake is None else boxnet.wrapper(
            *handshake[:2], self.net if self.net.mode == "user" else None)
        box += ["setpriv", *drop, *(["--pdeathsig", "KILL"] if guard else []), "--"] \
            if drop or guard else []
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
        if self.net.mode == "none" or (self.net.mode == "user" and handshake is None):
            box.append("--unshare-net")
        elif self.net.mode == "user":
            assert handshake is not None
            box += ["--ro-bind-data", str(handshake[2]), "/etc/resolv.conf"]
        # The limit is set inside the box, where the count is of the box's namespace only,
        # by a line of the command's own shell (no second shell to start).
        alive = RUNNER_ALIVE.format(fd=alive_fd) if alive_fd is not None else ""
        box += ["--", "bash", "-c", f"ulimit -u {PIDS} || exit 126\n{alive}{command}"]
        return box


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


def data_fd(data: bytes) -> int:
    """A pipe's read end holding ``data`` (well under a pipe's buffer)."""
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    return read


class Launch:
    """A box command started: its process, and, for a box that waits for its worker
    (:attr:`Box.handshake`), its cgroup joined and its network served by slirp4netns
    before it is let go. :meth:`finish` once the command ended: it stops slirp4netns,
    removes the cgroup and says which limit, if any, the kernel enforced."""

    def __init__(self, box: Box, build: Callable[[tuple[int, int, int] | None], list[str]],
                 pass_fds: tuple[int, ...] = (), **popen: Any) -> None:
        """Start ``build(handshake)``'s command (``handshake``: see :meth:`Box.argv`; None
        for a box that waits for nothing) with ``popen`` (:class:`subprocess.Popen`'s
        arguments); OSError when its cgroup cannot be made or it cannot start."""
        self.slirp: boxnet.Slirp | None = None
        self.group: cgroups.Group | None = None
        self.notes: list[str] = []
        if not box.handshake:
            self.proc: subprocess.Popen[Any] = subprocess.Popen(
                build(None), pass_fds=pass_fds, **popen)
            return
        tree = cgroup_tree(box.limits) if box.limits is not None else None
        if isinstance(tree, cgroups.Tree):
            self.group = tree.group()
        elif tree is not None:
            self.notes.append(f"[no cgroup limits: {tree}]")
        up_r, up_w = os.pipe()
        go_r, go_w = os.pipe()
        resolv = data_fd(boxnet.RESOLV.encode())
        try:
            self.proc = subprocess.Popen(build((up_w, go_r, resolv)),
                                         pass_fds=(*pass_fds, up_w, go_r, resolv), **popen)
        except BaseException:
            for fd in (up_r, go_w):
                os.close(fd)
            self._drop_group()
            raise
        finally:
            for fd in (up_w, go_r, resolv):
                os.close(fd)
        try:
            if boxnet.await_word(up_r):
                if self.group is not None:
                    try:
                        self.group.join(self.proc.pid)
                    except OSError as exc:  # it runs nothing without its limits
                        self.notes.append(f"[the box could not join its cgroup: {exc}]")
                        return
                if box.net.mode == "user":
                    self.slirp = boxnet.Slirp(self.proc.pid)
                    if self.slirp.error:
                        self.notes.append(f"[no network: {self.slirp.error}; "
                                          f"{boxnet.SLIRP_FIX}]")
                os.write(go_w, b"go\n")
        finally:
            os.close(up_r)
            os.close(go_w)

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.remove()
            self.group = None

    def finish(self) -> str:
        """Stop what served the box; a line on what stopped it or what it lacked, or ""."""
        if self.slirp is not None:
            self.slirp.stop()
            self.slirp = None
        verdict = self.group.verdict() if self.group is not None else ""
        if self.group is not None:
            self.group.remove_soon()
            self.group = None
        return "\n".join([*self.notes, *([verdict] if verdict else [])])


@dataclass(frozen=True)
class Probe:
    """What a trial command in the box showed: ``ok``, else why not and how to fix it;
    the network its boxes get (``user`` falls back to ``none`` where slirp4netns fails,
    ``net_note`` says why) and, where its cgroup limits cannot be had, why."""

    ok: bool
    reason: str = ""
    net: Network | None = None
    net_note: str = ""
    limits_note: str = ""


def run_as(uid: int = UID) -> int | None:
    """The host uid boxes run as here: ``uid`` for a root runner, else None (its own)."""
    return uid if os.geteuid() == 0 else None


def network_mode(value: bool | str) -> str:
    """``SWARM_SANDBOX_NETWORK``'s box network: ``user`` (1, the default), ``none`` (0)
    or ``host``."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "user"):
        return "user"
    if text in ("0", "false", "no", "off", "none"):
        return "none"
    if text == "host":
        return "host"
    raise ConfigError(f"SWARM_SANDBOX_NETWORK={value!r} is not one of 1, 0, host")


_NET_TRIAL = ('while read -r i d _; do [ "$i $d" = "tap0 00000000" ] && echo net-up; '
              'done < /proc/net/route\n')


@functools.cache
def probe(net: Network | None = None, uid: int = UID, base: Path | None = None,
          limits: Limits | None = None, show: tuple[str, ...] = ()) -> Probe:
    """Run a trial command in the box (as host ``uid`` when root; with network ``net``,
    default ``user``, and cgroup ``limits``) and check it is confined (once per process).
    The trial's workspace is made in ``base`` (a worker's ``SWARM_HOME``, where its
    children's are) when that exists, else in the temp folder."""
    net = net if net is not None else Network()
    binary = shutil.which("bwrap")
    if binary is None:
        return Probe(False, f"bubblewrap is not installed: {_FIX}")
    try:
        fd = program_fd()
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        return Probe(False, f"no seccomp filter ({type(exc).__name__}: {exc}): install "
                            "libseccomp2 (apt-get install libseccomp2) and pyseccomp")
    box = Box(binary, net, run_as=run_as(uid), limits=limits, show=show)
    fix = _FIX if box.run_as is None else f"{_FIX}; {_USERNS_FIX}"
    if box.run_as is not None and shutil.which("setpriv") is None:
        os.close(fd)
        return Probe(False, "setpriv is not installed (a root worker starts the box as "
                            "SWARM_SANDBOX_UID with it): apt-get install util-linux")
    if net.mode == "user" and net.rules() and shutil.which("nft") is None:
        os.close(fd)
        return Probe(False, "SWARM_SANDBOX_ALLOW names ports, which the box's network "
                            "namespace filters with nftables: apt-get install nftables, or "
                            "allow whole addresses")
    where = str(base) if base is not None and base.is_dir() else None
    launch: Launch | None = None
    with tempfile.TemporaryDirectory(prefix="swarm-sandbox-trial-", dir=where) as trial:
        try:
            box.prepare(Path(trial))
            if box.run_as is not None:  # a file only root may read (a key): the box must not
                secret = os.open(Path(trial) / ".trial-secret", os.O_CREAT | os.O_WRONLY, 0o600)
                os.write(secret, b"secret\n")
                os.close(secret)
        except OSError as exc:
            os.close(fd)
            return Probe(False, f"cannot give uid {box.run_as} a workspace ({exc}): {_ACL_FIX}")
        try:
            trial_command = (_NET_TRIAL if net.mode == "user" else "") + _TRIAL
            launch = Launch(box, lambda hs: box.argv(trial_command, Path(trial), fd,
                                                     handshake=hs),
                            pass_fds=(fd,), cwd=trial, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env=environment(os.environ))
            stdout, stderr = launch.proc.communicate(timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            if launch is not None:
                launch.proc.kill()
                launch.proc.wait()
            return Probe(False, f"bubblewrap did not run ({exc}): {fix}")
        finally:
            os.close(fd)
            notes = launch.finish() if launch is not None else ""
        out = stdout.split()
        owner = (Path(trial) / "trial").stat().st_uid if (Path(trial) / "trial").exists() \
            else None
    if launch.proc.returncode != 0:
        said = (stderr.strip().splitlines() or notes.splitlines()
                or [f"exit code {launch.proc.returncode}"])[-1]
        return Probe(False, f"bubblewrap failed here ({said}): {fix}")
    net_up = "net-up" in out
    out = [w for w in out if w != "net-up"]
    expected = [str(UID), "CapEff:", "0000000000000000", "NoNewPrivs:", "1", "Seccomp:", "2"]
    want = box.run_as or os.geteuid()
    failed = [what for what, bad in (
        ("it was not uid, capabilities, no_new_privs and seccomp as set", out[:7] != expected),
        ("it could write /", "root-writable" in out),
        ("it could read a file only root may read", "secret-readable" in out),
        ("it could not write its workspace", out[-1:] != ["workspace-writable"]),
        (f"its file's owner was uid {owner}, not {want}", owner != want)) if bad]
    if failed:
        return Probe(False, f"a trial command was not confined as expected: "
                            f"{'; '.join(failed)} (it said: {' '.join(out)})")
    net_note = ""
    if net.mode == "user" and not net_up:
        found = [line for line in notes.splitlines() if line.startswith("[no network")]
        net_note = found[0].strip("[]") if found else \
            f"no network: slirp4netns gave the box no route; {boxnet.SLIRP_FIX}"
        net = NO_NETWORK
    limits_note = next((line.strip("[]") for line in notes.splitlines()
                        if line.startswith("[no cgroup")), "")
    return Probe(True, net=net, net_note=net_note, limits_note=limits_note)


@dataclass(frozen=True)
class Choice:
    """Where a process runs its commands: in ``box``, or unconfined."""

    box: Box | None
    refuse: str = ""
    """Set on a worker that cannot sandbox: why, and how to fix it (it runs no children)."""
    notice: str = ""
    """A line to tell the person or the log when commands run unconfined."""
    lacks: tuple[str, ...] = ()
    """What the box goes without here (its network, its cgroup limits): why, and the fix."""
    fallback: str = ""
    """Set with ``refuse`` on a terminal root's local worker (:data:`FALLBACK`): why there is
    no box. The children of a swarm whose root runs its commands unconfined run unconfined
    too; the others (jobs, roots that asked for a sandbox) are refused."""

    @property
    def summary(self) -> str:
        """One line for ``swarm status`` and Flower's worker info."""
        if self.fallback:
            return f"{UNBOXED}{self.fallback}"
        if self.refuse:
            return f"unavailable, children refused: {self.refuse}"
        if self.box is None:
            return "none (commands run unconfined)"
        host = self.box.run_as
        net = {"user": "network: user-mode, host and Redis unreachable",
               "none": "no network", "host": "network: the host's (its ports exposed)"}
        limits = self.box.limits
        parts = [f"uid {UID}{'' if host in (None, UID) else f', host uid {host}'}",
                 "no capabilities", "seccomp", net[self.box.net.mode]]
        if limits is not None:
            memory = f"{limits.memory >> 20} MiB" if limits.memory else "no memory limit"
            parts.append(f"cgroup: {memory}, {limits.pids} pids, cpu weight {limits.cpu}")
        return f"bwrap ({', '.join(parts)}){''.join(f'; {n}' for n in self.lacks)}"


def choose(mode: str, *, worker: bool = False, network: bool | str | Network = True,
           hide: Iterable[Path] = (), read_only: Iterable[Path] = (), uid: int = UID,
           trial_in: Path | None = None, limits: Limits | None = None,
           show: Iterable[str] = (), fallback: bool = False) -> Choice:
    """The sandbox for ``SWARM_SANDBOX`` ``mode`` (run as host ``uid`` when root; tried in
    ``trial_in`` when given: :func:`probe`; ``network``: a :class:`Network`, or
    ``SWARM_SANDBOX_NETWORK``'s value, then denying this host; ``limits``: its cgroup's).
    ``auto`` uses bubblewrap when the trial works; when it does not, a worker refuses
    children (but, with ``fallback``, an unconfined root's: :attr:`Choice.fallback`) and a
    root runs unconfined with a notice. ``bwrap`` that does not work raises
    :class:`ConfigError` (refuses, on a worker)."""
    unconfined = (f"commands run unconfined as uid {os.getuid()} (SWARM_SANDBOX=none); "
                  "SWARM_SANDBOX=auto runs them in bubblewrap")
    if mode == "none":
        return Choice(None, notice=unconfined)
    net = network if isinstance(network, Network) else Network(network_mode(network))
    if net.mode != "user":
        net = Network(net.mode, ())
    shown = tuple(show)
    found = probe(net, uid, trial_in, limits, shown)
    if found.ok:
        binary = shutil.which("bwrap")
        assert binary is not None
        lacks = tuple(n for n in (found.net_note, found.limits_note) if n)
        return Choice(Box(binary, found.net or net, tuple(str(p) for p in hide),
                          os.environ.get("HOME", ""), tuple(str(p) for p in read_only),
                          run_as(uid), None if found.limits_note else limits, shown),
                      lacks=lacks)
    if worker:
        return Choice(None, refuse=f"{found.reason}; or set SWARM_SANDBOX=none on this "
                                   "worker to run commands unconfined",
                      fallback=found.reason if fallback else "")
    if mode == "bwrap":
        raise ConfigError(f"SWARM_SANDBOX=bwrap but {found.reason}; or set "
                          "SWARM_SANDBOX=auto or none")
    return Choice(None, notice=f"commands run unconfined: {found.reason}")


def network_of(settings: Settings) -> Network:
    """The box network ``settings`` ask for: ``user`` denies this host, the Redis hosts
    of ``SWARM_REDIS_URL``, link-local addresses and ``SWARM_SANDBOX_DENY``."""
    mode = network_mode(settings.sandbox_network)
    if mode != "user":
        return Network(mode, ())
    return Network(mode, boxnet.deny_list(settings.redis_url, _listed(settings.sandbox_deny)),
                   _listed(settings.sandbox_allow))


def limits_of(settings: Settings) -> Limits:
    """The cgroup limits of each box (``SWARM_SANDBOX_MEMORY``, ``_PIDS``, ``_CPU``)."""
    return Limits(parse_size(settings.sandbox_memory), settings.sandbox_pids,
                  settings.sandbox_cpu)


def shown_of(settings: Settings) -> tuple[str, ...]:
    """``SWARM_SANDBOX_SHOW``'s folders."""
    return _listed(settings.sandbox_show)


def _listed(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def for_worker(settings: Settings) -> Choice:
    """A worker's sandbox: its own ``SWARM_SANDBOX`` (never a swarm's), ``auto`` when unset;
    then, on a terminal root's local worker (:data:`FALLBACK`), unconfined roots' children
    run unconfined where the box cannot be had."""
    explicit = "sandbox" in settings.explicit
    return choose(settings.sandbox if explicit else "auto", worker=True,
                  network=network_of(settings), hide=(settings.home,),
                  uid=settings.sandbox_uid, trial_in=settings.home,
                  limits=limits_of(settings), show=shown_of(settings),
                  fallback=not explicit and os.environ.get(FALLBACK) == "1")


def unboxed(summaries: Iterable[str]) -> str:
    """Why there is no box, from the :attr:`Choice.summary` of workers: "" unless one of
    them runs unconfined roots' children unconfined (:attr:`Choice.fallback`)."""
    return next((s.removeprefix(UNBOXED) for s in summaries if s.startswith(UNBOXED)), "")
