"""What a child changed in its workspace (to tell whether it has work to send home).

The workspace itself (``SWARM_HOME/workspaces/<swarm_id>/<agent_id>``: its parent's
snapshot with a repository of its own, or an empty folder) is made by
:class:`swarm.runtime.seed.Seeds`; its changes land in its parent's workspace through
:mod:`swarm.runtime.homecoming`.
"""

from __future__ import annotations

import os
from pathlib import Path

from swarm.runtime.seed import Workspace

__all__ = ["Snapshot", "Workspace", "changed_files", "snapshot"]

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
