"""A parked parent's workspace comes back on another host with its files as it saw them
(its earlier children's landings included), uncommitted over its seed in a repository of
its own; the children still out land in it there. What its commands did with its own git
(commits, staged changes) does not travel, and nothing of the user's history is shipped."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib

from swarm.domain.session import Session
from swarm.store.snapshots import SnapshotStore
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming, parked, views
from swarm.workspace.seed import Seeds, Workspace

SWARM = "sparktest"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=cwd, capture_output=True, text=True, check=True).stdout


def files_of(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(path).parts}


@pytest.fixture(params=["checkout", "auto"])
def view(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each test with full checkouts and with views (where they can be mounted); views
    left mounted are unmounted after it."""
    if request.param == "auto" and views.unavailable(tmp_path):
        pytest.skip(views.unavailable(tmp_path))
    try:
        yield request.param
    finally:
        with open("/proc/self/mountinfo") as table:
            points = [line.split()[4] for line in table]
        for point in sorted(points, key=len, reverse=True):
            if Path(point).is_relative_to(tmp_path.resolve()):
                views.unmount(Path(point))


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    (path / "README").write_text("base\n")
    (path / "tracked.txt").write_text("one\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "the user's first commit")
    return path


def work_in(ws: Workspace) -> None:
    """A parent's work in progress: a commit of its own (in its own repository), staged,
    unstaged, both, untracked."""
    (ws.path / "committed.txt").write_text("committed by the parent\n")
    git(ws.path, "add", "committed.txt")
    git(ws.path, "commit", "-qm", "the parent's own commit")
    (ws.path / "staged.txt").write_text("staged\n")
    git(ws.path, "add", "staged.txt")
    (ws.path / "tracked.txt").write_text("one\nunstaged\n")
    (ws.path / "both.txt").write_text("staged part\n")
    git(ws.path, "add", "both.txt")
    (ws.path / "both.txt").write_text("staged part\nunstaged part\n")
    (ws.path / "README").unlink()
    (ws.path / "untracked.txt").write_text("untracked\n")


def result_session(body: dict[str, object]) -> Session:
    return Session(id="p1", workspace="", messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0"}]},
        {"role": "tool", "tool_call_id": "c0", "content": json.dumps(body)}],
        usage={}, created=0, updated=0)


def seeds(redis: redis_lib.Redis, home: Path, host: str, view: str) -> Seeds:
    return Seeds(SnapshotStore(redis), home, host, view=view)


def earlier_child(redis: redis_lib.Redis, tmp_path: Path, host: Seeds, parent: Workspace,
                  view: str) -> None:
    """A child of the parent (run on a third host) whose work landed in it."""
    seed = host.take(parent.path, SWARM, base=parent.seed, own=parent)
    third = seeds(redis, tmp_path / "home-x", "hostx", view)
    child = third.child(SWARM, "c1", seed)
    (child.path / "from-c1.txt").write_text("c1\n")
    session = result_session({"agent_id": "c1", "state": "done",
                              "delta": third.capture(child, SWARM), "seed": seed})
    third.unmount(child)
    homecoming.bring_home(host, session, parent.path, SWARM, None, parent)
    assert json.loads(session.messages[-1]["content"])["landing"] == "landed"
    assert (parent.path / "from-c1.txt").read_text() == "c1\n"


#: The restored workspace's changes, all uncommitted over its seed (README, tracked.txt).
RESTORED_STATUS = [" D README", " M tracked.txt", "?? both.txt", "?? committed.txt",
                   "?? staged.txt", "?? untracked.txt"]


