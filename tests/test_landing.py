"""Work that lands: children's changes arrive in the parent's working tree, in call order,
as three-way merges over the seed they started from; conflicts go back, never into the
files; nothing is left in ``git branch`` or ``git worktree list``. On real git and the
real store, with children on the parent's host and on another one."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from swarm.store.snapshots import SnapshotStore
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming
from swarm.workspace.seed import Seeds, Workspace

SWARM = "slandtest"


def sh(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout


def dirty_repo(path: Path) -> Path:
    """A repository with the user's own uncommitted edit and an untracked file."""
    path.mkdir(parents=True)
    sh(path, "init", "-q")
    (path / "shared.py").write_text("".join(f"line {n}\n" for n in range(1, 21)))
    (path / "other.txt").write_text("other\n")
    (path / "doomed.txt").write_text("to be deleted\n")
    (path / "moved.txt").write_text("to be renamed\n")
    (path / "tool.sh").write_text("echo hi\n")
    (path / "data.bin").write_bytes(bytes(range(256)))
    sh(path, "add", "-A")
    sh(path, "commit", "-qm", "base")
    text = (path / "shared.py").read_text().replace("line 2\n", "line 2 edited by the user\n")
    (path / "shared.py").write_text(text)
    (path / "mine.txt").write_text("the user's untracked file\n")
    return path


class Swarm:
    """A parent's workspace and helpers to make children of it (on this host or another),
    let them edit their files, and land their work."""

    def __init__(self, redis: redis_lib.Redis, tmp: Path, repo: Path) -> None:
        self.redis, self.tmp, self.repo = redis, tmp, repo
        self.here = Seeds(SnapshotStore(redis), tmp / "home-a", "laptop", view="checkout")
        self.there = Seeds(SnapshotStore(redis), tmp / "home-b", "hostb", view="checkout")
        self.tree = g.discover(repo)
        assert self.tree is not None
        self.sid = self.here.take(repo, SWARM, tree_of=self.tree)
        self.n = 0

    def child(self, edit: Any, elsewhere: bool = False) -> dict[str, Any]:
        """A child's result after ``edit(workspace_path)`` ran in its workspace."""
        self.n += 1
        agent = f"c{self.n}"
        seeds = self.there if elsewhere else self.here
        ws = seeds.child(SWARM, agent, self.sid)
        edit(ws.path)
        delta = seeds.capture(ws, SWARM)
        if not delta:
            return {"agent_id": agent, "changes": "none"}
        return {"agent_id": agent, "delta": delta, "seed": ws.seed}

    def land(self, *bodies: dict[str, Any]) -> homecoming.Landing:
        parent = homecoming.parent_of(self.here, self.repo, self.tree, None)
        return homecoming.land(self.here, parent, list(bodies), SWARM)


@pytest.fixture
def swarm(redis: redis_lib.Redis, tmp_path: Path) -> Swarm:
    return Swarm(redis, tmp_path, dirty_repo(tmp_path / "repo"))


def assert_nothing_to_clean(repo: Path) -> None:
    assert sh(repo, "branch", "--list").split() == ["*", "master"] or \
        sh(repo, "branch", "--list").split() == ["*", "main"]
    assert len(sh(repo, "worktree", "list").splitlines()) == 1
    log = sh(repo, "log", "--branches", "--tags", "--format=%an %ad")
    assert "swarm" not in log


