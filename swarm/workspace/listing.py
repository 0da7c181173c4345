"""A workspace's *listing*: the size and modification time of each of its files, taken
when a run begins and again as it ends, to tell what the run changed.

Used only where there is no better account of a workspace's changes: a child with a seed
and a view knows them from its upper folder, and one with a repository from git
(:meth:`swarm.workspace.seed.Seeds.changed`). Not a *snapshot* (a commit of the files
themselves, stored as a git bundle: :mod:`swarm.store.snapshots`).
"""

from __future__ import annotations

import os
from pathlib import Path

#: Path -> (size, mtime in ns) of every file, ``.git`` folders left out.
Listing = dict[str, tuple[int, int]]
#: At most this many files are listed: a listing this long is not complete.
LISTING_LIMIT = 20_000


def listing(path: Path) -> Listing:
    """Size and mtime of every file under ``path`` (bounded), to tell what a run changed."""
    out: Listing = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            out[os.path.relpath(full, path)] = (st.st_size, st.st_mtime_ns)
            if len(out) >= LISTING_LIMIT:
                return out
    return out


def changed_files(before: Listing, after: Listing) -> list[str]:
    """Files added, modified or deleted between two listings, sorted."""
    names = set(before) | set(after)
    return sorted(n for n in names if before.get(n) != after.get(n))
