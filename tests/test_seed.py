"""Workspaces that travel, on real git and the real store: a snapshot holds what the parent
sees (and no secrets), a child on another host fetches it once, its work lands in the
parent's working tree (or, started empty, is kept as files at a path), a workspace is
restored elsewhere or fails loudly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import redis as redis_lib

from swarm.agent.folder import AgentFolder
from swarm.agent.probe import workspace_listing
from swarm.domain.records import AgentRecord
from swarm.domain.session import Session
from swarm.errors import SnapshotTooLarge, WorkspaceError, WorkspaceLost
from swarm.store import keys
from swarm.store.snapshots import SnapshotMeta, SnapshotStore
from swarm.workers.child import ChildRunner
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming, parked
from swarm.workspace.listing import listing
from swarm.workspace.seed import EMPTY, Seeds, folder_cache
from tests.helpers import wait_until

SWARM = "sseedtest"


def sh(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    sh(path, "init", "-q")
    (path / "committed.txt").write_text("base\n")
    (path / "staged.txt").write_text("old\n")
    (path / "unstaged.txt").write_text("old\n")
    (path / ".gitignore").write_text("build/\nsecret.txt\n")
    sh(path, "add", "-A")
    sh(path, "commit", "-qm", "base")
    (path / "staged.txt").write_text("staged change\n")
    sh(path, "add", "staged.txt")
    (path / "unstaged.txt").write_text("unstaged change\n")
    (path / "untracked.txt").write_text("untracked\n")
    (path / "build").mkdir()
    (path / "build" / "out.bin").write_text("ignored build output\n")
    (path / "secret.txt").write_text("gitignored secret\n")
    for name in (".env", ".env.local", "id_rsa", "server.pem", "tls.key", ".netrc"):
        (path / name).write_text(f"SECRET in {name}\n")
    return path


def seeds(redis: redis_lib.Redis, home: Path, host: str, view: str = "checkout",
          **caps: int) -> Seeds:
    """Full checkouts unless asked (a view is a mount in this process's namespace: a test
    that makes one unmounts it, see ``unmounted``)."""
    return Seeds(SnapshotStore(redis), home, host, view=view, **caps)


def files_of(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(path).parts}


def test_a_child_elsewhere_starts_with_uncommitted_and_untracked_files(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    status = sh(repo, "status", "--porcelain")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    assert sh(repo, "status", "--porcelain") == status  # the user's index is untouched
    far = seeds(redis, tmp_path / "home-b", "hostb")
    child = far.child(SWARM, "a1", sid)
    got = files_of(child.path)
    assert got["committed.txt"] == "base\n"
    assert got["staged.txt"] == "staged change\n"
    assert got["unstaged.txt"] == "unstaged change\n"
    assert got["untracked.txt"] == "untracked\n"
    # A repository of its own on swarm/a1 at the seed, borrowing the objects of the host's
    # cache of this folder's snapshots.
    assert child.root is not None and (child.root / ".git").is_dir()
    assert sh(child.path, "symbolic-ref", "HEAD").strip() == "refs/heads/swarm/a1"
    assert sh(child.path, "rev-parse", "HEAD").strip() == sid
    assert child.odb == far.cache_for(sid) != far.cache
    alternates = child.root / ".git" / "objects" / "info" / "alternates"
    assert Path(alternates.read_text().strip()) == (far.cache_for(sid) / "objects").resolve()
    assert sh(child.path, "status", "--porcelain") == ""  # its files are its HEAD's


def test_ignored_files_and_secrets_stay_home(redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / ".env.example").write_text("KEY=\n")
    (repo / ".swarmignore").write_text("!.env.example\nnotes/\n")
    (repo / "notes").mkdir()
    (repo / "notes" / "private.md").write_text("mine\n")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    child = seeds(redis, tmp_path / "home-b", "hostb").child(SWARM, "a1", sid)
    got = files_of(child.path)
    for name in ("secret.txt", "build/out.bin", ".env", ".env.local", "id_rsa", "server.pem",
                 "tls.key", ".netrc", "notes/private.md"):
        assert name not in got, name
    assert got[".env.example"] == "KEY=\n"  # let through by the .swarmignore negation
    raw = SnapshotStore(redis).get(sid)[1]
    assert b"SECRET in" not in raw and b"gitignored secret" not in raw


def test_a_plain_folder_is_seeded_without_ignored_files_or_secrets(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.log").write_text("line\n")
    (folder / ".gitignore").write_text("*.tmp\n")
    (folder / "x.tmp").write_text("scratch\n")
    (folder / ".env").write_text("TOKEN=1\n")
    (folder / "id_rsa").write_text("KEY\n")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(folder, SWARM)
    child = seeds(redis, tmp_path / "home-b", "hostb").child(SWARM, "a1", sid)
    assert files_of(child.path) == {"sub/a.log": "line\n", ".gitignore": "*.tmp\n"}
    assert not (folder / ".git").exists()  # the user's folder did not become a repository


def test_the_same_host_moves_no_bytes_and_another_host_fetches_once(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    sid = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    store = SnapshotStore(redis)
    size = store.meta(sid).size  # type: ignore[union-attr]
    near = seeds(redis, tmp_path / "home-w", "laptop").child(SWARM, "a1", sid)
    # Its own repository borrows the user's objects where they are: nothing copied.
    assert near.odb is not None and near.odb.resolve() == (repo / ".git").resolve()
    assert near.root is not None
    alternates = near.root / ".git" / "objects" / "info" / "alternates"
    assert Path(alternates.read_text().strip()) == (repo / ".git" / "objects").resolve()
    assert not (repo / ".git" / "worktrees").exists()  # no worktree of the user's
    assert (near.path / "untracked.txt").read_text() == "untracked\n"
    assert store.hosts(sid) == {"laptop": 0}
    far = seeds(redis, tmp_path / "home-b", "hostb")
    for i in range(5):
        far.child(SWARM, f"b{i}", sid)
    assert store.hosts(sid) == {"laptop": 0, "hostb": size}
    # The same workspace snapshotted again is the same snapshot, stored once.
    assert laptop.take(repo, SWARM, tree_of=g.discover(repo)) == sid
    assert int(redis.hget(keys.swarm_counters(SWARM), "snapshot_bytes")) == size


def test_a_snapshot_over_the_cap_is_refused_with_its_size_and_what_to_do(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "data.bin").write_bytes(b"x" * 5000)
    with pytest.raises(SnapshotTooLarge) as caught:
        seeds(redis, tmp_path / "home", "laptop", snapshot_max=1000).take(folder, SWARM)
    text = str(caught.value)
    assert "5.0 KB" in text and "1.0 KB" in text and "SWARM_SNAPSHOT_MAX" in text
    assert ".swarmignore" in text and "seed=false" in text
    assert not list(redis.scan_iter("swarm:snapshot:*"))
    with pytest.raises(SnapshotTooLarge) as caught:
        seeds(redis, tmp_path / "home", "laptop", swarm_max=100).take(folder, SWARM)
    assert "SWARM_SNAPSHOT_SWARM_MAX" in str(caught.value)


def test_a_snapshot_is_stored_in_chunks_once_and_counted_against_its_swarm_once(
        redis: redis_lib.Redis) -> None:
    swarm, sid = f"s{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    store = SnapshotStore(redis, chunk=7)
    data = bytes(range(256)) * 3  # binary, NUL bytes included
    meta = SnapshotMeta(sid, 0, 0, "", origin="hosta", odb="/odb", subdir="sub")
    assert store.put(meta, data, swarm, 0)
    assert not store.put(meta, data, swarm, 0)  # stored already: not counted twice
    got_meta, got = store.get(sid)
    assert got == data and got_meta.chunks == 110 and got_meta.subdir == "sub"
    assert store.hosts(sid) == {"hosta": 0}
    assert int(redis.hget(keys.swarm_counters(swarm), "snapshot_bytes")) == 768
    other = uuid.uuid4().hex
    with pytest.raises(SnapshotTooLarge) as caught:
        store.put(SnapshotMeta(other, 0, 0, ""), b"x" * 300, swarm, 1000)
    assert "768 B" in str(caught.value) and "SWARM_SNAPSHOT_SWARM_MAX" in str(caught.value)
    assert store.meta(other) is None
    assert int(redis.hget(keys.swarm_counters(swarm), "snapshot_bytes")) == 768


def result_session(workspace: Path, body: dict[str, object]) -> Session:
    return Session(id="p", workspace=str(workspace), messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0"}]},
        {"role": "tool", "tool_call_id": "c0", "content": json.dumps(body)}],
        usage={}, created=0, updated=0)


def test_a_childs_work_from_another_host_lands_uncommitted_in_the_parents_working_tree(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    index = sh(repo, "diff", "--cached", "--name-only")
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    sid = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    far = seeds(redis, tmp_path / "home-b", "hostb")
    child = far.child(SWARM, "a1", sid)
    (child.path / "new.txt").write_text("from the child\n")
    (child.path / "committed.txt").write_text("edited by the child\n")
    delta = far.capture(child, SWARM)
    assert SnapshotStore(redis).meta(delta).base == sid  # type: ignore[union-attr]
    session = result_session(repo, {"agent_id": "a1", "state": "done", "delta": delta,
                                    "seed": sid})
    landing = homecoming.bring_home(laptop, session, repo, SWARM, g.discover(repo))
    assert landing is not None and landing.children == [("a1", "landed")]
    body = json.loads(session.messages[-1]["content"])
    assert body["landing"] == "landed" and "delta" not in body and "git_branch" not in body
    assert body["kept"] == f"refs/swarm/{SWARM}/a1"
    assert (repo / "new.txt").read_text() == "from the child\n"
    assert (repo / "committed.txt").read_text() == "edited by the child\n"
    # The user's own uncommitted work is as it was, and so is their index.
    assert (repo / "untracked.txt").read_text() == "untracked\n"
    assert (repo / "unstaged.txt").read_text() == "unstaged change\n"
    assert sh(repo, "diff", "--cached", "--name-only") == index
    status = sh(repo, "status", "--porcelain")
    assert "?? new.txt" in status and " M committed.txt" in status
    # The child's changes stay retrievable from the user's folder with the command given.
    shown = subprocess.run(body["show"], shell=True, cwd=repo, capture_output=True, text=True,
                           check=True).stdout
    assert "+from the child" in shown
    assert sh(repo, "branch", "--list").split()[1:] in (["master"], ["main"])


def test_a_plain_folder_parent_gets_the_childs_new_and_deleted_files_in_place(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep\n")
    (folder / "gone.txt").write_text("gone\n")
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    sid = laptop.take(folder, SWARM)
    far = seeds(redis, tmp_path / "home-b", "hostb")
    child = far.child(SWARM, "a1", sid)
    (child.path / "made.txt").write_text("made\n")
    (child.path / "gone.txt").unlink()
    session = result_session(folder, {"agent_id": "a1", "delta": far.capture(child, SWARM),
                                      "seed": sid})
    homecoming.bring_home(laptop, session, folder, SWARM)
    body = json.loads(session.messages[-1]["content"])
    assert body["landing"] == "landed" and "files_at" not in body
    assert files_of(folder) == {"keep.txt": "keep\n", "made.txt": "made\n"}
    assert not (folder / ".git").exists()  # the user's folder did not become a repository


def test_a_child_started_empty_has_its_files_kept_at_a_path(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep\n")
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    far = seeds(redis, tmp_path / "home-b", "hostb")
    child = far.child(SWARM, "a1", "")  # seed=false: an empty folder
    (child.path / "made.txt").write_text("made\n")
    session = result_session(folder, {"agent_id": "a1", "delta": far.capture(child, SWARM),
                                      "seed": ""})
    homecoming.bring_home(laptop, session, folder, SWARM)
    body = json.loads(session.messages[-1]["content"])
    assert body["landing"] == "kept"
    at = Path(body["files_at"])
    assert at.is_relative_to(tmp_path / "home-a")
    assert files_of(at) == {"made.txt": "made\n"}
    assert files_of(folder) == {"keep.txt": "keep\n"}  # nothing landed in the folder


def test_children_started_empty_on_the_parents_host_land_with_nothing_fetched(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep\n")
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    bodies, deltas = [], []
    for i in range(3):
        child = laptop.child(SWARM, f"a{i}", "")  # seed=false, on the parent's host
        (child.path / "made.txt").write_text(f"made {i}\n")
        deltas.append(laptop.capture(child, SWARM))
        bodies.append({"agent_id": f"a{i}", "delta": deltas[-1], "seed": "",
                       "host": "laptop", "workspace": str(child.path)})
    parent = homecoming.parent_of(laptop, folder, None, None)
    landing = homecoming.land(laptop, parent, bodies, SWARM)
    assert landing.children == [(f"a{i}", "kept") for i in range(3)]
    for i, body in enumerate(bodies):
        assert Path(body["files_at"]) == tmp_path / "home-a" / "workspaces" / SWARM / f"a{i}"
        assert files_of(Path(body["files_at"])) == {"made.txt": f"made {i}\n"}
    # Their work was not unbundled from the store into the folder's cache: nothing fetched.
    assert all(SnapshotStore(redis).hosts(d) == {"laptop": 0} for d in deltas)
    assert not any(g.has(parent.odb, d) for d in deltas)
    assert files_of(folder) == {"keep.txt": "keep\n"}


def test_a_workspace_is_restored_on_another_host(redis: redis_lib.Redis,
                                                 tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    b = seeds(redis, tmp_path / "home-b", "hostb")
    parent = b.child(SWARM, "p1", sid)
    (parent.path / "mine.txt").write_text("parent's file\n")
    (parent.path / "untracked.txt").unlink()
    state = b.take(parent.path, SWARM, tree_of=parent.tree)  # as it parks
    c = seeds(redis, tmp_path / "home-c", "hostc")
    back = parked.restore(c, SWARM, "p1", sid, state)
    assert files_of(back.path) == files_of(parent.path)
    # Its changes are uncommitted over its seed, as they were.
    assert "mine.txt" in sh(back.path, "status", "--porcelain")
    assert sh(back.path, "rev-parse", "HEAD").strip() == sid


def test_a_workspace_that_cannot_be_restored_fails_loudly(redis: redis_lib.Redis,
                                                          tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    for key in redis.scan_iter("swarm:snapshot:*"):
        redis.delete(key)
    with pytest.raises(WorkspaceLost, match="could not be restored on hostc"):
        parked.restore(seeds(redis, tmp_path / "home-c", "hostc"), SWARM, "p1", sid, sid)
    assert not (tmp_path / "home-c" / "workspaces" / SWARM / "p1").exists()


def test_a_child_on_the_parents_host_lands_its_files_without_a_transfer(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep\n")
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    sid = laptop.take(folder, SWARM)
    worker = seeds(redis, tmp_path / "home-w", "laptop")  # another SWARM_HOME, same host
    child = worker.child(SWARM, "a1", sid)
    (child.path / "made.txt").write_text("made\n")
    delta = worker.capture(child, SWARM)
    session = result_session(folder, {"agent_id": "a1", "delta": delta, "seed": sid,
                                      "host": "laptop", "workspace": str(child.path)})
    homecoming.bring_home(laptop, session, folder, SWARM)
    body = json.loads(session.messages[-1]["content"])
    assert body["landing"] == "landed" and "files_at" not in body
    assert (folder / "made.txt").read_text() == "made\n"
    assert SnapshotStore(redis).hosts(delta) == {"laptop": 0}  # nobody fetched it


def test_a_capture_leaves_no_ref_where_it_is_made_and_lands_after_a_gc_took_it(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    sid = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    child = laptop.child(SWARM, "a1", sid)  # the parent's host: it borrows the user's repo
    assert child.odb == repo / ".git"
    (child.path / "new.txt").write_text("from the child\n")
    delta = laptop.capture(child, SWARM)
    refs = sh(repo, "for-each-ref", "--format=%(refname)")
    assert f"refs/swarm/snap/{sid}" in refs and delta not in refs
    # The user's gc prunes what no ref keeps: the capture is fetched from the store.
    sh(repo, "-c", "gc.reflogExpireUnreachable=now", "gc", "-q", "--prune=now")
    assert not g.has(repo / ".git", delta)
    session = result_session(repo, {"agent_id": "a1", "delta": delta, "seed": sid})
    landing = homecoming.bring_home(laptop, session, repo, SWARM, g.discover(repo))
    assert landing is not None and landing.children == [("a1", "landed")]
    assert (repo / "new.txt").read_text() == "from the child\n"


def test_a_capture_is_stored_as_git_writes_and_reads_it_for_a_child_started_empty_or_seeded(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """A whole snapshot is a pack and its index as git made them (a host writes both as they
    are: git must read them as its own); a delta is a bundle git verifies and fetches."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    far = seeds(redis, tmp_path / "home-b", "hostb")
    store = SnapshotStore(redis)
    for name, seed in (("empty", ""), ("seeded", sid)):
        child = far.child(SWARM, name, seed)
        (child.path / "out.txt").write_text(f"{name}\n")
        delta = far.capture(child, SWARM)
        other = tmp_path / f"other-{name}.git"
        sh(tmp_path, "init", "-q", "--bare", str(other))
        data = store.get(delta)[1]
        if seed:  # a delta: its base is there first
            g.unbundle(other, sid, store.get(sid)[1])
            bundle = tmp_path / f"{name}.bundle"
            bundle.write_bytes(data)
            sh(other, "bundle", "verify", "-q", str(bundle))
            assert sh(other, "bundle", "list-heads", str(bundle)).split() == \
                [delta, f"refs/swarm/snap/{delta}"]
            sh(other, "fetch", "-q", str(bundle), f"refs/swarm/snap/{delta}:refs/got")
        else:
            assert data.startswith(g.PACK_HEAD)
            g.unbundle(other, delta, data)
            packs = list((other / "objects" / "pack").glob("pack-*.idx"))
            assert len(packs) == 1
            sh(other, "verify-pack", str(packs[0]))
            sh(other, "update-ref", "refs/got", f"refs/swarm/snap/{delta}")
        got = sh(other, "ls-tree", "-r", "--name-only", "refs/got").split()
        assert "out.txt" in got and sh(other, "show", "refs/got:out.txt") == f"{name}\n"
        assert ("committed.txt" in got) == bool(seed)
        sh(other, "fsck", "--no-dangling")


