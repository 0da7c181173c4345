"""What a root runner grants the box's host uid (``SWARM_SANDBOX_UID``) by ACL entries: its
workspace and git folders writable, a way through to what the box binds; the folders a
repository's worktrees share walked once per process."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.agent.grants import grant_search, grant_tree
from swarm.agent.sandbox.gitdirs import REPO_WRITABLE, child_top, git_dirs

if TYPE_CHECKING:
    from swarm.agent.sandbox.box import Box

#: Repository folders granted to a uid by this process: (device, inode, uid).
_GRANTED: set[tuple[int, int, int]] = set()


def _folder_key(path: Path, uid: int) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, uid) if stat.S_ISDIR(st.st_mode) else None


def grant(box: Box, ws: Path, fd: int, linked: Path | None) -> None:
    """Give ``box``'s :attr:`~Box.run_as` the workspace ``ws`` (its real path, open as
    ``fd``; ``linked``: see :func:`~swarm.agent.sandbox.gitdirs.git_dirs`) and its git
    folders, and a way to the folders the box binds (:meth:`Box.prepare`)."""
    git = git_dirs(ws, linked)
    if git is not None:  # a repository without reflogs yet: git in the box makes them
        (git.repo / "logs").mkdir(exist_ok=True)
    if box.run_as is None:
        return
    # A view's files are its lower layer's (granted once when its host made it, see
    # swarm.workspace.views) until written: an ACL set through the view would copy every
    # file up. What the view itself holds is its upper folder.
    writable = [ws, *(git.writable if git is not None else [])]
    top = child_top(ws, box.hide)
    if top is not None and linked is None:  # a view's is in its upper folder
        writable.append(top / ".git")
    shared = {str(git.repo / n) for n in REPO_WRITABLE} if git is not None else set()
    for path in [linked if linked is not None else ws, *writable[1:]]:
        # A repository's objects, refs and logs are shared by its worktrees' boxes:
        # walked once per process (thousands of objects at width), as what root adds
        # in them later takes their folders' default entries.
        key = _folder_key(path, box.run_as) if str(path) in shared else None
        if key is None or key not in _GRANTED:
            grant_tree(fd if path is ws else path, box.run_as)
            if key is not None:
                _GRANTED.add(key)
    # The operator's folders as they resolve; read-only ones (the objects a child's
    # repository borrows) as recorded: a link swapped into one ends the walk there.
    bound = [Path(p).resolve() for p in (*box.hide, *([box.home] if box.home else []))]
    grant_search([*writable, *bound, *map(Path, box.read_only),
                  *([git.top] if git is not None else []),
                  *([top] if top is not None else [])], box.run_as)
