"""A child's own workspace: a fresh folder, or a git worktree of its parent's repository.

The folder is ``SWARM_HOME/workspaces/<swarm_id>/<agent_id>``. When the parent works in
a git repository on this host, the child gets a ``git worktree`` there on branch
``swarm/<agent_id>`` instead, and its changes are committed to that branch when it
settles, so the parent can ``git merge swarm/<agent_id>``.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

Snapshot = dict[str, tuple[int, int]]
SNAPSHOT_LIMIT = 20_000


@dataclass(frozen=True)
class Workspace:
    path: Path
    git_branch: str = ""
    """``swarm/<agent_id>`` when the workspace is a git worktree."""


def _git(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})


def git_root(path: Path) -> Path | None:
    """The top of the git work tree holding ``path``, or None."""
    if not path.is_dir() or not _inside_git(path):
        return None
    try:
        out = _git(path, "rev-parse", "--show-toplevel")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def _inside_git(path: Path) -> bool:
    """Whether ``path`` or a folder above it has a ``.git``: without one (and without
    ``GIT_DIR``) it is no work tree, and no ``git`` process need be started to say so."""
    if os.environ.get("GIT_DIR"):
        return True
    path = path.resolve()
    return any((p / ".git").exists() for p in (path, *path.parents))


def prepare(home: Path, swarm_id: str, agent_id: str, parent_workspace: str,
            parent_on_this_host: bool) -> Workspace:
    """Create (or find again, after a restart) the child's workspace."""
    path = home / "workspaces" / swarm_id / agent_id
    repo = git_root(Path(parent_workspace)) if parent_on_this_host and parent_workspace else None
    if repo is not None:
        branch = f"swarm/{agent_id}"
        if (path / ".git").exists():
            return Workspace(path, branch)
        path.parent.mkdir(parents=True, exist_ok=True)
        has_head = _git(repo, "rev-parse", "--verify", "HEAD").returncode == 0
        if has_head:
            exists = _git(repo, "rev-parse", "--verify", branch).returncode == 0
            args = ["worktree", "add", str(path), branch] if exists else \
                ["worktree", "add", "-b", branch, str(path), "HEAD"]
            out = _git(repo, *args)
            if out.returncode == 0:
                return Workspace(path, branch)
        # An empty repository (no commit yet) or a failed worktree: a plain folder.
    path.mkdir(parents=True, exist_ok=True)
    return Workspace(path)


def snapshot(path: Path) -> Snapshot:
    """Size and mtime of every file under ``path`` (bounded), to tell what a run changed."""
    out: Snapshot = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            out[os.path.relpath(full, path)] = (st.st_size, st.st_mtime_ns)
            if len(out) >= SNAPSHOT_LIMIT:
                return out
    return out


def changed_files(before: Snapshot, after: Snapshot) -> list[str]:
    """Files added, modified or deleted between two snapshots, sorted."""
    names = set(before) | set(after)
    return sorted(n for n in names if before.get(n) != after.get(n))


def commit_changes(ws: Workspace, message: str) -> str:
    """Commit everything the child changed to its branch; return a ``--stat`` summary."""
    if not ws.git_branch:
        return ""
    _git(ws.path, "add", "-A")
    if _git(ws.path, "diff", "--cached", "--quiet").returncode == 0:
        return ""
    _git(ws.path, "-c", "user.name=swarm", "-c", "user.email=swarm@localhost", "commit",
         "-q", "--no-verify", "-m", message)
    return _git(ws.path, "show", "--stat", "--format=", "HEAD").stdout.strip()[-2000:]
