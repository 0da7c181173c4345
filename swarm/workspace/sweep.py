"""Cleanup of what workspaces that travel leave on a host, bounded by the store's TTLs.

On a host (its ``SWARM_HOME``), a swarm leaves its children's workspaces
(``workspaces/<swarm>/``, views included), the worker's indexes of them
(``seeds/index/<swarm>/``) and the files of children started empty
(``returned/<swarm>/``); its snapshots leave shared checkouts (``seeds/trees/<id>``) and
refs in the host's cache and in a user's repository they were taken from
(``refs/swarm/snap/<id>``, ``refs/swarm/local/<id>``), and its children's changes refs
where they landed (``refs/swarm/<swarm>/<agent>``).

:func:`sweep` removes them once the ledger forgot the swarm or agent
(:data:`~swarm.store.keys.LEDGER_TTL` after its last write) or the store the snapshot
(:data:`~swarm.store.keys.SNAPSHOT_TTL` after its last read); a shared checkout a view
still uses stays. ``swarm land --clean`` removes kept changes at once. Workers run it
at most every :data:`EVERY` seconds per host, in the
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
from swarm.store import keys
from swarm.workspace import gitstate as g
from swarm.workspace import views

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
    repos = [(home / "seeds" / "cache.git", True),
             *((c, True) for c in sorted((home / "seeds" / "caches").glob("*.git")))]
    for folder in folders:
        found = g.discover(folder)
        repos += [(found.repo, False)] if found is not None else []
    for repo, agents in repos:
        if (repo / "objects").is_dir():
            with contextlib.suppress(WorkspaceError):
                out.refs += _sweep_refs(repo, client, agents)
    return out


def _sweep_refs(repo: Path, client: redis.Redis, cache: bool) -> int:
    """Delete swarm refs of ``repo`` whose snapshot or swarm the store forgot; then, in
    the host's own ``cache``, let git drop what nothing refers to any more."""
    refs = g.git("for-each-ref", "--format=%(refname)", "refs/swarm/", repo=repo).split()
    owners = [_owner(r) for r in refs]
    gone = [r for r, owner, known in zip(refs, owners, _exists(client, [
        o or keys.snapshot("-") for o in owners]), strict=True) if owner and not known]
    if not gone:
        return 0
    for ref in gone:
        g.git("update-ref", "-d", ref, repo=repo)
    if cache:
        g.git("-c", "gc.auto=0", "gc", "--quiet", "--prune=2.hours.ago", repo=repo)
    return len(gone)


def _owner(ref: str) -> str:
    """The store key whose end lets a swarm ref go: its snapshot's
    (``refs/swarm/snap|local/<id>``) or its swarm's (``refs/swarm/<swarm>/<agent>``, a
    child's changes kept by :mod:`swarm.workspace.homecoming`); "" for anything else."""
    parts = ref.split("/")
    if len(parts) != 4:
        return ""
    if parts[2] in ("snap", "local"):
        return keys.snapshot(parts[3])
    return keys.swarm(parts[2])


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