def test_a_parked_parent_comes_back_on_another_host_with_its_files_over_its_seed(
        redis: redis_lib.Redis, tmp_path: Path, view: str) -> None:
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop", view).take(repo, SWARM,
                                                                  tree_of=g.discover(repo))
    b = seeds(redis, tmp_path / "home-b", "hostb", view)
    parent = b.child(SWARM, "p1", sid)
    work_in(parent)
    earlier_child(redis, tmp_path, b, parent, view)
    # It parks: the snapshot for its new children is what it is restored from.
    new_seed = b.take(parent.path, SWARM, base=parent.seed, own=parent)
    state = parked.state(new_seed)
    assert state == new_seed
    assert SnapshotStore(redis).meta(state).base == sid  # type: ignore[union-attr]
    c = seeds(redis, tmp_path / "home-c", "hostc", view)
    back = parked.restore(c, SWARM, "p1", sid, state)
    assert files_of(back.path) == files_of(parent.path)
    assert (back.path / "both.txt").read_text() == "staged part\nunstaged part\n"
    assert (back.path / "from-c1.txt").read_text() == "c1\n"
    assert sorted(git(back.path, "status", "--porcelain").splitlines()) == \
        sorted([*RESTORED_STATUS, "?? from-c1.txt"])
    # A repository of its own on swarm/p1 at its seed: its own commit stayed behind.
    assert git(back.path, "rev-parse", "--abbrev-ref", "HEAD").strip() == "swarm/p1"
    assert git(back.path, "log", "--format=%s").splitlines() == ["swarm seed"]
    assert back.odb == c.cache_for(back.seed) and back.index == c.index_of(SWARM, "p1")
    # A child still out (seeded from new_seed) lands in the restored parent.
    host_g = seeds(redis, tmp_path / "home-g", "hostg", view)
    grandchild = host_g.child(SWARM, "g1", new_seed)
    (grandchild.path / "from-g1.txt").write_text("g1\n")
    (grandchild.path / "tracked.txt").write_text("one\nunstaged\nby g1\n")
    late = result_session({"agent_id": "g1", "state": "done",
                           "delta": host_g.capture(grandchild, SWARM), "seed": new_seed})
    landing = homecoming.bring_home(c, late, back.path, SWARM, None, back)
    assert landing is not None and landing.children == [("g1", "landed")]
    assert (back.path / "from-g1.txt").read_text() == "g1\n"
    assert (back.path / "tracked.txt").read_text() == "one\nunstaged\nby g1\n"
    assert (back.path / "from-c1.txt").read_text() == "c1\n"
    assert (back.path / "both.txt").read_text() == "staged part\nunstaged part\n"


def test_a_parent_in_the_users_repository_ships_none_of_its_history(
        redis: redis_lib.Redis, tmp_path: Path, view: str) -> None:
    repo = make_repo(tmp_path / "repo")
    first = git(repo, "rev-parse", "HEAD").strip()
    sid = seeds(redis, tmp_path / "home-a", "laptop", view).take(repo, SWARM,
                                                                  tree_of=g.discover(repo))
    near = seeds(redis, tmp_path / "home-w", "laptop", view)  # a worker on the laptop
    parent = near.child(SWARM, "p1", sid)
    # Its repository borrows the user's objects: its HEAD is over the user's history.
    assert parent.odb is not None and parent.odb.resolve() == (repo / ".git").resolve()
    assert git(parent.path, "rev-parse", "HEAD^").strip() == first
    work_in(parent)
    new_seed = near.take(parent.path, SWARM, base=parent.seed, own=parent)
    c = seeds(redis, tmp_path / "home-c", "hostc", view)
    back = parked.restore(c, SWARM, "p1", sid, parked.state(new_seed))
    assert files_of(back.path) == files_of(parent.path)
    assert sorted(git(back.path, "status", "--porcelain").splitlines()) == RESTORED_STATUS
    assert git(back.path, "log", "--format=%s").splitlines() == ["swarm seed"]
    missing = subprocess.run(["git", "cat-file", "-e", first], cwd=back.path)
    assert missing.returncode != 0  # the user's history stayed on the laptop
    # Nor did the parent's own commit leave the laptop's worker.
    own = git(parent.path, "rev-parse", "HEAD").strip()
    assert subprocess.run(["git", "cat-file", "-e", own], cwd=back.path).returncode != 0
