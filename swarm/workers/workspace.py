"""What a child changed in its workspace, and its commit when it settles.

The workspace itself (``SWARM_HOME/workspaces/<swarm_id>/<agent_id>``: a worktree of its
parent's snapshot, or an empty folder) is made by :class:`swarm.runtime.seed.Seeds`.
When the parent works in a git repository on this host, the worktree is on branch
``swarm/<agent_id>`` of that repository, and the child's changes are committed to it
when it settles, so the parent can ``git merge swarm/<agent_id>``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from swarm.runtime.gitstate import SECRET_PATTERNS
from swarm.runtime.seed import Workspace

__all__ = ["Snapshot", "Workspace", "changed_files", "commit_changes", "snapshot"]

Snapshot = dict[str, tuple[int, int]]
SNAPSHOT_LIMIT = 20_000


def _git(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})


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
    """Commit everything the child changed to its branch (in its parent's repository);
    return a ``--stat`` summary."""
    if not ws.git_branch:
        return ""
    _git(ws.path, "-c", f"core.excludesFile={_excludes(ws)}", "add", "-A")
    if _git(ws.path, "diff", "--cached", "--quiet").returncode == 0:
        return ""
    _git(ws.path, "-c", "user.name=swarm", "-c", "user.email=swarm@localhost", "commit",
         "-q", "--no-verify", "-m", message)
    return _git(ws.path, "show", "--stat", "--format=", "HEAD").stdout.strip()[-2000:]


def _excludes(ws: Workspace) -> str:
    """The secret patterns (and ``.swarmignore``) as an excludes file beside the
    worktree's git files: what the seed left out, the branch leaves out too."""
    path = ws.top.parent / f".{ws.top.name}.excludes"
    lines = [*SECRET_PATTERNS]
    ignore = ws.top / ".swarmignore"
    if ignore.is_file():
        lines += ignore.read_text(errors="replace").splitlines()
    path.write_text("\n".join(lines) + "\n")
    return str(path)
