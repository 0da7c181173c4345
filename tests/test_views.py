"""Copy-on-write workspaces: children of one snapshot on a host share one read-only
checkout, each through its own overlayfs view; a child's writes never reach another
child or the shared checkout, and what it changed is read from its upper folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib

from swarm.agent import grants, sandbox
from swarm.agent.sandbox import UID
from swarm.agent.shell import LocalEnvironment
from swarm.store.snapshots import SnapshotStore
from swarm.workspace import gitstate as g
from swarm.workspace import views
from swarm.workspace.seed import Seeds, upper
from tests.helpers import wait_until

SWARM = "sviewtest"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=cwd, capture_output=True, text=True, check=True).stdout


def mounts_under(folder: Path) -> list[str]:
    with open("/proc/self/mountinfo") as table:
        points = [line.split()[4] for line in table]
    return [p for p in points if Path(p).is_relative_to(folder.resolve())]


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A SWARM_HOME where views can be mounted (skipped, with the reason, where not); every
    view left mounted under it is unmounted after the test."""
    reason = views.unavailable(tmp_path)
    if reason:
        pytest.skip(reason)
    try:
        yield tmp_path
    finally:
        for point in sorted(mounts_under(tmp_path), key=len, reverse=True):
            views.unmount(Path(point))


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    for i in range(30):
        (path / f"d{i % 3}").mkdir(exist_ok=True)
        (path / f"d{i % 3}" / f"f{i}.txt").write_text(f"file {i}\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "base")
    (path / "untracked.txt").write_text("untracked\n")
    return path


def seeds(redis: redis_lib.Redis, home: Path, host: str) -> Seeds:
    return Seeds(SnapshotStore(redis), home, host, view="auto")


def test_children_share_one_checkout_and_never_see_each_others_writes(
        redis: redis_lib.Redis, home: Path) -> None:
    repo = make_repo(home / "repo")
    sid = seeds(redis, home / "laptop", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    host = seeds(redis, home / "host-b", "hostb")
    one, two = host.child(SWARM, "a1", sid), host.child(SWARM, "a2", sid)
    assert one.view is not None and two.view is not None
    lower = Path((one.view / "lower").read_text())
    assert lower == Path((two.view / "lower").read_text())
    assert lower.is_relative_to(home / "host-b" / "seeds" / "trees")
    # The copied index matches the shared files: git sees nothing to re-read.
    assert git(one.path, "diff-files", "--name-only") == ""
    assert git(one.path, "status", "--porcelain") == ""
    (one.path / "d0" / "f0.txt").write_text("changed by a1\n")
    with open(one.path / "d1" / "f1.txt", "a") as handle:
        handle.write("appended by a1\n")
    (one.path / "untracked.txt").unlink()
    (one.path / "new.txt").write_text("new\n")
    os.utime(one.path / "d2" / "f2.txt")  # copied up, its content unchanged
    os.utime(one.path / "d2" / "f5.txt", ns=(os.stat(lower / "d2" / "f5.txt").st_atime_ns,
                                              os.stat(lower / "d2" / "f5.txt").st_mtime_ns))
    assert (two.path / "d0" / "f0.txt").read_text() == "file 0\n"
    assert (two.path / "d1" / "f1.txt").read_text() == "file 1\n"
    assert (two.path / "untracked.txt").read_text() == "untracked\n"
    assert not (two.path / "new.txt").exists()
    assert (lower / "d0" / "f0.txt").read_text() == "file 0\n"
    assert (lower / "untracked.txt").is_file() and not (lower / "new.txt").exists()
    assert host.changed(two, 100) == []
    assert host.changed(one, 100) == ["d0/f0.txt", "d1/f1.txt", "d2/f2.txt", "new.txt",
                                      "untracked.txt"]
    assert host.capture(two, SWARM) == ""
    delta = host.capture(one, SWARM)
    changed = git(repo, "--git-dir", str(host.cache_for(sid)), "diff", "--name-only", sid,
                  delta)
    assert changed.split() == ["d0/f0.txt", "d1/f1.txt", "new.txt", "untracked.txt"]



@pytest.mark.parametrize("box_uid", [None, UID], ids=["user", "root"])
def test_a_delta_snapshots_checkout_links_its_bases_unchanged_files(
        tmp_path: Path, box_uid: int | None) -> None:
    """A host that checked the previous snapshot out writes only what changed for the next
    (a delta over it): its other files are links to the previous checkout's, which keeps
    its own contents; the new index is clean against the new files."""
    if box_uid is not None and os.geteuid() != 0:
        pytest.skip("ACL entries for another uid need root")
    repo = make_repo(tmp_path / "repo")
    (repo / "d0" / "link").symlink_to("f0.txt")
    (repo / "to-d1").symlink_to("d1")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "links")
    first = git(repo, "rev-parse", "HEAD").strip()
    (repo / "d1" / "f1.txt").write_text("changed\n")
    (repo / "d2" / "f2.txt").unlink()
    (repo / "d3").mkdir()
    (repo / "d3" / "new.txt").write_text("new\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "edit")
    second = git(repo, "rev-parse", "HEAD").strip()
    trees, odb = tmp_path / "trees", repo / ".git"
    old, _ = views.shared_checkout(odb, first, trees, box_uid)
    made = int(time.time())  # git compares times in whole seconds: the links come later
    wait_until(lambda: int(time.time()) > made, "the next second", timeout=5)
    new, index = views.shared_checkout(odb, second, trees, box_uid, base=first)
    assert (new / "d0" / "f0.txt").stat().st_ino == (old / "d0" / "f0.txt").stat().st_ino
    assert os.readlink(new / "d0" / "link") == "f0.txt" and os.readlink(new / "to-d1") == "d1"
    assert (new / "d1" / "f1.txt").read_text() == "changed\n"
    assert (old / "d1" / "f1.txt").read_text() == "file 1\n"  # the base's, untouched
    assert not (new / "d2" / "f2.txt").exists() and (old / "d2" / "f2.txt").exists()
    assert (new / "d3" / "new.txt").read_text() == "new\n"
    env = {**os.environ, "GIT_DIR": str(odb), "GIT_WORK_TREE": str(new),
           "GIT_INDEX_FILE": str(index)}
    # Clean as swarm reads it (the links changed the files' ctime, not the files).
    assert subprocess.run(["git", *g.UNTRUSTED_CTIME, "diff-files", "--quiet"], cwd=new,
                          env=env).returncode == 0
    assert subprocess.run(["git", "write-tree"], cwd=new, env=env, capture_output=True,
                          text=True).stdout.strip() == git(repo, "rev-parse", "HEAD^{tree}").strip()
    if box_uid is not None:  # the new file and folder are the box's to write, as the others
        for path in (new / "d3", new / "d3" / "new.txt", new / "d0" / "f0.txt"):
            entries = grants.decode(os.getxattr(path, grants.ACCESS))
            assert any(tag == grants.USER and uid == box_uid and perm & 6 == 6
                       for tag, perm, uid in entries), (path, entries)



def _two_snapshots(tmp_path: Path) -> tuple[Path, str, str]:
    """A repository with a snapshot and a second one that changes ``d1/f1.txt``."""
    repo = make_repo(tmp_path / "repo")
    first = git(repo, "rev-parse", "HEAD").strip()
    (repo / "d1" / "f1.txt").write_text("changed\n")
    git(repo, "commit", "-qam", "edit")
    return repo, first, git(repo, "rev-parse", "HEAD").strip()


def _next_second() -> None:
    made = int(time.time())  # git compares times in whole seconds
    wait_until(lambda: int(time.time()) > made, "the next second", timeout=5)


def test_changes_land_in_a_checkout_linked_from_another(tmp_path: Path) -> None:
    """A parent working in a view of a linked checkout (its files' ctime changed by the
    links after its index recorded them) gets its children's changes written: git's
    two-tree merge took every linked file for one changed since and refused."""
    from swarm.workspace.homecoming import write_changes

    repo, first, second = _two_snapshots(tmp_path)
    trees, odb = tmp_path / "trees", repo / ".git"
    views.shared_checkout(odb, first, trees)
    _next_second()
    top, shared = views.shared_checkout(odb, second, trees, base=first)
    index, keep = tmp_path / "index", tmp_path / "keep"
    shutil.copy2(shared, index)
    old = g.write_tree(top, odb=odb, index=index, keep=keep)
    (repo / "d0" / "f0.txt").write_text("from a child\n")  # a linked file, changed
    git(repo, "commit", "-qam", "child")
    write_changes(odb, top, old, git(repo, "rev-parse", "HEAD^{tree}").strip(), keep,
                  trust_ctime=False)
    assert (top / "d0" / "f0.txt").read_text() == "from a child\n"
    assert (trees / first / "d0" / "f0.txt").read_text() == "file 0\n"  # the base's kept


def test_a_linked_checkout_whose_base_lost_files_meanwhile_is_written_whole(
        tmp_path: Path) -> None:
    """The sweep removes a forgotten snapshot's checkout without the lock: files gone from
    the base while the next one links them must not be missing from the next one."""
    repo, first, second = _two_snapshots(tmp_path)
    trees, odb = tmp_path / "trees", repo / ".git"
    views.shared_checkout(odb, first, trees)
    shutil.rmtree(trees / first / "d2")
    new, _ = views.shared_checkout(odb, second, trees, base=first)
    assert sorted(p.name for p in (new / "d2").iterdir()) == \
        sorted(f"f{i}.txt" for i in range(2, 30, 3))
    assert (new / "d0" / "f0.txt").stat().st_ino != (trees / first / "d0" / "f0.txt").stat().st_ino


def test_a_linked_checkout_is_not_granted_to_another_box_uid(tmp_path: Path) -> None:
    """A linked file keeps the ACL entries of the checkout it came from, and no grant
    reaches a file with another link: such a checkout refuses a box uid it was not made
    for (the child gets a full checkout), instead of saying it is granted."""
    if os.geteuid() != 0:
        pytest.skip("ACL entries for another uid need root")
    repo, first, second = _two_snapshots(tmp_path)
    trees, odb = tmp_path / "trees", repo / ".git"
    views.shared_checkout(odb, first, trees)
    views.shared_checkout(odb, second, trees, base=first)
    with pytest.raises(OSError, match="made for another sandbox uid"):
        views.shared_checkout(odb, second, trees, UID)
    assert not (trees / f"{second}.uid-{UID}").exists()

def test_a_shared_checkouts_index_is_newer_than_every_file_it_holds(tmp_path: Path) -> None:
    """git tells a file's age in whole seconds: an entry as new as its index is "racily
    clean", and every git using a copy of the index (each child's capture) read the file
    again (a 50 MB checkout, ~110 ms a capture). The host's checkout leaves none."""
    repo = make_repo(tmp_path / "repo")
    sid = git(repo, "rev-parse", "HEAD").strip()
    _, index = views.shared_checkout(repo / ".git", sid, tmp_path / "trees")
    out = subprocess.run(["git", "ls-files", "--debug"], capture_output=True, text=True,
                         check=True, env={**os.environ, "GIT_DIR": str(repo / ".git"),
                                          "GIT_INDEX_FILE": str(index)}).stdout
    seconds = [int(line.split()[1].split(":")[0]) for line in out.splitlines()
               if line.strip().startswith("mtime:")]
    assert len(seconds) == 30 and max(seconds) < int(index.stat().st_mtime), seconds

def test_an_unmounted_view_is_mounted_again_with_its_changes(
        redis: redis_lib.Redis, home: Path) -> None:
    repo = make_repo(home / "repo")
    sid = seeds(redis, home / "laptop", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    host = seeds(redis, home / "host-b", "hostb")
    child = host.child(SWARM, "a1", sid)
    (child.path / "mine.txt").write_text("kept\n")
    host.unmount(child)  # the run ended (parked)
    assert not views.mounted(child.path) and not any(child.path.iterdir())
    again = host.found(child.path, SWARM, "a1", sid)  # its next run, maybe another process
    assert again.view == child.view and views.mounted(again.path)
    assert (again.path / "mine.txt").read_text() == "kept\n"
    assert git(again.path, "status", "--porcelain") == "?? mine.txt\n"
    assert git(again.path, "symbolic-ref", "HEAD") == "refs/heads/swarm/a1\n"
    # The worker reads it through the same repository and its own index as before.
    assert again.odb == child.odb == host.cache_for(sid) and again.index == child.index


def test_a_child_on_the_parents_host_gets_a_view_borrowing_the_users_objects(
        redis: redis_lib.Redis, home: Path) -> None:
    repo = make_repo(home / "repo")
    laptop = seeds(redis, home / "laptop", "laptop")
    sid = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    near = seeds(redis, home / "worker", "laptop").child(SWARM, "a1", sid)
    assert near.view is not None
    assert near.odb is not None and near.odb.resolve() == (repo / ".git").resolve()
    assert SnapshotStore(redis).hosts(sid) == {"laptop": 0}  # no transfer
    (near.path / "child.txt").write_text("child\n")
    git(near.path, "add", "-A")
    git(near.path, "commit", "-qm", "child")
    # Its commit is in its own repository, never in the user's (objects or refs).
    head = git(near.path, "rev-parse", "HEAD").strip()
    assert git(near.path, "show", "swarm/a1:child.txt") == "child\n"
    assert subprocess.run(["git", "cat-file", "-e", head], cwd=repo).returncode != 0
    assert "swarm/a1" not in git(repo, "branch", "--list")
    assert not (repo / ".git" / "worktrees").exists()
    assert not (repo / "child.txt").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not sandbox.probe().ok,
                    reason="a root worker's box (as its sandbox uid) is needed")
def test_a_root_workers_box_writes_a_view_without_copying_its_files_up(
        redis: redis_lib.Redis, home: Path) -> None:
    """The sandbox uid's ACL entries are set on the shared checkout once, before its index
    is refreshed: granting them through each view copied every file into each child's
    upper folder (2.4 s a child for 50 MB; each command turn of 50 children 73 s)."""
    repo = make_repo(home / "repo")
    sid = seeds(redis, home / "laptop", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    host = Seeds(SnapshotStore(redis), home / "host-b", "hostb", view="auto", box_uid=UID)
    child = host.child(SWARM, "a1", sid)
    assert child.view is not None
    top = upper(child.view)
    # The shared index still matches the files' stat data: nothing is hashed again.
    assert git(child.path, "diff-files", "--name-only") == ""
    assert child.odb is not None
    # As the worker starts it: the objects its repository borrows are shown read-only.
    env = LocalEnvironment(child.path, sandbox="bwrap", linked=top,
                           read_only=(child.odb / "objects",))
    result = env.execute("id -u && echo more >> d0/f0.txt && echo new > d1/new.txt "
                         "&& git status --porcelain", 10)
    assert result.output.split("\n")[:3] == [str(UID), " M d0/f0.txt", "?? d1/new.txt"], \
        result.output
    copied = sorted(str(p.relative_to(top)) for p in top.rglob("*")
                    if p.is_file() and p.relative_to(top).parts[0] != ".git")
    assert copied == ["d0/f0.txt", "d1/new.txt"]
    lower = Path((child.view / "lower").read_text())
    assert (lower / "d0" / "f0.txt").read_text() == "file 0\n"


@pytest.mark.skipif(os.geteuid() != 0 or not sandbox.probe().ok,
                    reason="a root worker's box (as its sandbox uid) is needed")
def test_git_status_in_a_root_workers_box_leaves_the_index_clean_for_the_worker(
        redis: redis_lib.Redis, home: Path) -> None:
    """In the box the worker's files show another uid and inode: git's default stat check
    there found every file changed and wrote the box's stat data into the index, and each
    capture by the worker then hashed the whole checkout again."""
    repo = make_repo(home / "repo")
    sid = seeds(redis, home / "laptop", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    host = Seeds(SnapshotStore(redis), home / "host-b", "hostb", view="auto", box_uid=UID)
    child = host.child(SWARM, "a1", sid)
    assert child.view is not None and child.odb is not None and child.index is not None
    env = LocalEnvironment(child.path, sandbox="bwrap", linked=upper(child.view),
                           read_only=(child.odb / "objects",))
    result = env.execute("git status --porcelain && echo more >> d0/f0.txt && "
                         "git status --porcelain", 10)
    assert result.output.strip() == "M d0/f0.txt", result.output
    # The worker's own index (which no command writes) still matches the stat data of
    # every file the box did not change: none is hashed again.
    worker = {**os.environ, "GIT_DIR": str(child.odb), "GIT_WORK_TREE": str(child.path),
              "GIT_INDEX_FILE": str(child.index)}
    out = subprocess.run(["git", "diff-files", "--name-only"], cwd=child.path, env=worker,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "d0/f0.txt"


def test_a_run_isolated_in_its_view_starts_boxes_that_copy_no_other_view(
        redis: redis_lib.Redis, home: Path) -> None:
    """A worker's thread working in one view moves to a mount namespace of its own where
    no other child's view is mounted (a box copies every mount of its starter); the
    process's namespace keeps them all, and the thread gets them back as it rejoins."""
    import threading

    from swarm.agent import sandbox
    from swarm.agent.shell import LocalEnvironment

    repo = make_repo(home / "repo")
    sid = seeds(redis, home / "laptop", "laptop").take(repo, SWARM, tree_of=g.discover(repo))
    host = seeds(redis, home / "host-b", "hostb")
    mine, other = host.child(SWARM, "a1", sid), host.child(SWARM, "a2", sid)
    seen: dict[str, object] = {}

    def run() -> None:
        seen["isolated"] = views.isolate(home / "host-b" / "workspaces", mine.top)
        seen["during"] = (views.mounted(mine.path), views.mounted(other.path))
        if sandbox.probe().ok:
            box = LocalEnvironment(mine.path, sandbox="bwrap", hide=(home / "host-b",))
            seen["box"] = box.execute(f"cat d0/f0.txt; grep -c ' {other.path.resolve()} ' "
                                      "/proc/self/mountinfo", 10).output
        views.rejoin()
        seen["after"] = (views.mounted(mine.path), views.mounted(other.path))

    thread = threading.Thread(target=run)
    thread.start()
    assert views.mounted(other.path)  # the process's namespace keeps both meanwhile
    thread.join()
    assert seen["isolated"] is True
    assert seen["during"] == (True, False) and seen["after"] == (True, True)
    assert seen.get("box", "file 0\n0\n") == "file 0\n0\n"  # its view, not the other


_ISOLATIONS = r'''
import json, os, subprocess, sys, threading
from pathlib import Path
from swarm.workspace import views

assert views.private_mounts() and views._viewless is not None
base = Path(sys.argv[1])
seen = {"cwd": os.getcwd()}  # the process stays in its folder
tops = [base / "workspaces" / "s" / f"a{i}" for i in range(3)]
for i, top in enumerate(tops):
    top.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(top)], check=True)
    (top / "f").write_text(f"view {i}")
(base / "later").mkdir()  # mounted after private_mounts(), not a view
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(base / "later")], check=True)
iso = views.Isolation(base / "workspaces", tops[1])

def ns():
    return os.readlink(f"/proc/self/task/{threading.get_native_id()}/ns/mnt")

def points():
    with open(f"/proc/self/task/{threading.get_native_id()}/mountinfo") as table:
        return [line.split()[4] for line in table if str(base) in line.split()[4]]

def first():
    with iso.entered() as inside:
        seen["first"] = [inside, ns(), points(), (tops[1] / "f").read_text()]
    seen["first_after"] = [ns(), os.getcwd()]
    # A thread started now shares this thread's filesystem context (a library's, made
    # lazily): it must not keep the thread from entering and leaving again.
    started = threading.Event()
    threading.Thread(target=lambda: (started.set(), threading.Event().wait()),
                     daemon=True).start()
    started.wait()
    with iso.entered() as inside:
        seen["again"] = [inside, ns()]
    seen["again_after"] = ns()

def second():
    with iso.entered() as inside:
        seen["second"] = [inside, ns(), (tops[1] / "f").read_text()]

for target in (first, second):
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
iso.close()
try:
    iso.enter()
    seen["closed"] = "entered"
except OSError as exc:
    seen["closed"] = str(exc)
seen["process"] = [os.readlink("/proc/self/ns/mnt"), points()]
print(json.dumps(seen))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts tmpfs views in a namespace of its own")
def test_an_isolation_is_a_copy_of_the_namespace_without_views_with_one_view_moved_in(
        tmp_path: Path) -> None:
    """A run's boxes start in a namespace copied from the one the worker had before any
    view (a few mounts, whatever number of views the worker has: copying the worker's, each
    run's start took a lock of all the kernel's mounts for as long as it copied them all,
    and each unmount an RCU grace period), with its own view moved in; threads enter it for
    a box's start and go back, to their folder too; one started meanwhile does not keep
    them there; once closed, nobody enters it; the worker stays in its folder."""
    import json
    import sys

    (tmp_path / "here").mkdir()
    out = subprocess.run([sys.executable, "-c", _ISOLATIONS, str(tmp_path)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path / "here")
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    process_ns, process_points = seen["process"]
    inside, first_ns, first_points, text = seen["first"]
    assert inside and first_ns != process_ns and text == "view 1"
    # Its view alone: not the others, nor what the worker mounted after it began.
    assert first_points == [str(tmp_path / "workspaces" / "s" / "a1")]
    assert len(process_points) == 4  # the worker keeps them all
    # Back in the worker's namespace and folder (setns moves a thread to the root).
    assert seen["first_after"] == [process_ns, str(tmp_path / "here")]
    assert seen["cwd"] == str(tmp_path / "here")
    assert seen["again"] == [True, first_ns] and seen["again_after"] == process_ns
    assert seen["second"] == [True, first_ns, "view 1"]  # the same namespace, entered
    assert "has ended" in seen["closed"]