def test_a_whole_snapshot_that_is_not_what_it_says_is_refused(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    data = SnapshotStore(redis).get(sid)[1]
    other = tmp_path / "other.git"
    sh(tmp_path, "init", "-q", "--bare", str(other))
    with pytest.raises(WorkspaceError, match="not what it says"):
        g.unbundle(other, "f" * 40, data)
    assert not g.has(other, sid)


def test_secrets_stay_out_of_captures_whatever_became_of_the_excludes_file(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    far = seeds(redis, tmp_path / "home-b", "hostb")

    def captured(agent: str, swarmignore: str = "") -> set[str]:
        child = far.child(SWARM, agent, "")
        for name in ("out.txt", ".env", "notes.txt"):
            (child.path / name).write_text(f"SECRET in {name}\n")
        if swarmignore:
            (child.path / ".swarmignore").write_text(swarmignore)
        delta = far.capture(child, SWARM)
        return set(g.git("ls-tree", "-r", "--name-only", delta, repo=far.cache).split())

    assert captured("a1") == {"out.txt", "notes.txt"}
    # Another folder's rules are its own, in the same process.
    assert captured("a2", "notes.txt\n") == {"out.txt", ".swarmignore"}
    assert captured("a3") == {"out.txt", "notes.txt"}
    # A tmp cleaner took this process's excludes files: they are written again.
    shutil.rmtree(g._scratch(os.getpid()))
    assert captured("a4") == {"out.txt", "notes.txt"}


def test_a_checkout_as_it_was_seeded_has_nothing_to_send_home(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    far = seeds(redis, tmp_path / "home-b", "hostb")
    child = far.child(SWARM, "a1", sid)
    before = listing(child.path)
    record = AgentRecord("a1", SWARM, seed=sid)
    # Nothing changed since the listing taken at its seed: known without a tree.
    assert ChildRunner._changed(child, far, before, record) == ([], True)
    # Changed since it parked elsewhere: the listing is not of its seed, so not exact.
    assert ChildRunner._changed(child, far, before, replace(record, ws_state="x")) == \
        ([], False)
    (child.path / "committed.txt").write_text("edited\n")
    assert ChildRunner._changed(child, far, before, record) == (["committed.txt"], True)


def big_repo(path: Path, files: int = 200, size: int = 10_000) -> Path:
    """A committed repository of ``files`` files of random text, ``size`` bytes each."""
    path.mkdir(parents=True)
    for i in range(files):
        (path / f"f{i:03d}.txt").write_text(os.urandom(size // 2).hex())
    sh(path, "init", "-q")
    sh(path, "add", "-A")
    sh(path, "commit", "-qm", "base")
    return path


def test_a_second_snapshot_after_a_one_file_edit_moves_only_that_change(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = big_repo(tmp_path / "repo")  # 2 MB
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    store = SnapshotStore(redis)
    first = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    far = seeds(redis, tmp_path / "home-b", "hostb")
    far.child(SWARM, "a1", first)
    assert store.hosts(first)["hostb"] > 1_000_000
    (repo / "f007.txt").write_text((repo / "f007.txt").read_text() + "one more line\n")
    (repo / "f008.txt").unlink()
    second = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    meta = store.meta(second)
    assert meta is not None and meta.base == first
    assert meta.size < 20_000  # stored as the change, not 2 MB again
    child = far.child(SWARM, "a2", second)
    assert store.hosts(second)["hostb"] == meta.size < 20_000  # and moved as it
    assert files_of(child.path) == files_of(repo)
    # A host that never held the first fetches both, and sees the second's files.
    fresh = seeds(redis, tmp_path / "home-c", "hostc").child(SWARM, "a3", second)
    assert files_of(fresh.path) == files_of(repo) and "f008.txt" not in files_of(fresh.path)


def test_a_hosts_cache_of_other_repositories_never_reaches_a_childs_workspace(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    mine, theirs = big_repo(tmp_path / "mine", 20, 100), big_repo(tmp_path / "theirs", 20, 100)
    (theirs / "their-secret-plan.txt").write_text("THEIR SECRET PLAN\n")
    far = seeds(redis, tmp_path / "home-b", "hostb")
    other = seeds(redis, tmp_path / "home-t", "their-laptop")
    far.child("swarm-t", "t1", other.take(theirs, "swarm-t", tree_of=g.discover(theirs)))
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    first = laptop.take(mine, SWARM, tree_of=g.discover(mine))
    assert files_of(far.child(SWARM, "a1", first).path) == files_of(mine)
    (mine / "f001.txt").write_text("edited\n")
    second = laptop.take(mine, SWARM, tree_of=g.discover(mine))
    child = far.child(SWARM, "a2", second)
    assert files_of(child.path) == files_of(mine)
    # Nor through its git: its repository borrows the objects of its own folder's
    # snapshots only, not of every snapshot this host fetched.
    secret = sh(theirs, "hash-object", "their-secret-plan.txt").strip()
    found = subprocess.run(["git", "cat-file", "-e", secret], cwd=child.path, check=False)
    assert found.returncode != 0
    everything = sh(child.path, "cat-file", "--batch-all-objects", "--batch-check")
    assert secret not in everything and len(everything.splitlines()) > 20


def test_a_seeds_preface_is_what_the_prompt_reads_of_its_files_once_there(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "AGENTS.md").write_text("Be brief.\n")
    (repo / ".swarm").mkdir()
    (repo / ".swarm" / "instructions.md").write_text("Test first.\n")
    (repo / "lib").mkdir()
    (repo / "lib" / "a.py").write_text("x = 1\n")
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    sid = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    planned = seeds(redis, tmp_path / "home-b", "hostb").plan(SWARM, "a1", sid)
    assert planned.preface is not None and not planned.workspace.path.exists()
    child = seeds(redis, tmp_path / "home-b", "hostb").make(planned)
    assert planned.preface == (workspace_listing(child.path),
                               AgentFolder(child.path).instructions())
    assert "Be brief." in planned.preface[1] and "lib/" in planned.preface[0]
    # Skills or typed tools are more than a preface holds: its children wait for files.
    (repo / ".swarm" / "skills").mkdir()
    (repo / ".swarm" / "skills" / "s.md").write_text("a skill\n")
    again = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    assert seeds(redis, tmp_path / "home-b", "hostb").plan(SWARM, "a2", again).preface is None


def test_a_plain_folders_children_on_its_host_reach_no_other_folders_files(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    for folder, text in ((theirs, "THEIR SECRET PLAN\n"), (mine, "mine\n")):
        folder.mkdir()
        (folder / "notes.txt").write_text(text)
    laptop = seeds(redis, tmp_path / "home-a", "laptop")
    laptop.take(theirs, "swarm-t")
    child = laptop.child(SWARM, "a1", laptop.take(mine, SWARM))
    assert files_of(child.path) == {"notes.txt": "mine\n"}
    secret = subprocess.run(["git", "hash-object", "--stdin"], input="THEIR SECRET PLAN\n",
                            capture_output=True, text=True, check=True).stdout.strip()
    found = subprocess.run(["git", "cat-file", "-e", secret], cwd=child.path, check=False)
    assert found.returncode != 0  # its repository borrows its own folder's objects only


def test_an_empty_folder_is_taken_as_empty_without_a_repository_made_for_it(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """A root in a new, empty folder fans out with no git process: its children start
    empty (a cache made for nothing cost a `git init` at every such fan-out)."""
    folder = tmp_path / "new"
    folder.mkdir()
    home = tmp_path / "home"
    assert seeds(redis, home, "laptop").take(folder, SWARM) == EMPTY
    assert not (home / "seeds" / "caches").exists()


def test_children_with_nothing_to_land_make_no_cache_for_a_new_plain_folder(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """Results with no changes, or files left in the child's own folder on this host,
    read nothing of the parent's folder: landing them makes it no cache repository."""
    folder = tmp_path / "new"
    folder.mkdir()
    home = tmp_path / "home"
    laptop = seeds(redis, home, "laptop")
    child = laptop.child(SWARM, "a1", "")  # seed=false, on the parent's host
    (child.path / "made.txt").write_text("made\n")
    delta = laptop.capture(child, SWARM)
    body = {"agent_id": "a1", "state": "done", "delta": delta, "seed": "", "host": "laptop",
            "workspace": str(child.path)}
    none = {"agent_id": "a2", "state": "done", "changes": "none: it changed no file"}
    session = Session(id="s", workspace=str(folder), messages=[
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": c, "type": "function", "function": {"name": "agent", "arguments": "{}"}}
            for c in ("c1", "c2")]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps(body)},
        {"role": "tool", "tool_call_id": "c2", "content": json.dumps(none)}],
        usage={}, created=0, updated=0)
    landing = homecoming.bring_home(laptop, session, folder, SWARM)
    assert landing is not None and landing.children == [("a1", "kept"), ("a2", "no changes")]
    assert json.loads(session.messages[1]["content"])["files_at"] == str(child.path)
    assert not folder_cache(home, folder).exists()


def test_a_childs_own_repository_is_the_one_git_init_makes_on_its_seed(tmp_path: Path) -> None:
    """Written without a git process (one a child at width): git reads it as its own."""
    repo = make_repo(tmp_path / "repo")
    start = sh(repo, "rev-parse", "HEAD").strip()
    child = tmp_path / "child"
    dot = g.own_repository(child, repo / ".git", "swarm/c1", start)
    made = tmp_path / "made"
    sh(tmp_path, "init", "-q", "--template=", str(made))

    def listing(top: Path) -> set[str]:
        return {str(p.relative_to(top)) for p in top.rglob("*")}

    assert listing(dot) - listing(made / ".git") == \
        {"objects/info/alternates", "refs/heads/swarm", "refs/heads/swarm/c1"}
    assert listing(made / ".git") <= listing(dot)
    assert sh(child, "config", "--local", "--list") == sh(made, "config", "--local", "--list")
    assert sh(child, "rev-parse", "--abbrev-ref", "HEAD").strip() == "swarm/c1"
    sh(child, "read-tree", "--reset", "-u", "HEAD")
    assert (child / "committed.txt").read_text() == "base\n"
    assert sh(child, "status", "--porcelain") == ""
    sh(child, "fsck", "--no-dangling")


def test_a_hosts_threads_asking_for_one_seed_at_once_look_for_it_once_and_fetch_it_once(
        redis: redis_lib.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide fan-out's children on one worker wait for the one that fetches, instead of
    each starting a git process to look, then queueing on the host's lock."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    far = seeds(redis, tmp_path / "home-b", "hostb")
    into = far.cache_for(sid)
    looked: list[str] = []
    has = g.has
    monkeypatch.setattr(g, "has", lambda r, s: looked.append(s) or has(r, s))
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(far.fetch(sid, into)))
               for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(got)[:-1] == [0] * 19 and got.count(0) == 19  # one fetched
    assert len(looked) <= 2, looked
    assert g.has(into, sid)


@pytest.mark.parametrize("object_format", ["sha1", "sha256"])
def test_a_commit_is_git_commit_trees_own_written_without_a_git_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, object_format: str) -> None:
    # commit-tree was one of a capture's git processes (~1-2 ms of CPU each).
    repo = tmp_path / "r.git"
    sh(tmp_path, "init", "-q", "--bare", f"--object-format={object_format}", str(repo))
    env = {**os.environ, "GIT_DIR": str(repo), **g.IDENT}
    tree = subprocess.run(["git", "mktree"], input="", env=env, capture_output=True, text=True,
                          check=True).stdout.strip()

    def by_git(*parents: str) -> str:
        args = [x for p in parents for x in ("-p", p)]
        return subprocess.run(["git", "commit-tree", tree, *args, "-m", "swarm: a child's work"],
                              env=env, capture_output=True, text=True, check=True).stdout.strip()

    first, second = by_git(), by_git(by_git())
    shutil.rmtree(repo / "objects" / first[:2])
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert g.commit(repo, tree, [], "swarm: a child's work") == first
    assert g.commit(repo, tree, [first], "swarm: a child's work") == second
    assert g.commit(repo, tree, [first, second], "m") != second
    monkeypatch.undo()
    assert subprocess.run(["git", "fsck", "--strict", "--no-dangling"], env=env,
                          capture_output=True, text=True).returncode == 0
    assert not list((repo / "objects" / first[:2]).glob("tmp_obj_*"))


def test_a_commit_in_a_shared_repository_gets_the_groups_permissions(tmp_path: Path) -> None:
    repo = tmp_path / "shared.git"
    sh(tmp_path, "init", "-q", "--bare", "--shared=group", str(repo))
    tree = subprocess.run(["git", "mktree"], input="", capture_output=True, text=True,
                          env={**os.environ, "GIT_DIR": str(repo)}, check=True).stdout.strip()
    sid = g.commit(repo, tree, [], "swarm: a child's work")
    assert (repo / "objects" / sid[:2]).stat().st_mode & 0o2070 == 0o2070  # as git makes it


def test_a_whole_snapshot_is_one_pack_whatever_the_repository_says_of_pack_sizes(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    sh(repo, "config", "pack.packSizeLimit", "1m")
    for i in range(3):  # 3 MB that compress to nothing less
        (repo / f"big{i}.bin").write_bytes(os.urandom(1 << 20))
    sh(repo, "add", "-A")
    sh(repo, "commit", "-qm", "big")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    child = seeds(redis, tmp_path / "home-b", "hostb").child(SWARM, "a1", sid)
    assert (child.path / "big2.bin").read_bytes() == (repo / "big2.bin").read_bytes()


def test_a_whole_snapshot_git_cannot_read_leaves_nothing_in_the_repository(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """Its pack and index are removed again, so a later fetch writes them anew."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    data = SnapshotStore(redis).get(sid)[1]
    end = data.index(b"\n", len(g.PACK_HEAD))
    size = int(data[len(g.PACK_HEAD):end].split()[2])
    broken = data[:end + 1] + bytes(size) + data[end + 1 + size:]  # an index of zeros
    other = tmp_path / "other.git"
    sh(tmp_path, "init", "-q", "--bare", str(other))
    with pytest.raises(WorkspaceError, match="could not be put"):
        g.unbundle(other, sid, broken)
    assert list((other / "objects" / "pack").iterdir()) == []
    g.unbundle(other, sid, data)
    assert g.has(other, sid)


def test_a_whole_snapshot_is_taken_of_a_repository_on_another_file_system_than_tmp(
        redis: redis_lib.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """git writes a pack in its repository and renames it to where it is asked to: not a
    temporary folder on another file system (a /tmp on tmpfs, a repository on disk),
    where the rename fails (EXDEV) and the fan-out with it."""
    elsewhere = Path("/dev/shm")
    if not elsewhere.is_dir() or elsewhere.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system for the temporary folder (/dev/shm)")
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    child = seeds(redis, tmp_path / "home-b", "hostb").child(SWARM, "a1", sid)
    assert (child.path / "committed.txt").read_text() == "base\n"
    assert list((repo / ".git" / "objects" / "pack").glob("*swarm*")) == []  # nothing left


def test_a_whole_snapshots_pack_swapped_for_a_link_in_the_repository_is_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack is written in the repository, which a box of the root's writes: a command
    there that swaps the index git wrote for a link to a file only the user can read (a
    key) gets an error, not that file stored with the snapshot."""
    repo = make_repo(tmp_path / "repo")
    secret = tmp_path / "id_key"
    secret.write_text("PRIVATE-KEY-BYTES\n")
    made = g._pack_objects

    def swapped(repo_: Path, args: list[str], revs: str, cwd: Path | None = None) -> bytes:
        names = made(repo_, args, revs, cwd)
        index = Path(args[0] + f"-{names.decode().split()[0]}.idx")
        index.unlink()
        index.symlink_to(secret)
        return names

    monkeypatch.setattr(g, "_pack_objects", swapped)
    sha = g.commit(repo / ".git", g.write_tree(g.discover(repo)), [], "swarm seed")
    with pytest.raises(WorkspaceError, match="cannot be read"):
        assert b"PRIVATE-KEY-BYTES" not in g.bundle(repo / ".git", sha)


def test_a_swarm_kept_index_reads_no_file_again_for_a_changed_ctime_alone(
        tmp_path: Path) -> None:
    """The host changes the ctime of a shared checkout's files without changing them (ACL
    entries, the links of the next snapshot's checkout): a capture through an index swarm
    keeps does not read them all again for it, and still sees a file that changed. Read
    from the files' access times (a read after a change of ctime moves it: relatime)."""
    top, odb, index = tmp_path / "ws", g.ensure_bare(tmp_path / "odb.git"), tmp_path / "index"
    top.mkdir()
    files = [top / f"f{i}.txt" for i in range(20)]
    for i, path in enumerate(files):
        path.write_text(f"file {i}\n")
        past = path.stat().st_mtime - 60  # not "racily clean", which git reads again anyway
        os.utime(path, (past, past))
    first = g.write_tree(top, odb=odb, index=index)
    made = int(time.time())  # git compares times in whole seconds: the change comes later
    wait_until(lambda: int(time.time()) > made, "the next second", timeout=5)
    for path in files:  # the access time put back: its ctime changes, nothing else
        os.utime(path, (path.stat().st_mtime - 30, path.stat().st_mtime))
    read_before = [path.stat().st_atime_ns for path in files]
    assert g.write_tree(top, odb=odb, index=index) == first
    assert [path.stat().st_atime_ns for path in files] == read_before, "files read again"
    files[5].write_text("changed\n")
    assert g.write_tree(top, odb=odb, index=index) != first
