"""What swarms leave on a host goes once the ledger and the store forget them: children's
workspaces (their own repositories included) and the worker's indexes of them, files
kept aside, shared checkouts, refs in the host's cache and in the user's repository, the
children's kept changes among them (but never the user's own ``swarm/*`` branches)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import redis as redis_lib

from swarm.domain.session import Session
from swarm.store import keys
from swarm.store.ledger import Ledger
from swarm.store.snapshots import SnapshotStore
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming, sweep, views
from swarm.workspace.seed import Seeds

SWARM = "ssweeptest"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=cwd, capture_output=True, text=True, check=True).stdout


def refs(repo: Path) -> list[str]:
    return git(repo, "for-each-ref", "--format=%(refname)", "refs/swarm/",
               "refs/heads/swarm/").split()


def test_a_forgotten_swarm_leaves_nothing_behind(redis: redis_lib.Redis,
                                                  tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    (repo / "b.txt").write_text("uncommitted\n")
    Ledger(redis).create_swarm(SWARM, SWARM, str(repo), "task", {}, "laptop", "s")
    laptop = Seeds(SnapshotStore(redis), tmp_path / "home-a", "laptop", view="checkout")
    sid = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    git(repo, "branch", "swarm/a-user-merge-candidate")
    far = Seeds(SnapshotStore(redis), tmp_path / "home-b", "hostb", view="checkout")
    child = far.child(SWARM, "a1", sid)
    (child.path / "c.txt").write_text("child\n")
    delta = far.capture(child, SWARM)
    # Its work lands in the user's folder; its changes are kept under a ref there.
    session = Session(id="p", workspace=str(repo), messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0"}]},
        {"role": "tool", "tool_call_id": "c0", "content": json.dumps(
            {"agent_id": "a1", "delta": delta, "seed": sid})}], usage={}, created=0, updated=0)
    assert homecoming.bring_home(laptop, session, repo, SWARM, g.discover(repo))
    kept = f"refs/swarm/{SWARM}/a1"
    assert kept in refs(repo)
    home = tmp_path / "home-b"
    (home / "returned" / SWARM / "a1").mkdir(parents=True)
    tree, _ = views.shared_checkout(far.cache_for(sid), sid, home / "seeds" / "trees")
    cache = far.cache_for(sid)
    index = far.index_of(SWARM, "a1")
    assert index.is_file() and child.root is not None and (child.root / ".git").is_dir()
    before = refs(cache)
    assert any(r.startswith("refs/swarm/snap/") for r in before)
    redis.hset(keys.agent("a1"), "id", "a1")

    # Known to the ledger and the store: everything stays.
    done = sweep.sweep(home, redis)
    assert (done.swarms, done.refs) == ([], 0)
    assert (home / "workspaces" / SWARM / "a1").is_dir() and refs(cache) == before
    assert tree.is_dir() and index.is_file()
    users = refs(repo)
    assert sweep.sweep(tmp_path / "home-a", redis, (repo,)).refs == 0 and refs(repo) == users

    # Their TTLs ran out.
    for key in [*redis.scan_iter(keys.swarm(SWARM) + "*"), keys.agent("a1"),
                *redis.scan_iter(keys.snapshot("*"))]:
        redis.delete(key)
    done = sweep.sweep(home, redis)
    assert done.swarms == [SWARM]
    assert not (home / "workspaces" / SWARM).exists()
    assert not (home / "returned" / SWARM).exists()
    assert not (home / "seeds" / "index" / SWARM).exists()
    assert refs(cache) == [] and not tree.exists() and done.trees == [sid]
    done = sweep.sweep(tmp_path / "home-a", redis, (repo,))
    assert refs(repo) == ["refs/heads/swarm/a-user-merge-candidate"]  # the user's own


def test_a_sweep_runs_at_most_once_an_hour_per_host(redis: redis_lib.Redis,
                                                     tmp_path: Path) -> None:
    (tmp_path / "seeds").mkdir()
    (tmp_path / "seeds" / "swept").touch()
    assert not sweep.soon(tmp_path, redis)
    old = (tmp_path / "seeds" / "swept").stat().st_mtime - sweep.EVERY - 1
    os.utime(tmp_path / "seeds" / "swept", (old, old))
    assert sweep.soon(tmp_path, redis)
