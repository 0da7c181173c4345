"""Copy-on-write workspaces: one read-only checkout of a snapshot per host, and an
overlayfs view of it per child.

A child's workspace is an overlay mount whose lower layer is the host's shared checkout
of its seed (``SWARM_HOME/seeds/trees/<seed>``, written once per host and never changed
while it exists) and whose upper layer is the child's own folder: a write, a new file or
a deletion lands in the child's upper folder only (the kernel copies a file up before
its first write), so no child changes another child's files or the shared checkout.
Making one costs a mount and a copy of the shared checkout's git index (its stat data
stays valid: overlayfs shows a lower file's inode and times), not a checkout of every
file; what a child changed is what its upper folder holds.

Mounting needs ``CAP_SYS_ADMIN`` (a root worker) and a ``SWARM_HOME`` on a file system
overlayfs accepts as its upper layer (ext4, xfs, tmpfs; not overlayfs itself, as a
container's root often is). :func:`unavailable` tries once per process and says why not;
a worker that cannot mount gives each child a full checkout instead (correct, slower).
A view is mounted while a run of its agent works, and unmounted when the run ends
(parked or settled), so mounts never outlive their runs; :func:`private_mounts` puts a
worker's mounts in a mount namespace of its own, so they go with it if it is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from swarm.agent.grants import grant_tree
from swarm.errors import WorkspaceError
from swarm.workspace import gitstate as g

log = logging.getLogger(__name__)

_MS_REC, _MS_SLAVE, _MNT_DETACH, _CLONE_NEWNS, _CLONE_FS = 0x4000, 0x80000, 2, 0x20000, 0x200


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def private_mounts() -> bool:
    """Move this process into a mount namespace of its own (mounts of the host still
    reach it; its own reach nobody), so the views it mounts go away with it, and keep a
    copy of it as it is, without views (:data:`_viewless`). Call it before any thread
    starts (one started before stays in the old namespace): a RuntimeError where one
    runs. False (nothing changed) where the process may not."""
    if threading.active_count() > 1:
        raise RuntimeError("private_mounts() must be called before any thread starts: "
                           f"{', '.join(t.name for t in threading.enumerate())} run already")
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS) != 0:
        return False
    with contextlib.suppress(OSError):
        _check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    # The copy is made by a thread that ends with it: the process goes back nowhere (a
    # setns back would move its folder to / and need CAP_SYS_CHROOT).
    thread = threading.Thread(target=_copy_viewless, name="swarm-viewless")
    thread.start()
    thread.join()
    return True


def _copy_viewless() -> None:
    global _viewless
    if _libc().unshare(_CLONE_FS | _CLONE_NEWNS) == 0:
        with contextlib.suppress(OSError):
            _viewless = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/mnt",
                                os.O_RDONLY)


_viewless: int | None = None
"""The process's mount namespace as :func:`private_mounts` made it, before any view."""


_own = threading.local()


def isolate(views_under: Path, keep: Path) -> bool:
    """Move the calling thread (a run working in the view ``keep``) into a mount namespace
    of its own, where of the views under ``views_under`` only ``keep`` is mounted; until
    :func:`rejoin`. The sandbox's boxes it starts copy that namespace's mounts, and each
    mount a box copies costs every bind it makes (bubblewrap reads the mount table for
    each): with 500 views mounted, ~1.6 ms a bind, a command's box ~90 ms instead of ~20.
    The process's own namespace keeps every view (its other threads, MCP servers). False
    (nothing changed) where this thread may not."""
    if getattr(_own, "fd", None) is not None:
        return False
    if _viewless is not None and _alone(keep):
        return True
    if not _away(_CLONE_FS | _CLONE_NEWNS):
        return False
    libc = _libc()
    with contextlib.suppress(OSError):
        _check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    under, kept = f"{views_under.resolve()}/", str(keep.resolve())
    with open(f"/proc/self/task/{threading.get_native_id()}/mountinfo", "rb") as table:
        points = [_unescape(line.split()[4]) for line in table]
    for point in sorted(points, key=len, reverse=True):
        if point.startswith(under) and point != kept and not point.startswith(f"{kept}/"):
            libc.umount2(point.encode(), _MNT_DETACH)
    return True


_OPEN_TREE, _MOVE_MOUNT = 428, 429  # on every architecture but alpha (+110), since 5.2
_OPEN_TREE_CLONE, _AT_RECURSIVE, _MOVE_MOUNT_F_EMPTY_PATH, _AT_FDCWD = 1, 0x8000, 4, -100


