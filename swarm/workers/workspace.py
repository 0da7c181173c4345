"""What a child changed in its workspace, and its commit when it settles.

The workspace itself (``SWARM_HOME/workspaces/<swarm_id>/<agent_id>``: a worktree of its
parent's snapshot, or an empty folder) is made by :class:`swarm.runtime.seed.Seeds`.
When the parent works in a git repository on this host, the worktree is on branch
``swarm/<agent_id>`` of that repository, and the child's changes are committed to it
when it settles, so the parent can ``git merge swarm/<agent_id>``.
"""

from __future__ import annotations

import os
from pathlib import Path

from swarm.runtime import gitstate as g
from swarm.runtime.seed import Workspace

__all__ = ["Snapshot", "Workspace", "changed_files", "commit_changes", "snapshot"]

Snapshot = dict[str, tuple[int, int]]
SNAPSHOT_LIMIT = 20_000


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
    """Commit everything the child changed over its worktree's ``HEAD`` (its branch, in
    its parent's repository) as ``git add -A && git commit`` would, without their hooks,
    through the git folders the worker made (:attr:`Workspace.tree`, never the
    workspace's ``.git``); return a ``--stat`` summary ("" when nothing changed). What the
    seed left out (secrets, ``.swarmignore``), the branch leaves out too."""
    work = ws.tree
    if not ws.git_branch or work is None:
        return ""
    parent = g.rev(work.repo, work.head)
    tree = g.write_tree(work)
    if parent and g.git("rev-parse", f"{parent}^{{tree}}", repo=work.repo) == tree:
        return ""
    head = g.git("commit-tree", tree, *(["-p", parent] if parent else []), "-m", message,
                 repo=work.repo, env=AUTHOR)
    g.git("update-ref", "-m", "commit: swarm", work.head, head, *([parent] if parent else []),
          repo=work.repo)
    # Its index as the commit leaves it (git writes it by a lock file and a rename).
    g.git("read-tree", head, cwd=work.top, env=work.env())
    g.ok("update-index", "-q", "--refresh", cwd=work.top, env=work.env())
    return g.diffstat(work.repo, parent, head) if parent else ""


#: Who the commit of a child's changes is by.
AUTHOR = {"GIT_AUTHOR_NAME": "swarm", "GIT_AUTHOR_EMAIL": "swarm@localhost",
          "GIT_COMMITTER_NAME": "swarm", "GIT_COMMITTER_EMAIL": "swarm@localhost"}