def replace_line(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize("elsewhere", [False, True], ids=["same-host", "other-host"])
def test_four_new_files_and_an_edit_of_the_users_edited_file_all_land(
        swarm: Swarm, elsewhere: bool) -> None:
    index_before = sh(swarm.repo, "diff", "--cached", "--stat")
    bodies = [swarm.child(lambda p, n=n: (p / f"new{n}.py").write_text(f"child {n}\n"),
                          elsewhere) for n in range(4)]
    bodies.append(swarm.child(lambda p: replace_line(p / "shared.py", "line 15\n",
                                                     "line 15 edited by a child\n"), elsewhere))
    done = swarm.land(*bodies)
    assert [state for _, state in done.children] == ["landed"] * 5
    assert all(b["landing"] == "landed" for b in bodies)
    for n in range(4):
        assert (swarm.repo / f"new{n}.py").read_text() == f"child {n}\n"
    shared = (swarm.repo / "shared.py").read_text()
    assert "line 2 edited by the user\n" in shared and "line 15 edited by a child\n" in shared
    assert (swarm.repo / "mine.txt").read_text() == "the user's untracked file\n"
    # Uncommitted, as if the parent had made the edits: the user's index is as it was.
    assert sh(swarm.repo, "diff", "--cached", "--stat") == index_before
    assert "?? new0.py" in sh(swarm.repo, "status", "--porcelain")
    assert done.files == 5 and "5 children landed" in done.summary()
    assert_nothing_to_clean(swarm.repo)


def test_three_children_rewriting_one_line_one_lands_two_conflict_without_markers(
        swarm: Swarm) -> None:
    bodies = [swarm.child(lambda p, n=n: replace_line(p / "shared.py", "line 10\n",
                                                      f"line 10 by child {n}\n"))
              for n in range(3)]
    done = swarm.land(*bodies)
    assert [b["landing"] for b in bodies] == ["landed", "conflict", "conflict"]
    shared = (swarm.repo / "shared.py").read_text()
    assert "line 10 by child 0\n" in shared and "line 2 edited by the user\n" in shared
    assert "<<<<<<<" not in shared and ">>>>>>>" not in shared and "=======" not in shared
    for body in bodies[1:]:
        assert body["conflicts"] == ["shared.py"]
        assert f"+line 10 by child {bodies.index(body)}" in body["hunks"]
        assert body["kept"] == f"refs/swarm/{SWARM}/{body['agent_id']}"
        # Its changes stay retrievable, with the command that shows them.
        shown = subprocess.run(body["show"], shell=True, cwd=swarm.repo, capture_output=True,
                               text=True, check=True).stdout
        assert f"+line 10 by child {bodies.index(body)}" in shown
    assert len(done.conflicts) == 2 and "conflicts in shared.py" in done.summary()
    assert_nothing_to_clean(swarm.repo)


def test_a_child_editing_the_line_the_user_edited_conflicts_and_the_user_edit_stays(
        swarm: Swarm) -> None:
    body = swarm.child(lambda p: replace_line(p / "shared.py", "line 2 edited by the user\n",
                                              "line 2 by the child\n"))
    # The user edits the same line again after the call.
    replace_line(swarm.repo / "shared.py", "line 2 edited by the user\n", "line 2 again\n")
    swarm.land(body)
    assert body["landing"] == "conflict"
    assert "line 2 again\n" in (swarm.repo / "shared.py").read_text()


def test_deletes_renames_binary_files_and_mode_changes_land(swarm: Swarm) -> None:
    def edit(p: Path) -> None:
        (p / "doomed.txt").unlink()
        (p / "moved.txt").rename(p / "renamed.txt")
        (p / "data.bin").write_bytes(bytes(reversed(range(256))) + b"\0\xff")
        os.chmod(p / "tool.sh", 0o755)
        (p / "pic.bin").write_bytes(b"\x89PNG\0\0binary")

    body = swarm.child(edit)
    swarm.land(body)
    assert body["landing"] == "landed"
    repo = swarm.repo
    assert not (repo / "doomed.txt").exists() and not (repo / "moved.txt").exists()
    assert (repo / "renamed.txt").read_text() == "to be renamed\n"
    assert (repo / "data.bin").read_bytes() == bytes(reversed(range(256))) + b"\0\xff"
    assert (repo / "pic.bin").read_bytes() == b"\x89PNG\0\0binary"
    assert os.stat(repo / "tool.sh").st_mode & stat.S_IXUSR


def test_a_child_that_changed_nothing_leaves_no_ref_branch_or_folder(swarm: Swarm) -> None:
    body = swarm.child(lambda p: None)
    assert body == {"agent_id": "c1", "changes": "none"}
    swarm.land(body)
    assert body["landing"] == "no changes"
    assert sh(swarm.repo, "for-each-ref", f"refs/swarm/{SWARM}") == ""
    assert_nothing_to_clean(swarm.repo)


def test_a_child_kept_aside_does_not_land_and_its_ref_keeps_it(swarm: Swarm) -> None:
    body = swarm.child(lambda p: (p / "alt.txt").write_text("an alternative\n"))
    body["land"] = "keep"
    swarm.land(body)
    assert body["landing"] == "kept" and not (swarm.repo / "alt.txt").exists()
    assert sh(swarm.repo, "show", f"{body['kept']}:alt.txt") == "an alternative\n"


def test_a_file_the_parent_ignores_is_never_overwritten(swarm: Swarm) -> None:
    # Ignored by the user's own .git/info/exclude, which a child elsewhere does not have.
    (swarm.repo / ".git" / "info").mkdir(exist_ok=True)
    (swarm.repo / ".git" / "info" / "exclude").write_text("notes.local\n")
    (swarm.repo / "notes.local").write_text("mine\n")
    body = swarm.child(lambda p: (p / "notes.local").write_text("the child's\n"),
                       elsewhere=True)
    swarm.land(body)
    assert body["landing"] == "conflict" and body["conflicts"] == ["notes.local"]
    assert (swarm.repo / "notes.local").read_text() == "mine\n"


def test_the_childs_own_git_is_its_own_and_what_lands_is_its_workspace(swarm: Swarm) -> None:
    def edit(p: Path) -> None:
        assert (p / ".git").is_dir()  # a repository of its own, not a worktree of the user's
        (p / "committed.py").write_text("committed in the child\n")
        sh(p, "add", "committed.py")
        sh(p, "commit", "-qm", "the child's own commit")
        sh(p, "checkout", "-qb", "experiment")
        (p / "stashed.txt").write_text("stashed\n")
        sh(p, "stash", "-u", "-q")
        (p / "plain.txt").write_text("left uncommitted\n")

    body = swarm.child(edit)
    swarm.land(body)
    assert (swarm.repo / "committed.py").read_text() == "committed in the child\n"
    assert (swarm.repo / "plain.txt").read_text() == "left uncommitted\n"
    assert not (swarm.repo / "stashed.txt").exists()
    # Nothing of the child's git reached the user's repository.
    assert "experiment" not in sh(swarm.repo, "branch", "--list")
    assert sh(swarm.repo, "stash", "list") == ""
    assert "the child's own commit" not in sh(swarm.repo, "log", "--all", "--format=%s")


def test_a_childs_commands_cannot_write_the_users_refs_or_objects(swarm: Swarm) -> None:
    ws: list[Workspace] = []

    def edit(p: Path) -> None:
        ws.append(Workspace(p))
        alternates = (p / ".git" / "objects" / "info" / "alternates").read_text().strip()
        assert Path(alternates) == (swarm.repo / ".git" / "objects").resolve()
        sh(p, "commit", "-qam", "x", "--allow-empty")
        sh(p, "branch", "-f", "master", "HEAD")

    before = sh(swarm.repo, "rev-parse", "master")
    swarm.child(edit)
    assert sh(swarm.repo, "rev-parse", "master") == before
    assert not (swarm.repo / ".git" / "worktrees").exists()


def test_a_landing_that_fails_the_check_is_undone_and_only_that_one(swarm: Swarm) -> None:
    ran: list[str] = []

    def run_check(command: str) -> tuple[bool, str]:
        done = subprocess.run(command, shell=True, cwd=swarm.repo, capture_output=True,
                              text=True)
        ran.append(",".join(sorted(p.name for p in swarm.repo.glob("*.txt"))))
        return done.returncode == 0, done.stdout + done.stderr

    bodies = [swarm.child(lambda p: (p / "ok1.txt").write_text("fine\n")),
              swarm.child(lambda p: (p / "broken.txt").write_text("breaks the build\n")),
              swarm.child(lambda p: replace_line(p / "shared.py", "line 9\n", "line nine\n"))]
    parent = homecoming.parent_of(swarm.here, swarm.repo, swarm.tree, None)
    done = homecoming.land(swarm.here, parent, bodies, SWARM, run_check,
                           "test ! -e broken.txt || { echo broken.txt is here; exit 3; }")
    assert [b["landing"] for b in bodies] == ["landed", "check failed", "landed"]
    assert not (swarm.repo / "broken.txt").exists()
    assert (swarm.repo / "ok1.txt").read_text() == "fine\n"
    assert "line nine\n" in (swarm.repo / "shared.py").read_text()
    assert "broken.txt is here" in bodies[1]["check_output"]
    # The check saw each landing with the earlier ones, the failing one's files included.
    assert "broken.txt" in ran[1] and "ok1.txt" in ran[1]
    assert "failed the check" in done.summary()


def test_a_lone_landing_that_fails_the_check_leaves_the_tree_as_it_was(swarm: Swarm) -> None:
    before = {p.name: p.read_bytes() for p in swarm.repo.iterdir() if p.is_file()}
    body = swarm.child(lambda p: replace_line(p / "shared.py", "line 9\n", "line nine\n"))
    parent = homecoming.parent_of(swarm.here, swarm.repo, swarm.tree, None)
    done = homecoming.land(swarm.here, parent, [body], SWARM,
                           lambda command: (False, "no"), "false")
    assert body["landing"] == "check failed" and done.files == 0
    assert {p.name: p.read_bytes() for p in swarm.repo.iterdir() if p.is_file()} == before


def test_a_continued_child_starts_from_the_parents_files_with_its_own_changes_reapplied(
        swarm: Swarm) -> None:
    seeds = swarm.here
    ws = seeds.child(SWARM, "cc", swarm.sid)
    replace_line(ws.path / "shared.py", "line 5\n", "line 5 by the child\n")
    replace_line(ws.path / "shared.py", "line 18\n", "line 18 by the child\n")
    (ws.path / "childs.txt").write_text("the child's own file\n")
    (ws.path / "other.txt").write_text("the child's other\n")
    # Meanwhile the parent changed one of those places, and a file of its own.
    replace_line(swarm.repo / "shared.py", "line 18\n", "line 18 by the parent\n")
    (swarm.repo / "parents.txt").write_text("the parent's new file\n")
    again = seeds.take(swarm.repo, SWARM, tree_of=swarm.tree)
    new, kept = homecoming.rebase(seeds, ws, again, SWARM, "cc")
    assert kept == ["shared.py"]
    assert new.seed == again and (new.path / ".git").is_dir()
    shared = (new.path / "shared.py").read_text()
    # Where its change no longer fits, the parent's version; no conflict marker.
    assert "line 18 by the parent\n" in shared and "<<<<<<<" not in shared
    assert (new.path / "parents.txt").read_text() == "the parent's new file\n"
    assert (new.path / "childs.txt").read_text() == "the child's own file\n"
    assert (new.path / "other.txt").read_text() == "the child's other\n"
    # What it now sends home is measured against the new seed: its re-applied changes.
    delta = seeds.capture(new, SWARM)
    body = {"agent_id": "cc", "delta": delta, "seed": new.seed}
    swarm.land(body)
    assert body["landing"] == "landed"
    assert (swarm.repo / "childs.txt").read_text() == "the child's own file\n"
    assert "line 18 by the parent\n" in (swarm.repo / "shared.py").read_text()


def test_siblings_adding_one_file_land_once_and_identical_additions_agree(
        swarm: Swarm) -> None:
    bodies = [swarm.child(lambda p, n=n: (p / "out.txt").write_text(f"child {n}\n"))
              for n in range(4)]
    same = [swarm.child(lambda p: (p / "same.txt").write_text("agreed\n")) for _ in range(2)]
    swarm.land(*bodies, *same)
    assert [b["landing"] for b in bodies] == ["landed", "conflict", "conflict", "conflict"]
    assert all(b["conflicts"] == ["out.txt"] and "+child" in b["hunks"] for b in bodies[1:])
    assert (swarm.repo / "out.txt").read_text() == "child 0\n"
    assert [b["landing"] for b in same] == ["landed", "landed"]
    assert (swarm.repo / "same.txt").read_text() == "agreed\n"


def test_a_check_that_swaps_a_landed_folder_for_a_link_gets_nothing_outside_removed(
        swarm: Swarm, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "x").mkdir(parents=True)
    (outside / "x" / "precious").write_text("keep me\n")
    body = swarm.child(lambda p: ((p / "evil").mkdir(), (p / "evil" / "x").write_text("1\n")))

    def hostile_check(command: str) -> tuple[bool, str]:
        shutil.rmtree(swarm.repo / "evil")  # the check's command, in the parent's folder
        (swarm.repo / "evil").symlink_to(outside)
        return False, "failed"

    parent = homecoming.parent_of(swarm.here, swarm.repo, swarm.tree, None)
    homecoming.land(swarm.here, parent, [body], SWARM, hostile_check, "make test")
    assert body["landing"] == "check failed"
    assert (outside / "x" / "precious").read_text() == "keep me\n"


def test_odd_file_names_land_as_themselves(swarm: Swarm) -> None:
    names = ['"quoted"', " leading space.txt", "tab\tname.txt", "new\nline.txt",
             "caf\xe9.txt", "pages/[id].tsx"]

    def edit(p: Path) -> None:
        (p / "pages").mkdir()
        for name in names:
            (p / name).write_text(f"{name!r}\n")

    body = swarm.child(edit)
    swarm.land(body)
    assert body["landing"] == "landed", body
    for name in names:
        assert (swarm.repo / name).read_text() == f"{name!r}\n"
    assert (swarm.repo / "shared.py").read_text().startswith("line 1\n")  # untouched


def test_an_edit_of_the_parent_to_a_file_named_with_a_leading_space_is_kept(
        swarm: Swarm) -> None:
    (swarm.repo / " notes.txt").write_text("base\n")
    swarm.sid = swarm.here.take(swarm.repo, SWARM, tree_of=swarm.tree)
    body = swarm.child(lambda p: (p / " notes.txt").write_text("the child's\n"))
    (swarm.repo / " notes.txt").write_text("the user's, since the call\n")
    swarm.land(body)
    assert body["landing"] == "conflict" and body["conflicts"] == [" notes.txt"]
    assert (swarm.repo / " notes.txt").read_text() == "the user's, since the call\n"


def test_a_secret_file_where_a_child_wants_a_folder_is_kept(swarm: Swarm) -> None:
    (swarm.repo / ".env").write_text("SECRET=mine\n")  # left out of the seed
    body = swarm.child(lambda p: ((p / ".swarmignore").write_text("!.env*\n"),
                                  (p / ".env").mkdir(), (p / ".env" / "x").write_text("1\n")))
    swarm.land(body)
    assert body["landing"] == "conflict" and ".env/x" in body["conflicts"]
    assert (swarm.repo / ".env").read_text() == "SECRET=mine\n"


def test_a_child_removing_a_submodule_leaves_the_users_checkout_of_it(
        swarm: Swarm, tmp_path: Path) -> None:
    sub = tmp_path / "sub-origin"
    sub.mkdir()
    sh(sub, "init", "-q")
    (sub / "s.txt").write_text("s\n")
    sh(sub, "add", "-A")
    sh(sub, "commit", "-qm", "s")
    sh(swarm.repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub),
       "sub")
    sh(swarm.repo, "commit", "-qm", "sub")
    (swarm.repo / "sub" / "wip.txt").write_text("the user's uncommitted work\n")
    swarm.sid = swarm.here.take(swarm.repo, SWARM, tree_of=swarm.tree)
    body = swarm.child(lambda p: shutil.rmtree(p / "sub"))
    swarm.land(body)
    assert (swarm.repo / "sub" / "wip.txt").read_text() == "the user's uncommitted work\n"


def test_children_of_two_calls_adding_a_file_and_a_folder_of_its_name_do_not_both_land(
        swarm: Swarm) -> None:
    first = swarm.child(lambda p: (p / "foo").write_text("a file\n"))
    (swarm.repo / "other.txt").write_text("changed by the parent\n")
    swarm.sid = swarm.here.take(swarm.repo, SWARM, tree_of=swarm.tree)
    second = swarm.child(lambda p: ((p / "foo").mkdir(), (p / "foo" / "bar").write_text("b\n")))
    swarm.land(first, second)
    assert [first["landing"], second["landing"]] == ["landed", "conflict"]
    assert (swarm.repo / "foo").read_text() == "a file\n"
