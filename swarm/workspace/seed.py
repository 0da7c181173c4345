"""Workspaces that travel: seed a child with its parent's files, bring its work home,
restore a workspace on another host.

- **Seed.** At an ``agent`` call the parent's workspace is snapshotted
  (:func:`~swarm.workspace.gitstate.write_tree`) into a commit without parents, whose id is
  the snapshot's id, and stored once in Redis as a git bundle
  (:class:`~swarm.store.snapshots.SnapshotStore`). A child on the parent's host starts
  from a ``git worktree`` of the object store that already has it (no transfer); a child
  elsewhere fetches the bundle once per host into its host's cache of the snapshots of
  that folder (``SWARM_HOME/seeds/caches/<lineage>.git``: a child's repository borrows
  no other folder's objects), then makes a worktree from there. A plain folder's
  snapshots are kept in a cache of its own on its host (:func:`folder_cache`); the host's
  cache (``SWARM_HOME/seeds/cache.git``), the work of children that started empty. A folder's
  next snapshot is stored as a delta over its previous one (named in
  ``SWARM_HOME/seeds/last/``), so a host that holds that one fetches only what changed.
  A seed's record carries its *preface* (what a child's system prompt reads of its
  files), so a child's agent may ask the model while :meth:`Seeds.make` fetches and
  checks them out (:meth:`Seeds.plan` says where).
- **Views.** Where the worker may mount, a child's worktree is a copy-on-write view of
  one shared checkout of its seed per host (:mod:`swarm.workspace.views`).
- **Bring home.** A settling child's workspace is a commit over its seed, stored as a
  delta bundle; :mod:`swarm.workspace.homecoming` makes it a branch or files where its
  parent works. A parked workspace and its restore elsewhere: :mod:`swarm.workspace.parked`.
  Cleanup: :mod:`swarm.workspace.sweep`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from swarm.agent.folder import instructions_of
from swarm.agent.probe import listing_text
from swarm.errors import SnapshotTooLarge, WorkspaceError, WorkspaceLost
from swarm.store.snapshots import MAX_CHAIN, SnapshotMeta, SnapshotStore
from swarm.text import human_bytes
from swarm.workspace import gitstate as g
from swarm.workspace import views

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Workspace:
    """An agent's workspace: ``path`` (where it works) inside ``root`` (the folder made
    for it; ``path`` differs when its parent worked in a subfolder of a repository).

    A seeded child's git is its own: ``root/.git`` is a repository the worker made for
    it (its branch ``swarm/<agent>`` at the commit it started from, the objects of
    ``odb`` borrowed read-only through ``objects/info/alternates``), which its commands
    may use as they like. The worker never runs git on it (its config is the child's):
    it reads the work tree through ``odb``, a repository it chose (the parent's, or the
    host's cache), with an index of its own (``index``, under ``SWARM_HOME``)."""

    path: Path
    root: Path | None = None
    seed: str = ""
    """The snapshot it started from ("": an empty folder)."""
    odb: Path | None = None
    """The repository holding its seed's objects, where its captures are written (None:
    not seeded)."""
    index: Path | None = None
    """The worker's own index of its files (never the one its commands write)."""
    view: Path | None = None
    """The folder of its copy-on-write view (its upper folder, named for the agent,
    ``work`` and the file ``lower``), or None: a full checkout or a plain folder
    (:mod:`swarm.workspace.views`)."""

    @property
    def top(self) -> Path:
        return self.root or self.path

    @property
    def tree(self) -> g.WorkTree | None:
        """A child's work tree is read as a folder (see the class), never as a git work
        tree: None."""
        return None


@dataclass(frozen=True)
class Planned:
    """A new child's workspace as it will be (:meth:`Seeds.plan`), before it is made."""

    workspace: Workspace
    start: str
    """The commit checked out (the parent's own when its repository is borrowed)."""
    meta: SnapshotMeta | None
    """Its seed's record (None: an empty folder)."""
    borrowed: bool = False
    """Its seed's objects are borrowed where they are (its parent's host), not fetched."""

    @property
    def preface(self) -> tuple[str, str] | None:
        """What the system prompt reads of its files (listing, instructions), from its
        seed's record, so its agent may start before they are there; None: it waits."""
        if self.meta is None or not self.meta.preface:
            return None
        try:
            found = json.loads(self.meta.preface)
            return str(found["listing"]), str(found["instructions"])
        except (ValueError, KeyError, TypeError):
            return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the file ``path`` across threads and processes of a host."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def upper(view: Path) -> Path:
    """A view's upper folder (its changes, and its .git file)."""
    return view / view.name


#: (repository, commit) pairs this process found present: a wide fan-out asks git once.
_PRESENT: set[tuple[str, str]] = set()
#: The same pairs -> the lock this process's threads wait on while one of them fetches.
_FETCHING: dict[tuple[str, str], threading.Lock] = {}
_PRESENT_LOCK = threading.Lock()


def _forget_fetching() -> None:  # a forked child: no other thread holds them there
    global _PRESENT_LOCK
    _PRESENT_LOCK = threading.Lock()
    _FETCHING.clear()


os.register_at_fork(after_in_child=_forget_fetching)


#: A store's snapshot ids -> their lineages (:attr:`SnapshotMeta.lineage`), as this
#: process read them (:meth:`Seeds.plan`): a child's capture does not read its seed's
#: record again.
_LINEAGES: weakref.WeakKeyDictionary[SnapshotStore, dict[str, str]] = \
    weakref.WeakKeyDictionary()


#: The snapshot "id" of an empty workspace: nothing is stored, an empty folder is made.
EMPTY = "empty"


class Seeds:
    """Snapshots of one host (``home`` is its ``SWARM_HOME``) on one store."""

    def __init__(self, store: SnapshotStore, home: Path, host: str, snapshot_max: int = 0,
                 swarm_max: int = 0, view: str = "auto", box_uid: int | None = None) -> None:
        self.store = store
        self.home = home
        self.host = host
        self.snapshot_max = snapshot_max
        self.swarm_max = swarm_max
        self.view = view
        """``auto``: children's workspaces are copy-on-write views where this process can
        mount them; ``checkout``: full checkouts (SWARM_SEED_VIEW)."""
        self.box_uid = box_uid
        """The host uid a root worker's sandbox runs commands as (None: no such box)."""

    @property
    def cache(self) -> Path:
        """This host's bare repository of what no child borrows: the files of children
        that started empty, sent home (made on first use). Seeds fetched:
        :meth:`cache_for`; a plain folder's snapshots: :meth:`folder_cache`."""
        return self._bare(self.home / "seeds" / "cache.git")

    def folder_cache(self, folder: Path) -> Path:
        """The bare repository of the snapshots of the plain folder ``folder`` (made on
        first use): its children on this host borrow its objects, no other folder's."""
        return self._bare(folder_cache(self.home, folder))

    def _bare(self, path: Path) -> Path:
        if not (path / "objects").is_dir():
            with _locked(self.home / "seeds" / "cache.lock"):
                g.ensure_bare(path)
        return path

    def cache_for(self, seed: str, meta: SnapshotMeta | None = None) -> Path:
        """This host's bare repository of the snapshots fetched of one folder (``seed``'s
        lineage), made on first use: a child's repository borrows the objects of its
        seed's alone, never another folder's (another swarm's, another user's)."""
        meta = meta if meta is not None else self.store.meta(seed)
        if meta is None:
            return self.cache  # gone: fetching it fails anyway, saying so
        lineage = meta.lineage if re.fullmatch(r"[0-9a-f]{24}", meta.lineage) else \
            _lineage(meta.origin, meta.odb)  # a snapshot from before lineages
        return self._bare(self.home / "seeds" / "caches" / f"{lineage}.git")

    # -- seed -------------------------------------------------------------------------------

    def take(self, workspace: Path, swarm_id: str, base: str = "",
             tree_of: g.WorkTree | None = None, own: Workspace | None = None) -> str:
        """Snapshot ``workspace`` as its agent sees it and store it (once); its id. It is a
        git work tree when ``tree_of`` (chosen by the caller, never found from the folder,
        which commands write) is given, a seeded child's workspace ``own`` (read through
        its repository and index), else a plain folder. With ``base`` (the snapshot
        the workspace was seeded from), it is stored as a delta over it.
        :class:`SnapshotTooLarge` names the size, the cap and what to do."""
        head = ""
        if tree_of is not None:
            top, odb = tree_of.top, tree_of.repo
            tree = g.write_tree(tree_of)
            subdir = str(workspace.resolve().relative_to(top.resolve()))
            head = g.rev(odb, tree_of.head)
        elif own is not None and own.odb is not None and own.index is not None:
            top, odb = own.top, own.odb
            tree = g.write_tree(top, odb=odb, index=own.index)
            subdir = str(workspace.resolve().relative_to(top.resolve()))
        else:
            if not any(workspace.iterdir()):
                return EMPTY  # before a cache is made for it: a git init costs ~10 ms
            top, odb, subdir = workspace, self.folder_cache(workspace), "."
            key = hashlib.sha256(str(workspace.resolve()).encode()).hexdigest()[:16]
            tree = g.write_tree(top, odb=odb, index=self.home / "seeds" / "index" / key)
        # A root's or a job's folder: its previous snapshot (named under SWARM_HOME, never
        # by a ref in the user's repository) is the new one's base, so it is stored and
        # moves as what changed since, to every host that holds that one.
        last = self.home / "seeds" / "last" / hashlib.sha256(
            f"{odb}\0{workspace.resolve()}".encode()).hexdigest()[:32] if own is None else None
        if last is not None and base in ("", EMPTY):
            with contextlib.suppress(OSError):
                base = last.read_text().strip()
                base = base if re.fullmatch(r"[0-9a-f]{40,64}", base) else ""
        if tree == g.EMPTY_TREE:
            return EMPTY  # nothing to ship: the children start in empty folders
        files, size = g.tree_stats(odb, tree)
        if self.snapshot_max and size > self.snapshot_max:
            raise SnapshotTooLarge(
                f"the workspace snapshot is {human_bytes(size)} in {files} files; the cap is "
                f"{human_bytes(self.snapshot_max)} (SWARM_SNAPSHOT_MAX). Add ignores to "
                ".swarmignore (or .gitignore) for what the children do not need, raise "
                "SWARM_SNAPSHOT_MAX, or call agent with seed=false for a child that starts "
                "empty")
        sid = g.commit(odb, tree, [], "swarm seed")
        local = g.commit(odb, tree, [head], "swarm: the workspace as the parent saw it") \
            if head else sid
        g.keep(odb, sid)
        if local != sid:
            g.git("update-ref", f"refs/swarm/local/{sid}", local, repo=odb)
        base = base if base not in ("", EMPTY, sid) and g.has(odb, base) and \
            (self.store.depth(base) or MAX_CHAIN) < MAX_CHAIN else ""
        based = self.store.meta(base) if base else None
        lineage = based.lineage if based is not None and based.lineage else \
            _lineage(self.host, str(odb), str(workspace.resolve()))
        self.publish(odb, SnapshotMeta(sid, 0, 0, "", base, files, self.host, str(odb), local,
                                        "" if subdir == "." else subdir,
                                        _preface(odb, tree, subdir), lineage), swarm_id)
        if last is not None:
            last.parent.mkdir(parents=True, exist_ok=True)
            tmp = last.with_name(f".{last.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(sid)
            os.replace(tmp, last)
        return sid

    def publish(self, odb: Path, meta: SnapshotMeta, swarm_id: str, new: bool = False) -> None:
        """Store the snapshot ``meta`` of ``odb`` unless it is stored already (then its
        TTL is pushed on). ``new``: most likely not stored (a child's capture), so it is
        bundled without asking first."""
        if not new and self.store.exists(meta.id):
            return
        data = g.bundle(odb, meta.id, meta.base)
        if self.snapshot_max and len(data) > self.snapshot_max:
            if new and self.store.exists(meta.id):
                return
            raise SnapshotTooLarge(
                f"the snapshot's bundle is {human_bytes(len(data))}; the cap is "
                f"{human_bytes(self.snapshot_max)} (SWARM_SNAPSHOT_MAX). Add ignores to "
                ".swarmignore (or .gitignore), or raise SWARM_SNAPSHOT_MAX")
        if not self.store.put(meta, data, swarm_id, self.swarm_max) and new:
            self.store.exists(meta.id)  # stored already: its TTL pushed on, as above

    def fetch(self, sid: str, into: Path) -> int:
        """Make commit ``sid`` (and the snapshots it is a delta over) present in the
        repository ``into``: once per host, whoever asks at the same time; the bytes this
        call fetched (0 when it was there)."""
        key = (str(into), sid)
        if key in _PRESENT:
            return 0
        # This process's threads wait for the one that asks (a wide fan-out's children
        # would each start a git process to look, then queue on the host's lock).
        with _PRESENT_LOCK:
            asking = _FETCHING.setdefault(key, threading.Lock())
        with asking:
            if key in _PRESENT:
                return 0
            if g.has(into, sid):
                _PRESENT.add(key)
                return 0
            with _locked(self.home / "seeds" / "locks" / f"{sid}.lock"):
                if g.has(into, sid):
                    _PRESENT.add(key)
                    return 0
                meta, data = self.store.get(sid)
                fetched = self.fetch(meta.base, into) if meta.base else 0
                if meta.base:  # the delta's bundle needs its base reachable from a ref
                    g.keep(into, meta.base)
                g.unbundle(into, sid, data)
                self.store.fetched(sid, self.host, len(data))
                _PRESENT.add(key)
                with _PRESENT_LOCK:
                    _FETCHING.pop(key, None)  # its waiters hold it; later ones need none
                return fetched + len(data)

    def child(self, swarm_id: str, agent_id: str, seed: str) -> Workspace:
        """A new child's workspace: its parent's snapshot ``seed`` checked out with a
        repository of its own (an empty folder when ``seed`` is "")."""
        return self.make(self.plan(swarm_id, agent_id, seed))

    def plan(self, swarm_id: str, agent_id: str, seed: str) -> Planned:
        """What :meth:`make` will make of a new child's workspace (quick: it reads the
        snapshot's record; the files are not there yet)."""
        path = self.home / "workspaces" / swarm_id / agent_id
        if seed in ("", EMPTY):
            return Planned(Workspace(path, root=path), "", None)
        meta = self.store.meta(seed)
        if meta is None:
            raise WorkspaceLost(f"the snapshot of the parent's workspace ({seed[:12]}) is not "
                                "in the store any more")
        _remember(self.store, meta)
        odb = Path(meta.odb)
        start = meta.local or seed
        borrowed = meta.origin == self.host and odb.is_dir() and g.has(odb, start)
        if not borrowed:
            odb, start = self.cache_for(seed, meta), seed  # fetched into this host's cache
        view = path.parent / ".views" / path.name \
            if self.view == "auto" and not views.unavailable(self.home) else None
        return Planned(Workspace(path / meta.subdir if meta.subdir else path, root=path,
                                 seed=seed, odb=odb, index=self.index_of(swarm_id, agent_id),
                                 view=view), start, meta, borrowed)

    def make(self, planned: Planned) -> Workspace:
        """The workspace ``planned``: its snapshot fetched (once per host) and checked out
        (its ``view`` None if a copy-on-write view could not be made)."""
        ws, meta = planned.workspace, planned.meta
        path = ws.top
        if meta is None or ws.odb is None or ws.index is None:
            path.mkdir(parents=True, exist_ok=True)
            return ws
        if planned.borrowed:
            # The parent's host: its objects are borrowed where they are, no transfer.
            self.store.fetched(ws.seed, self.host, 0)
        else:
            self.fetch(ws.seed, ws.odb)
        view = self.checkout(ws.odb, path, f"swarm/{path.name}", planned.start, ws.seed,
                             ws.index)
        if meta.subdir:
            (path / meta.subdir).mkdir(parents=True, exist_ok=True)
        return dataclasses.replace(ws, view=view)

    def index_of(self, swarm_id: str, agent_id: str) -> Path:
        """Where the worker keeps its own index of an agent's workspace."""
        return self.home / "seeds" / "index" / swarm_id / agent_id

    def pinned(self, key: str, folder: Path) -> g.WorkTree | None:
        """The git work tree of a root's or a job's own ``folder``, found the first time
        (before its commands ran) and kept under ``SWARM_HOME`` as ``key``: a ``.git`` a
        command plants in it later is never taken for its repository."""
        pin = self.home / "seeds" / "pins" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}"
        try:
            kept = json.loads(pin.read_text())
            if kept.get("folder") == str(folder):
                if not kept.get("repo"):
                    return None
                return g.WorkTree(Path(kept["top"]), Path(kept["repo"]), kept["name"])
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        found = g.discover(folder)
        pin.parent.mkdir(parents=True, exist_ok=True)
        tmp = pin.with_suffix(".tmp")
        tmp.write_text(json.dumps({"folder": str(folder)} | ({} if found is None else {
            "top": str(found.top), "repo": str(found.repo), "name": found.name})))
        os.replace(tmp, pin)
        return found

    # -- checkouts and views ----------------------------------------------------------------

    def checkout(self, repo: Path, path: Path, branch: str, start: str, seed: str,
                 index: Path) -> Path | None:
        """The files of ``start`` (a commit of ``repo`` whose files are those of snapshot
        ``seed``) at ``path``, with a repository of its own on ``branch`` there
        (:func:`~swarm.workspace.gitstate.own_repository`) and the worker's ``index`` of
        them: a copy-on-write view of the host's shared checkout of ``seed`` where this
        process can mount one (its view folder), else a full checkout (None)."""
        if self.view == "auto" and not views.unavailable(self.home):
            try:
                return self._view(repo, path, branch, start, seed, index)
            except (OSError, WorkspaceError) as exc:
                log.warning("a full checkout for %s instead of a view: %s", path.name, exc)
                self.unmount_view(path.parent / ".views" / path.name, path, remove=True)
        dot = g.own_repository(path, repo, branch, start)
        env = {"GIT_DIR": str(dot), "GIT_WORK_TREE": str(path),
               "GIT_INDEX_FILE": str(dot / "index")}
        g.git("-c", f"checkout.workers={min(8, os.cpu_count() or 1)}", "read-tree", "-u",
              "--reset", start, cwd=path, env=env)
        _copy_index(dot / "index", index)
        return None

    def _view(self, repo: Path, path: Path, branch: str, start: str, seed: str,
              index: Path) -> Path:
        trees = self.home / "seeds" / "trees"
        with _locked(self.home / "seeds" / "locks" / f"tree-{seed}.lock"):
            # A delta's base checked out here already lends it its unchanged files.
            base = "" if (trees / seed).is_dir() else self._base_of(seed)
            lower, shared = views.shared_checkout(repo, seed, trees, self.box_uid, base)
        folder = path.parent / ".views" / path.name
        self.unmount_view(folder, path, remove=True)
        folder.mkdir(parents=True)
        (folder / "work").mkdir()
        (folder / "lower").write_text(str(lower))
        # Its repository is in the view's upper folder; its files come from the shared
        # checkout, its index (and the worker's) is a copy of that one's.
        top = upper(folder)
        dot = g.own_repository(top, repo, branch, start)
        shutil.copy2(shared, dot / "index")
        _copy_index(shared, index)
        path.mkdir(parents=True, exist_ok=True)
        views.mount(lower, top, folder / "work", path)
        return folder

    def attach(self, ws: Workspace) -> Workspace:
        """``ws`` ready to work in: its view mounted again if it is one (a run of its
        agent in another process or after a restart)."""
        if ws.view is not None and not views.mounted(ws.top):
            lower = Path((ws.view / "lower").read_text())
            try:
                views.mount(lower, upper(ws.view), ws.view / "work", ws.top)
            except OSError as exc:
                raise WorkspaceLost(f"the workspace view at {ws.top} could not be mounted "
                                    f"on {self.host}: {exc}") from None
        return ws

    def found(self, path: Path, swarm_id: str, agent_id: str, seed: str) -> Workspace:
        """A workspace already on this host (a resume, a continuation, a takeover), its
        view mounted again where it is one."""
        root = self.home / "workspaces" / swarm_id / agent_id
        top = root if root.is_dir() and path.resolve().is_relative_to(root.resolve()) else path
        view = self.view_of(top)
        if view is not None:
            self.attach(Workspace(path, root=top, view=view))
        if not seed or seed == EMPTY or top != root:
            return Workspace(path, root=top, view=view)
        # Its seed's objects are where this host took them from: its parent's repository
        # (chosen by the worker, never read from the workspace) or the host's cache.
        meta = self.store.meta(seed)
        odb = Path(meta.odb) if meta is not None and meta.origin == self.host else None
        if odb is None or not g.has(odb, seed):
            odb = self.cache_for(seed, meta)
            self.fetch(seed, odb)
        return Workspace(path, root=top, seed=seed, odb=odb,
                         index=self.index_of(swarm_id, agent_id), view=view)

    def view_of(self, top: Path) -> Path | None:
        """The view folder of the workspace whose top folder is ``top``, or None."""
        folder = top.parent / ".views" / top.name
        return folder if (folder / "lower").is_file() else None

    def unmount(self, ws: Workspace) -> None:
        """The run in ``ws`` ended: unmount its view (its changes stay in its folder)."""
        if ws.view is not None and views.mounted(ws.top):
            views.unmount(ws.top)

    @staticmethod
    def unmount_view(folder: Path, path: Path, remove: bool = False) -> None:
        """Unmount the view at ``path`` if mounted; with ``remove``, delete its ``folder``."""
        if views.mounted(path):
            views.unmount(path)
        if remove and folder.exists():
            shutil.rmtree(folder, ignore_errors=True)

    def changed(self, ws: Workspace, limit: int) -> list[str] | None:
        """What a view's run changed over its seed (None: not a view, or too many)."""
        if ws.view is None:
            return None
        lower = Path((ws.view / "lower").read_text())
        found = views.changed(lower, upper(ws.view), limit)
        if found is None or ws.path == ws.top:
            return found
        sub = str(ws.path.relative_to(ws.top))
        return [os.path.relpath(f, sub) for f in found if Path(f).is_relative_to(sub)]

    # -- settle and restore -----------------------------------------------------------------

    def capture(self, ws: Workspace, swarm_id: str) -> str:
        """Store the workspace as it is now, as a commit over its seed (a delta); its id,
        or "" when nothing changed since the seed. Read through the worker's own
        repository and index (:class:`Workspace`), whatever its commands did with the
        workspace's git. No ref keeps the commit where it is written: a landing looks
        for it there and fetches the stored bundle when it is not (a ``git gc`` took it)."""
        top = ws.top.resolve()
        if ws.odb is None or ws.index is None or not ws.seed:
            if not any(ws.top.iterdir()):
                return ""
            repo = self.cache
            key = hashlib.sha256(str(top).encode()).hexdigest()[:16]
            tree = g.write_tree(ws.top, odb=repo, index=self.home / "seeds" / "index" / key)
            parents: list[str] = []
            if tree == g.EMPTY_TREE:
                return ""
        else:
            repo = ws.odb
            tree = g.write_tree(ws.top, odb=repo, index=ws.index)
            parents = [ws.seed]
            if g.tree_of(repo, ws.seed) == tree:
                return ""
        sid = g.commit(repo, tree, parents, "swarm: a child's work")
        lineage = self._lineage_of(ws.seed) if ws.seed else ""
        self.publish(repo, SnapshotMeta(sid, 0, 0, "", ws.seed, 0, self.host, str(repo), sid,
                                        lineage=lineage or _lineage(self.host, str(repo),
                                                                    str(top))),
                     swarm_id, new=True)
        return sid

    def _base_of(self, seed: str) -> str:
        """The snapshot ``seed`` is stored as a delta over ("": a whole one, or gone)."""
        meta = self.store.meta(seed)
        return meta.base if meta is not None else ""

    def _lineage_of(self, seed: str) -> str:
        """The lineage of the stored snapshot ``seed`` ("": gone, or from before
        lineages), read from the store once per process."""
        known = _LINEAGES.setdefault(self.store, {})
        if seed not in known:
            _remember(self.store, self.store.meta(seed))
        return known.get(seed, "")


def folder_cache(home: Path, folder: Path) -> Path:
    """Where the snapshots of the plain folder ``folder`` are kept under ``home``
    (:meth:`Seeds.folder_cache`), and the changes its children sent home."""
    return home / "seeds" / "caches" / f"{_lineage('folder', str(folder.resolve()))}.git"


def _remember(store: SnapshotStore, meta: SnapshotMeta | None) -> None:
    """Keep the lineage of ``meta``, read from ``store``, in :data:`_LINEAGES`."""
    if meta is not None:
        known = _LINEAGES.setdefault(store, {})
        if len(known) >= 4096:
            known.clear()
        known[meta.id] = meta.lineage


def _lineage(*parts: str) -> str:
    """A lineage (:attr:`SnapshotMeta.lineage`): the folder a snapshot is of, hashed."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _preface(odb: Path, tree: str, subdir: str) -> str:
    """:attr:`SnapshotMeta.preface` of a snapshot of ``tree`` whose workspace is at
    ``subdir`` of it ("" when the prompt needs more than it holds)."""
    try:
        found = g.preface(odb, tree if subdir == "." else
                          g.git("rev-parse", "--verify", "-q", f"{tree}:{subdir}", repo=odb))
    except WorkspaceError:
        return ""
    if found is None:
        return ""
    names, files = found
    if subdir == ".":
        names.append(".git/")  # a seeded child's own repository
    return json.dumps({"listing": listing_text(names), "instructions": instructions_of(files)})


def _copy_index(source: Path, dest: Path) -> None:
    """The worker's own copy of an index (its folder made as needed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, dest)  # its mtime too: git tells racily clean entries by it