def _alone(keep: Path) -> bool:
    """:func:`isolate` by copying the namespace without views (:data:`_viewless`: a few
    mounts) and moving a clone of ``keep``'s view there, not by copying the process's
    (every view) and unmounting all but one: that copy holds a lock of the whole kernel's
    mounts, and each unmount waits for an RCU grace period; 300 runs starting at once
    took 0.19 s so, 3.4 s the other way (median 2 ms against 1.5 s each). False (nothing
    changed) where it cannot: a kernel without ``open_tree`` (before 5.2), a thread that
    may not ``setns`` (without CAP_SYS_CHROOT)."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    path = str(keep.resolve()).encode()
    tree = libc.syscall(_OPEN_TREE, _AT_FDCWD, path,
                        _OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC)
    if tree < 0:
        return False
    try:
        if _viewless is None or not _join(_viewless, new=True):
            return False
        if libc.syscall(_MOVE_MOUNT, tree, b"", _AT_FDCWD, path, _MOVE_MOUNT_F_EMPTY_PATH) != 0:
            rejoin()
            return False
        return True
    finally:
        os.close(tree)


class Isolation:
    """A run's mount namespace of :func:`isolate` (of the views under ``under``, only
    ``keep`` mounted), which each of its boxes is started in: entered for the start only
    (:meth:`entered`) by the thread that starts it (the run's own, or a thread for boxes
    starting its box while its model thinks), made by the first. Not for a whole run: a
    thread the run's thread started meanwhile (a library's, lazily: a model call's
    deadline thread, the MCP loop) would share its filesystem context, and it could not
    go back (:func:`rejoin`: ``setns`` fails with EINVAL). :meth:`close`, as the run ends,
    lets no thread in again."""

    def __init__(self, under: Path, keep: Path) -> None:
        self.under, self.keep = under, keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._closed = False

    def enter(self) -> bool:
        """Move the calling thread in; False (nothing changed) where it may not, OSError
        once closed."""
        if getattr(_own, "fd", None) is not None:
            raise OSError("this thread could not go back to the worker's mount namespace")
        with self._lock:
            if self._closed:
                raise OSError(f"the run working in {self.keep} has ended")
            if self._fd is not None:
                return _join(self._fd)
            if not isolate(self.under, self.keep):
                return False
            try:
                self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/mnt",
                                   os.O_RDONLY)
            except OSError:
                rejoin()
                return False
            return True

    @contextlib.contextmanager
    def entered(self) -> Iterator[bool]:
        """:meth:`enter` for the block, then :func:`rejoin`."""
        inside = self.enter()
        try:
            yield inside
        finally:
            if inside:
                rejoin()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _away(flags: int) -> bool:
    """``unshare(flags)`` for the calling thread, whose mount namespace and folder
    :func:`rejoin` goes back to; False (nothing changed) where it may not."""
    if getattr(_own, "fd", None) is not None:
        return False
    try:
        home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/mnt", os.O_RDONLY)
    except OSError:
        return False
    try:
        folder: int | None = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # a folder removed since
        folder = None
    if _libc().unshare(flags) != 0:
        os.close(home)
        if folder is not None:
            os.close(folder)
        return False
    _own.fd, _own.folder = home, folder
    return True


def _join(fd: int, new: bool = False) -> bool:
    """Move the calling thread into the mount namespace ``fd`` (``new``: into a copy of
    it of its own) until :func:`rejoin`."""
    # setns to a mount namespace refuses a thread sharing its filesystem context.
    if not _away(_CLONE_FS):
        return False
    libc = _libc()
    if libc.setns(fd, _CLONE_NEWNS) != 0:  # still home: only its filesystem context is new
        _forget()
        return False
    if new and libc.unshare(_CLONE_NEWNS) != 0:
        rejoin()
        return False
    return True


def _forget() -> None:
    """Drop what :func:`_away` kept."""
    for fd in (_own.fd, getattr(_own, "folder", None)):
        if fd is not None:
            os.close(fd)
    _own.fd = _own.folder = None


def rejoin() -> None:
    """Back to the process's mount namespace after :func:`isolate`, and to the folder the
    thread was in (``setns`` moved it to the namespace's root). An OSError where it cannot
    go back: the thread then stays marked away, and no :class:`Isolation` lets it in."""
    fd = getattr(_own, "fd", None)
    if fd is None:
        return
    _check(_libc().setns(fd, _CLONE_NEWNS), "setns to the worker's mount namespace")
    folder = getattr(_own, "folder", None)
    if folder is not None:
        with contextlib.suppress(OSError):
            os.fchdir(folder)
    _forget()


def _unescape(field: bytes) -> str:
    """A mount point as /proc/*/mountinfo writes it (space, tab, newline, backslash
    escaped in octal)."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]),
                  field).decode(errors="surrogateescape")


def mount(lower: Path, upper: Path, work: Path, target: Path) -> None:
    """Mount the view of ``lower`` with changes in ``upper`` at ``target``."""
    for path in (lower, upper, work, target):
        if any(c in str(path) for c in ",:\\"):
            raise OSError(f"overlayfs cannot take the path {path}")
    data = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    _check(_libc().mount(b"swarm-view", str(target).encode(), b"overlay", 0, data),
           f"mount overlay at {target}")


def unmount(target: Path) -> None:
    """Unmount ``target`` (lazily when a process still uses it: it keeps its view)."""
    libc = _libc()
    if libc.umount2(str(target).encode(), 0) != 0:
        libc.umount2(str(target).encode(), _MNT_DETACH)


def mounted(target: Path) -> bool:
    return os.path.ismount(target)


_probed: dict[str, str] = {}


def unavailable(home: Path) -> str:
    """Why this process cannot mount views under ``home`` ("" when it can); tried once."""
    key = str(home.resolve())
    if key not in _probed:
        _probed[key] = _probe(home)
        if _probed[key]:
            log.info("children get full checkouts, not copy-on-write views: %s", _probed[key])
    return _probed[key]


def _probe(home: Path) -> str:
    try:
        (home / "seeds").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="view-probe-", dir=home / "seeds") as tmp:
            parts = [Path(tmp) / n for n in ("lower", "upper", "work", "view")]
            for part in parts:
                part.mkdir()
            (parts[0] / "f").write_text("lower\n")
            mount(*parts)
            try:
                (parts[3] / "f").write_text("changed\n")
                if (parts[0] / "f").read_text() != "lower\n":
                    return "a write through the overlay changed its lower layer"
            finally:
                unmount(parts[3])
    except OSError as exc:
        return f"overlayfs cannot be mounted here ({exc.strerror or exc})"
    return ""


def shared_checkout(repo: Path, sid: str, trees: Path, box_uid: int | None = None,
                    base: str = "") -> tuple[Path, Path]:
    """The host's read-only checkout of commit ``sid`` of ``repo`` under ``trees`` and its
    git index: made once (the caller holds the host's lock for ``sid``). With ``box_uid``
    (a root worker's sandbox uid), that uid may write its files through a view, by ACL
    entries set here once: set through each view, they would copy every file up. With
    ``base`` (the snapshot ``sid`` is a delta over) checked out here already, its files are
    linked, not written again, and git writes only what changed (:func:`_linked_copy`)."""
    files, index = trees / sid, trees / f"{sid}.index"
    if files.is_dir() and index.is_file():
        granted = trees / f"{sid}.uid-{box_uid}"
        if box_uid is not None and not granted.exists():  # made before a box needed it
            if _linked(files):  # its linked files keep what they were given, no more
                raise OSError(f"the shared checkout of {sid[:12]} was made for another "
                              "sandbox uid: its linked files cannot be granted to this one")
            grant_tree(files, box_uid)
            granted.touch()
        return files, index
    trees.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sid[:12]}-", dir=trees))
    try:
        temp_index = tmp / "index"
        env = {"GIT_DIR": str(repo), "GIT_WORK_TREE": str(tmp / "files"),
               "GIT_INDEX_FILE": str(temp_index)}
        if not _derived(trees, base, box_uid, tmp / "files", temp_index, sid, env):
            (tmp / "files").mkdir()
            g.git("-c", f"checkout.workers={min(8, os.cpu_count() or 1)}", "read-tree", "-u",
                  "--reset", sid, cwd=tmp / "files", env=env)
        if box_uid is not None:  # before the refresh: an ACL entry changes a file's ctime
            grant_tree(tmp / "files", box_uid)
            (trees / f"{sid}.uid-{box_uid}").touch()
        # The index, written last, must be newer than its files: an entry as new as its
        # index is "racily clean", read again by every git that uses the index (each
        # child's capture read a 50 MB checkout again, ~110 ms).
        _settle_times(tmp / "files")
        g.git(*g.UNTRUSTED_CTIME, "update-index", "-q", "--refresh", cwd=tmp / "files",
              env=env)
        os.replace(temp_index, index)
        os.rename(tmp / "files", files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files, index


def _linked(top: Path) -> bool:
    """Whether a file under ``top`` has another link (a checkout made from another's)."""
    for _, _, names, fd in os.fwalk(top, follow_symlinks=False):
        for name in names:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                return True
    return False


def _settle_times(top: Path) -> None:
    """Put the modification time of each file under ``top`` written in the last second
    (git's index tells a file's age in whole seconds) two seconds back, but for files
    linked from elsewhere (another checkout's, whose index holds their times)."""
    recent = time.time() - 1
    for _, _, names, fd in os.fwalk(top, follow_symlinks=False):
        for name in names:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if st.st_mtime >= recent and st.st_nlink == 1:
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns - 2_000_000_000),
                         dir_fd=fd, follow_symlinks=False)


def _derived(trees: Path, base: str, box_uid: int | None, files: Path, index: Path,
             sid: str, env: dict[str, str]) -> bool:
    """Whether ``sid``'s files and ``index`` were made from the checkout of ``base`` under
    ``trees`` (see :func:`shared_checkout`); where they could not be (none, or it went
    meanwhile), nothing is left of the attempt."""
    if not _derivable(trees, base, box_uid):
        return False
    try:
        _linked_copy(trees / base, files)
        shutil.copy2(trees / f"{base}.index", index)
        # git replaces (unlinks, then writes) each file that changed: never one of the
        # base's, which its views read.
        g.git(*g.UNTRUSTED_CTIME, "read-tree", "-m", "-u", base, sid, cwd=files, env=env)
        # Every file there (the sweep takes no lock: it may have removed a forgotten base's
        # files meanwhile, which git would take for deletions).
        g.git(*g.UNTRUSTED_CTIME, "diff-files", "--quiet", cwd=files, env=env)
        return True
    except (OSError, WorkspaceError) as exc:
        log.warning("the checkout of %s is written whole (its base's could not lend its "
                    "files: %s)", sid[:12], exc)
        shutil.rmtree(files, ignore_errors=True)
        with contextlib.suppress(OSError):
            index.unlink()
        return False


def _derivable(trees: Path, base: str, box_uid: int | None) -> bool:
    """Whether the checkout of ``base`` under ``trees`` is whole (its index written last)
    and its files open to ``box_uid`` (a linked file keeps its ACL entries, and
    :func:`~swarm.agent.grants.grant_tree` grants no file with another link)."""
    if not base or not (trees / base).is_dir() or not (trees / f"{base}.index").is_file():
        return False
    return box_uid is None or (trees / f"{base}.uid-{box_uid}").exists()


def _linked_copy(source: Path, into: Path) -> None:
    """``source``'s folders made again under ``into``, each file (a symbolic link too) a
    hard link to ``source``'s: no file's data written, and no new inode but the folders'
    (writing 5,000 files again was most of a second fan-out's cost on a host)."""
    for folder, dirs, names, fd in os.fwalk(source, follow_symlinks=False):
        rel = os.path.relpath(folder, source)
        target = into if rel == "." else into / rel
        target.mkdir(mode=stat.S_IMODE(os.fstat(fd).st_mode))
        # A link to a folder is listed with the folders (and not gone into).
        links = [d for d in dirs
                 if stat.S_ISLNK(os.stat(d, dir_fd=fd, follow_symlinks=False).st_mode)]
        for name in [*names, *links]:
            os.link(name, target / name, src_dir_fd=fd, follow_symlinks=False)


def changed(lower: Path, upper: Path, limit: int) -> list[str] | None:
    """What a view changed over its lower layer (added, modified or deleted paths,
    sorted), read from its upper folder alone; None past ``limit`` entries. A file only
    copied up (opened for writing, its times touched) with its size and time unchanged
    does not count."""
    out: list[str] = []
    for root, dirs, names in os.walk(upper):
        rel = os.path.relpath(root, upper)
        if rel == ".":
            dirs[:] = [d for d in dirs if d != ".git"]  # the child's own repository
        for name in [*names, *dirs]:
            path = name if rel == "." else os.path.join(rel, name)
            if path == ".git":
                continue
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout: deleted
                out.append(path)
            elif stat.S_ISDIR(st.st_mode):
                if _opaque(os.path.join(root, name)) and os.path.isdir(lower / path):
                    out.append(path)  # replaced as a whole: what was under it is gone
                continue
            else:
                try:
                    old = os.lstat(lower / path)
                    same = (old.st_size, old.st_mtime_ns, stat.S_IFMT(old.st_mode)) == \
                        (st.st_size, st.st_mtime_ns, stat.S_IFMT(st.st_mode))
                except OSError:
                    same = False
                if not same:
                    out.append(path)
            if len(out) > limit:
                return None
    return sorted(out)


def _opaque(path: str) -> bool:
    for name in ("trusted.overlay.opaque", "user.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False
