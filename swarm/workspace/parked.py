"""A parked workspace, as its agent left it, and its restore on another host.

As a parent in a worker parks, its workspace is the snapshot just taken for its new
children (its files as it sees them). Restored elsewhere, the workspace has those files,
over its seed, with a repository of its own on ``swarm/<agent_id>`` at its seed (its
changes uncommitted): what its commands did with that repository on the first host (its
commits, branches, stash) does not travel, as it never lands.
"""

from __future__ import annotations

import shutil

from swarm.errors import WorkspaceError, WorkspaceLost
from swarm.workspace import gitstate as g
from swarm.workspace.seed import EMPTY, Seeds, Workspace


def state(sid: str) -> str:
    """The id to restore a parked workspace from: ``sid``, the snapshot just taken of it
    for its new children."""
    return sid


def restore(seeds: Seeds, swarm_id: str, agent_id: str, seed: str, sealed: str) -> Workspace:
    """Rebuild on this host an agent's workspace from the snapshot ``sealed`` taken as it
    parked or settled; :class:`WorkspaceLost` when it cannot be."""
    path = seeds.home / "workspaces" / swarm_id / agent_id
    seed = "" if seed == EMPTY else seed
    seeds.unmount_view(path.parent / ".views" / agent_id, path, remove=True)
    if sealed == EMPTY:  # it was empty as it parked
        path.mkdir(parents=True, exist_ok=True)
        return Workspace(path, root=path)
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        repo = seeds.cache_for(seed) if seed else seeds.cache  # its seed's lineage
        seeds.fetch(sealed, repo)
        if not seed:
            g.checkout_files(repo, sealed, path)
            return Workspace(path, root=path)
        seeds.fetch(seed, repo)
        meta = seeds.store.meta(seed)
        index = seeds.index_of(swarm_id, agent_id)
        seeds.checkout(repo, path, f"swarm/{agent_id}", seed, seed, index)
        # Its files as they were, its own index at its seed (its changes uncommitted).
        dot = path / ".git"
        env = {"GIT_DIR": str(dot), "GIT_WORK_TREE": str(path),
               "GIT_INDEX_FILE": str(dot / "index")}
        g.git(*g.UNTRUSTED_CTIME, "read-tree", "-u", "-m", seed, sealed, cwd=path, env=env)
        g.git("read-tree", seed, cwd=path, env=env)
    except WorkspaceError as exc:
        raise WorkspaceLost(f"the workspace of {agent_id} could not be restored on "
                            f"{seeds.host}: {exc}") from None
    subdir = meta.subdir if meta is not None else ""
    return Workspace(path / subdir if subdir else path, root=path, seed=seed, odb=repo,
                     index=index, view=seeds.view_of(path))
