"""What the sandbox's host uid may reach when a root process runs it: POSIX ACL entries.

A root worker runs its boxes as an unprivileged host uid (``SWARM_SANDBOX_UID``), so
files only root may read stay unreadable in the box. That uid gets, by an ACL entry of its
own (ownership and modes stay as they were, so git's ownership checks see nothing new):

- :func:`grant_tree`: read and write on a workspace and its git folders, every folder
  with a default entry so what root creates in them later is the box's too;
- :func:`grant_search`: search (``--x``, not list) on the folders above what the box
  binds, so bubblewrap can reach them.

Symbolic links are never followed and files with more than one link are left alone: a
box cannot make a grant land on a file outside what it was given. A workspace is opened
as it is at the moment of the grant (:func:`open_beneath`: from a folder the operator named,
such as ``SWARM_SERVE_ROOT``, down, following no link), and granted through that open
folder; the folders above it are walked from ``/`` the same way (:func:`grant_search`), so
a folder swapped for a symbolic link after it was checked gets nothing, nor does where the
link leads.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
from collections.abc import Iterable
from pathlib import Path

from swarm.errors import PathRefused

ACCESS, DEFAULT = "system.posix_acl_access", "system.posix_acl_default"

#: Tags of ACL entries (linux/posix_acl.h), in the order the kernel wants them.
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
_VERSION = 2
_HEAD, _ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
#: How a folder is opened on the way down: never through a symbolic link.
_DOWN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Entry = tuple[int, int, int]
"""(tag, permission bits rwx, id)."""


def from_mode(mode: int) -> list[Entry]:
    """The ACL a mode stands for (no named entries)."""
    return [(USER_OBJ, (mode >> 6) & 7, _NO_ID), (GROUP_OBJ, (mode >> 3) & 7, _NO_ID),
            (OTHER, mode & 7, _NO_ID)]


def decode(blob: bytes) -> list[Entry]:
    """The entries of an ACL as the kernel stores it in its extended attribute."""
    if len(blob) < _HEAD.size or _HEAD.unpack_from(blob)[0] != _VERSION:
        raise ValueError("not a POSIX ACL (version 2)")
    return [(tag, perm, uid) for tag, perm, uid in _ENTRY.iter_unpack(blob[_HEAD.size:])]


def encode(entries: Iterable[Entry]) -> bytes:
    return _HEAD.pack(_VERSION) + b"".join(_ENTRY.pack(*e) for e in sorted(entries))


def with_user(entries: list[Entry], uid: int, perm: int) -> list[Entry] | None:
    """``entries`` where ``uid`` has at least ``perm`` (the mask widened to let it), or
    None when it has that already."""
    named = {e[2]: e[1] for e in entries if e[0] == USER}
    mask = next((e[1] for e in entries if e[0] == MASK), None)
    if named.get(uid, 0) & perm == perm and (mask is None or mask & perm == perm):
        return None
    named[uid] = named.get(uid, 0) | perm
    kept = [e for e in entries if e[0] not in (USER, MASK)]
    group_class = [e[1] for e in kept if e[0] in (GROUP_OBJ, GROUP)] + list(named.values())
    new_mask = (mask if mask is not None else 0) | perm
    if mask is None:
        for bits in group_class:
            new_mask |= bits
    return [*kept, *((USER, p, u) for u, p in named.items()), (MASK, new_mask, _NO_ID)]


def _add(target: int | str, name: str, fallback_mode: int | None, uid: int,
         perm: int) -> None:
    """Give ``uid`` ``perm`` in the ACL ``name`` of ``target`` (an fd, or a path whose last
    part is not followed). ``fallback_mode`` builds the ACL when there is none (None: a
    default ACL, built from the folder's mode too)."""
    follow = isinstance(target, int)
    try:
        entries = decode(os.getxattr(target, name, follow_symlinks=follow))
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise
        assert fallback_mode is not None
        entries = from_mode(fallback_mode)
    changed = with_user(entries, uid, perm)
    if changed is not None:
        os.setxattr(target, name, encode(changed), follow_symlinks=follow)


def inside(path: Path, top: Path) -> Path:
    """``path`` relative to the folder ``top`` (either as given or as it resolves, for a
    ``top`` whose own path has a link); :class:`PathRefused` when it is not inside it."""
    given, anchor = Path(os.path.abspath(path)), Path(os.path.abspath(top))
    for base in (anchor, anchor.resolve()):
        if given.is_relative_to(base):
            return given.relative_to(base)
    raise PathRefused(f"{path} is not inside {top}")


def open_beneath(path: Path, top: Path, create: bool = False) -> int:
    """An fd of the folder ``path`` as it is now, opened from the folder ``top`` down
    without following a symbolic link (``top``, the operator's, is opened as its path
    says); with ``create``, missing folders on the way are made. :class:`PathRefused` when
    ``path`` is not inside ``top``, or a part of it below ``top`` is a link or no folder."""
    rel = inside(path, top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, name in enumerate(rel.parts, start=1):
            try:
                try:
                    down = os.open(name, _DOWN, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, dir_fd=fd)
                    down = os.open(name, _DOWN, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                part = Path(top, *rel.parts[:depth])
                try:
                    link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                except OSError:
                    link = False
                what = "a symbolic link" if link else "not a folder"
                raise PathRefused(f"{part} is {what} (a folder opened beneath {top} never "
                                  "follows a link out of it)") from None
            os.close(fd)
            fd = down
    except BaseException:
        os.close(fd)
        raise
    return fd


def grant_tree(top: Path | int, uid: int) -> None:
    """Let ``uid`` read and write everything under the folder ``top`` (a path, or an open
    folder's fd: :func:`open_beneath`); ``OSError`` when the filesystem has no ACLs
    (EOPNOTSUPP)."""
    walk = os.fwalk(".", dir_fd=top, follow_symlinks=False) if isinstance(top, int) \
        else os.fwalk(top, follow_symlinks=False)
    for _, _, files, dir_fd in walk:
        st = os.fstat(dir_fd)
        if st.st_uid != uid:
            _add(dir_fd, ACCESS, st.st_mode, uid, 7)
            _add(dir_fd, DEFAULT, st.st_mode, uid, 7)
        for name in files:
            _grant_file(dir_fd, name, uid)


def _grant_file(dir_fd: int, name: str, uid: int) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid == uid:
        return  # links, devices, sockets; a hard link may be another folder's file
    perm = (st.st_mode >> 6) & 7  # what the owner may do (a read-only file stays so)
    if st.st_mode & 7 & perm == perm:
        return  # anyone may already
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):
            return  # gone, or swapped for a link since
        raise
    try:
        now = os.fstat(fd)
        if stat.S_ISREG(now.st_mode) and now.st_nlink == 1 and (now.st_dev, now.st_ino) \
                == (st.st_dev, st.st_ino):
            _add(fd, ACCESS, now.st_mode, uid, perm | 4)
    finally:
        os.close(fd)


def grant_search(paths: Iterable[Path], uid: int) -> None:
    """Let ``uid`` search the folders above each of ``paths`` (where others may not):
    walked down from ``/`` as each path is written, following no symbolic link; a link (or
    anything missing) on the way ends that walk, and nothing past it is granted. Callers
    resolve the paths they trust (the operator's) first."""
    done: set[tuple[int, int]] = set()
    for path in paths:
        parts = Path(os.path.abspath(path)).parts
        fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in (*parts[1:-1], None):
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) not in done:
                    done.add((st.st_dev, st.st_ino))
                    if not st.st_mode & stat.S_IXOTH and st.st_uid != uid:
                        _add(fd, ACCESS, st.st_mode, uid, 1)
                if name is None:
                    break
                try:
                    down = os.open(name, _DOWN, dir_fd=fd)
                except OSError:
                    break
                os.close(fd)
                fd = down
        finally:
            os.close(fd)
