"""The git folders a box binds around its workspace: a worktree's own folder and its
repository's (:func:`git_dirs`, checked so that a ``.git`` file a command wrote opens
nothing), a repository's own ``.git`` kept read-only where git obeys it
(:func:`own_repository`), and a child's top folder when it works in a subfolder
(:func:`child_top`)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

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

