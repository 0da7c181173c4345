"""Workspaces: the folder an agent works in, and its life across hosts.

A workspace's life, in order:

- **Made or restored** on a worker: a child's workspace is a worktree of its seed with a
  repository of its own (:class:`~swarm.workspace.seed.Seeds`), or an empty folder; a
  parked one is found where it was or rebuilt on another host
  (:mod:`~swarm.workspace.parked`).
- **Seeded** from its parent's *snapshot*: the parent's files as it sees them, committed
  and stored once in Redis as a git bundle (:mod:`swarm.store.snapshots`, the store layer
  under this package; a folder's next snapshot as a delta over its previous one), fetched
  once per host (:mod:`~swarm.workspace.seed`), while the child's agent already asks the
  model (:mod:`swarm.workers.arrival`).
- **Viewed**: where the worker may mount, a copy-on-write overlay of one shared checkout
  per host (:mod:`~swarm.workspace.views`).
- **Captured**: what its agent changed, as a commit over its seed
  (:meth:`~swarm.workspace.seed.Seeds.capture`), or as a *listing* of sizes and times
  when it has no seed (:mod:`~swarm.workspace.listing`).
- **Brought home and landed**: each settled child's changes merged into its parent's
  working tree, three-way, in call order (:mod:`~swarm.workspace.homecoming`).
- **Parked** with its agent, as the snapshot taken for its children
  (:mod:`~swarm.workspace.parked`).
- **Swept**: what a forgotten swarm left on a host removed (:mod:`~swarm.workspace.sweep`).

The git plumbing under all of it is :mod:`~swarm.workspace.gitstate` (no Redis there).
"""
