"""Cleanup of what workspaces that travel leave on a host, bounded by the store's TTLs.

On a host (its ``SWARM_HOME``), a swarm leaves its children's workspaces
(``workspaces/<swarm>/``, views and their own repositories included), the worker's
indexes of them (``seeds/index/<swarm>/``) and the files of children started empty
(``returned/<swarm>/``); its snapshots leave shared checkouts (``seeds/trees/<id>``) and
refs in the host's cache (``refs/swarm/snap/<id>``, ``refs/swarm/local/<id>``), and refs
in a user's repository it was taken from; its children's kept changes are refs
``refs/swarm/<swarm>/<agent>`` of the repository they landed in (a user's, or the cache).

:func:`sweep` removes them once the ledger forgot the swarm or agent
(:data:`~swarm.store.keys.LEDGER_TTL` after its last write) or the store the snapshot
(:data:`~swarm.store.keys.SNAPSHOT_TTL` after its last read); a shared checkout a view
still uses stays. Branches ``swarm/<agent>`` in a user's repository are the user's and
are never removed (``refs/heads/swarm/<agent>`` of the cache, made by earlier versions,
go with their agent). Workers run it at most every :data:`EVERY` seconds per host, in the
background (:func:`soon`); so does a root in a terminal, for its own ``SWARM_HOME``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from swarm.errors import WorkspaceError
from swarm.runtime import gitstate as g
from swarm.runtime import views
from swarm.store import keys

log = logging.getLogger(__name__)

#: Seconds between two sweeps of one host.
EVERY = 3600.0


@dataclass
class Swept:
    """What a sweep removed."""

    swarms: list[str] = field(default_factory=list)
    trees: list[str] = field(default_factory=list)
    refs: int = 0


def _exists(client: redis.Redis, names: list[str]) -> list[bool]:
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in pipe.execute()]


def _unmount_under(folder: Path) -> None:
    """Unmount views under ``folder`` (in this process's mount namespace)."""
    points: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as table:
        points = [line.split()[4] for line in table]
    inside = [p for p in points if Path(p).is_relative_to(folder.resolve())]
    for point in sorted(inside, key=len, reverse=True):
        views.unmount(Path(point))


def sweep(home: Path, client: redis.Redis, folders: tuple[Path, ...] = ()) -> Swept:
    """Remove from ``home`` (and from the repositories of ``folders``, users' workspaces)
    what swarms the ledger forgot and snapshots the store forgot left behind."""
    out = Swept()
    places = [home / "workspaces", home / "returned", home / "seeds" / "index"]
    ids = sorted({p.name for f in places if f.is_dir() for p in f.iterdir() if p.is_dir()})
    for swarm_id, known in zip(ids, _exists(client, [keys.swarm(i) for i in ids]),
                               strict=True):
        if known:
            continue
        for place in places:
            _unmount_under(place / swarm_id)
            shutil.rmtree(place / swarm_id, ignore_errors=True)
        out.swarms.append(swarm_id)
    trees = home / "seeds" / "trees"
    if trees.is_dir():
        used = {(v / "lower").read_text() for v in (home / "workspaces").glob("*/.views/*")
                if (v / "lower").is_file()}
        sids = [p.name for p in trees.iterdir() if p.is_dir() and not p.name.startswith(".")]
        for sid, known in zip(sids, _exists(client, [keys.snapshot(s) for s in sids]),
                              strict=True):
            if not known and str(trees / sid) not in used:
                shutil.rmtree(trees / sid, ignore_errors=True)
                with contextlib.suppress(OSError):
                    (trees / f"{sid}.index").unlink()
                out.trees.append(sid)
    repos = [(home / "seeds" / "cache.git", True)]
    for folder in folders:
        found = g.discover(folder)
        repos += [(found.repo, False)] if found is not None else []
    for repo, agents in repos:
        if (repo / "objects").is_dir():
            with contextlib.suppress(WorkspaceError):
                out.refs += _sweep_refs(repo, client, agents)
    return out


def _sweep_refs(repo: Path, client: redis.Redis, agents: bool) -> int:
    """Delete swarm refs of ``repo`` whose snapshot (or, with ``agents``, whose agent's
    record) is gone; then let git drop what nothing refers to any more."""
    if agents:  # a user's repository keeps its worktrees (a missing one may be unmounted)
        g.git("worktree", "prune", repo=repo)
    patterns = ["refs/swarm/"] + (["refs/heads/swarm/"] if agents else [])
    refs = g.git("for-each-ref", "--format=%(refname)", *patterns, repo=repo).split()
    refs = [r for r in refs if r.startswith("refs/heads/") or len(r.split("/")) == 4]
    owners = [keys.agent(r.rsplit("/", 1)[1]) if r.startswith("refs/heads/")
              else keys.snapshot(r.rsplit("/", 1)[1]) if r.split("/")[2] in ("snap", "local")
              else keys.swarm(r.split("/")[2])  # refs/swarm/<swarm>/<agent>: kept changes
              for r in refs]
    checked_out = {line.removeprefix("branch ").strip() for line in g.git(
        "worktree", "list", "--porcelain", repo=repo).splitlines() if line.startswith("branch ")}
    gone = [r for r, known in zip(refs, _exists(client, owners), strict=True)
            if not known and r not in checked_out]
    if not gone:
        return 0
    for ref in gone:
        g.git("update-ref", "-d", ref, repo=repo)
    if agents:  # the host's own cache: its unreferenced objects go too
        g.git("-c", "gc.auto=0", "gc", "--quiet", "--prune=2.hours.ago", repo=repo)
    return len(gone)


def soon(home: Path, client: redis.Redis, folders: tuple[Path, ...] = ()) -> bool:
    """Sweep ``home`` in a background thread unless it was swept less than :data:`EVERY`
    seconds ago (by any process of this host); True when one started."""
    stamp = home / "seeds" / "swept"
    try:
        if time.time() - stamp.stat().st_mtime < EVERY:
            return False
    except OSError:
        pass

    def run() -> None:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        with open(home / "seeds" / "sweep.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # another process of this host sweeps it
            stamp.touch()
            try:
                done = sweep(home, client, folders)
            except (OSError, redis.RedisError) as exc:
                log.warning("sweeping %s failed: %s", home, exc)
                return
            if done.swarms or done.trees or done.refs:
                log.info("swept %s: %d swarms, %d shared checkouts, %d refs", home,
                         len(done.swarms), len(done.trees), done.refs)

    threading.Thread(target=run, daemon=True, name="swarm-sweep").start()
    return True

