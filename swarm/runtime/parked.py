"""A parked workspace, exactly as its agent left it, and its restore on another host.

As a parent in a worker parks, its workspace is stored as one commit (a delta over the
snapshot its new children start from, which has the same files):

- its tree: the files as the agent sees them (the work tree, untracked files included);
- first parent: a commit of its git index (what is staged) over its ``HEAD``;
- further parents: the branches ``swarm/<child>`` its earlier children brought home,
  named in the message (``branch swarm/<child>`` lines, in the order of the parents).

A workspace made in its parent's own repository (same host) has a history that goes back
into the user's; what it made over its start is re-made over its seed for transport, so
nothing of the user's history is shipped. Restored elsewhere, the worktree is on
``swarm/<agent_id>`` at its ``HEAD``, with its index and files as they were, its
children's branches, and ``refs/swarm/local/<seed>`` for the children still out.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable

from swarm.domain.messages import tool_body
from swarm.domain.session import Session
from swarm.errors import WorkspaceError, WorkspaceLost
from swarm.runtime import gitstate as g
from swarm.runtime.seed import EMPTY, Seeds, Workspace, upper
from swarm.store.snapshots import SnapshotMeta

#: The first line of a parked workspace's commit message.
PARKED = "swarm: a parked workspace"


def branches_in(session: Session) -> list[str]:
    """The ``swarm/<child>`` branches its children's results (in its session) named."""
    names: list[str] = []
    for message in session.messages:
        body = tool_body(message)
        if body is not None and str(body.get("git_branch", "")).startswith("swarm/"):
            names.append(str(body["git_branch"]))
    return names


def state(seeds: Seeds, ws: Workspace, sid: str, swarm_id: str,
          branches: Iterable[str]) -> str:
    """Store the workspace ``ws`` as it parks (``sid``: the snapshot just taken of it for
    its new children); the id to restore it from. A workspace that is not a seeded
    worktree is its snapshot ``sid`` (its files only)."""
    work = ws.tree
    if sid == EMPTY or not ws.seed or work is None:
        return sid
    repo = work.repo
    meta = seeds.store.meta(ws.seed)
    start = meta.local if ws.home_branch and meta is not None and meta.local else ws.seed
    memo: dict[str, str] = {}

    def portable(commit: str) -> str:
        if not commit or start == ws.seed:
            return commit
        return g.transplant(repo, commit, start, ws.seed, memo)

    head = portable(g.rev(repo, work.head)) or ws.seed
    tree = g.git("rev-parse", f"{sid}^{{tree}}", repo=repo)
    index = g.commit(repo, g.index_tree(work) or tree, [head], "swarm: the index as it was")
    names, heads = [], []
    for name in sorted(set(branches)):
        commit = portable(g.rev(repo, f"refs/heads/{name}"))
        if commit:
            names.append(name)
            heads.append(commit)
    message = PARKED + "\n\n" + "".join(f"branch {name}\n" for name in names)
    sealed = g.commit(repo, tree, [index, *heads], message)
    g.keep(repo, sealed)
    seeds.publish(repo, SnapshotMeta(sealed, 0, 0, "", sid, 0, seeds.host, str(repo), sealed),
                  swarm_id)
    return sealed


def restore(seeds: Seeds, swarm_id: str, agent_id: str, seed: str, sealed: str) -> Workspace:
    """Rebuild on this host an agent's workspace from the snapshot ``sealed`` taken as it
    parked or settled; :class:`WorkspaceLost` when it cannot be."""
    path = seeds.home / "workspaces" / swarm_id / agent_id
    seed = "" if seed == EMPTY else seed
    seeds.release_view(path.parent / ".views" / agent_id, path, remove=True)
    if sealed == EMPTY:  # it was empty as it parked
        path.mkdir(parents=True, exist_ok=True)
        return Workspace(path, root=path)
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        repo = seeds.cache
        seeds.fetch(sealed, repo)
        if not seed:
            g.checkout_files(repo, sealed, path)
            return Workspace(path, root=path)
        seeds.fetch(seed, repo)
        meta = seeds.store.meta(seed)
        parents, message = g.git("log", "-1", "--format=%P%x00%B", sealed,
                                 repo=repo).split("\0", 1)
        exact = message.startswith(PARKED) and bool(parents)
        ids = parents.split()
        head = g.git("rev-parse", f"{ids[0]}^", repo=repo) if exact else seed
        branch = f"swarm/{agent_id}"
        g.git("worktree", "prune", repo=repo)
        view = seeds.checkout(repo, path, branch, head, seed)
        found = g.registered(repo, upper(view) if view is not None else path)
        if found is None:
            raise WorkspaceError(f"no worktree of {repo} is registered at {path}")
        work = g.WorkTree(path, repo, found.name)
        g.git("read-tree", "-u", "--reset", sealed, cwd=path, env=work.env())
        if exact:  # the index as it was
            g.git("read-tree", f"{ids[0]}^{{tree}}", cwd=path, env=work.env())
            g.ok("update-index", "-q", "--refresh", cwd=path, env=work.env())
            names = [line.removeprefix("branch ").strip() for line in message.splitlines()
                     if line.startswith("branch swarm/")]
            for name, commit in zip(names, ids[1:], strict=False):
                g.git("update-ref", f"refs/heads/{name}", commit, repo=repo)
            snapshot = seeds.store.meta(sealed)
            if snapshot is not None and snapshot.base:
                # Children still out started from this: their branches go over it.
                tree = g.git("rev-parse", f"{sealed}^{{tree}}", repo=repo)
                local = g.commit(repo, tree, [head], "swarm: the workspace as the parent saw it")
                g.git("update-ref", f"refs/swarm/local/{snapshot.base}", local, repo=repo)
        else:  # its changes uncommitted over its seed: the index is its HEAD's
            g.git("read-tree", head, cwd=path, env=work.env())
    except WorkspaceError as exc:
        raise WorkspaceLost(f"the workspace of {agent_id} could not be restored on "
                            f"{seeds.host}: {exc}") from None
    subdir = meta.subdir if meta is not None else ""
    return Workspace(path / subdir if subdir else path, branch, root=path, seed=seed,
                     repo=repo, view=view, worktree=work.name)
