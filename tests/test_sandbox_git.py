"""The worker's own git (unconfined, root on a root worker) on workspaces sandboxed commands
wrote: a command in the box plants a repository, a ``.git`` file or folder, a config in
the child's own repository, hooks, filters and the like, each set to run a program; the
worker then does what it does with a child's workspace (capture it, snapshot it as a
parent, park it, find it again, land a grandchild's work in it), and the program never
runs. A child's ``.git`` is its own (the worker reads its workspace through the repository
it chose, never that one); the user's repository is out of the child's box's reach but
for its objects, read-only; in a root's box, what git obeys in it is read-only. The
worker's global config trusts every folder (``safe.directory=*``, as many CI images and
containers set), so git's ownership check is not what stops it. The end-to-end case,
through real workers, is at the bottom."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis as redis_lib

from swarm.agent import sandbox
from swarm.agent.shell import LocalEnvironment
from swarm.domain.session import Session
from swarm.store.snapshots import SnapshotStore
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming, parked
from swarm.workspace.seed import Seeds, Workspace

needs_sandbox = pytest.mark.skipif(not sandbox.probe().ok,
                                   reason=f"no sandbox here: {sandbox.probe().reason}")
SWARM = "sgitescape"

#: Where git looks for a program a repository's config may name.
VECTORS = ("fsmonitor", "filter", "textconv", "diff", "gpg", "alternates", "pager", "ssh")
HOOKS = ("pre-commit", "commit-msg", "post-commit", "post-checkout", "post-index-change",
         "reference-transaction", "pre-auto-gc", "post-rewrite", "prepare-commit-msg")


def sh(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture
def marks() -> Iterator[Path]:
    """Where a planted program leaves its mark: outside every workspace, read-only in
    the box (so only a program the worker runs can write there)."""
    folder = Path("/var/tmp") / f"swarm-git-escape-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def trusting_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's global git config trusts every folder."""
    config = tmp_path / "worker.gitconfig"
    config.write_text("[safe]\n\tdirectory = *\n[user]\n\tname = w\n\temail = w@w\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))


def arm(marks: Path) -> str:
    """Shell that makes ``pwn/`` in the current folder: a program per vector and a hooks
    folder, each leaving its mark, and ``evil.cfg``: a git config naming them all."""
    lines = ["mkdir -p pwn/hooks"]
    for name in (*VECTORS, *(f"hooks/{h}" for h in HOOKS)):
        mark = marks / name.replace("/", "-")
        lines.append(f"printf '#!/bin/sh\\ntouch {mark}\\ncat\\n' > pwn/{name}")
    lines.append("chmod +x pwn/* pwn/hooks/*")
    here = '"$PWD"'
    lines.append(
        "printf '[core]\\n\\tfsmonitor = %s/pwn/fsmonitor\\n\\thooksPath = %s/pwn/hooks\\n"
        "\\tpager = %s/pwn/pager\\n\\talternateRefsCommand = %s/pwn/alternates\\n"
        "\\tsshCommand = %s/pwn/ssh\\n[filter \"x\"]\\n\\tclean = %s/pwn/filter\\n"
        "\\tsmudge = %s/pwn/filter\\n[diff \"x\"]\\n\\ttextconv = %s/pwn/textconv\\n"
        "[diff]\\n\\texternal = %s/pwn/diff\\n[commit]\\n\\tgpgSign = true\\n"
        "[gpg]\\n\\tprogram = %s/pwn/gpg\\n' " + " ".join([here] * 10) + " > evil.cfg")
    lines.append("printf '* filter=x diff=x\\n' > .gitattributes")
    return " && ".join(lines)


def evil_repo(name: str) -> str:
    """Shell that makes a git folder ``name`` (not bare) whose config is ``evil.cfg``."""
    return (f"mkdir -p e.tmp && git -C e.tmp init -q && mv e.tmp/.git {name} && rmdir e.tmp "
            f"&& cat evil.cfg >> {name}/config")


#: What a command plants, by name: shell run in the box in the child's workspace (a
#: subfolder of its top folder, as its parent worked in a subfolder of its repository),
#: after arm().
PLANTS = {
    # A .git file naming a git folder the command made.
    "git-file": f"{evil_repo('.evil')} && echo \"gitdir: $PWD/.evil\" > .git",
    # A git folder.
    "git-dir": evil_repo(".git"),
    # The child's own repository (above its folder, its own to write) gets the config,
    # a config.worktree (its repository enables extensions.worktreeConfig) and hooks.
    "own-config": "dot=\"$(git rev-parse --absolute-git-dir)\" && cat evil.cfg >> \"$dot/config\""
                  " && git config extensions.worktreeConfig true"
                  " && cp evil.cfg \"$dot/config.worktree\""
                  " && mkdir -p \"$dot/hooks\" && cp pwn/hooks/* \"$dot/hooks/\"",
}


def make_repo(path: Path) -> Path:
    (path / "pkg").mkdir(parents=True)
    sh(path, "init", "-q")
    (path / "pkg" / "code.txt").write_text("base\n")
    (path / "top.txt").write_text("base\n")
    sh(path, "add", "-A")
    sh(path, "commit", "-qm", "base")
    sh(path, "config", "extensions.worktreeConfig", "true")
    return path


def seeds(redis: redis_lib.Redis, home: Path) -> Seeds:
    return Seeds(SnapshotStore(redis), home, "laptop", view="checkout")


def result_session(workspace: Path, body: dict[str, object]) -> Session:
    return Session(id="p", workspace=str(workspace), messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0"}]},
        {"role": "tool", "tool_call_id": "c0", "content": json.dumps(body)}],
        usage={}, created=0, updated=0)


def child_box(child: Workspace, home: Path) -> LocalEnvironment:
    """A child's box as its worker starts it: SWARM_HOME hidden, the objects its own
    repository borrows shown read-only."""
    assert child.odb is not None
    return LocalEnvironment(child.path, sandbox="bwrap", hide=(home,),
                            read_only=(child.odb / "objects",))


def what_the_worker_does(host: Seeds, child: Workspace) -> str:
    """Everything a worker's git does with a child's workspace after its commands ran; the
    commit its work was captured as."""
    delta = host.capture(child, SWARM)  # it settles: its work is sent home
    assert delta
    sid = host.take(child.path, SWARM, base=child.seed, own=child)  # as a parent
    assert parked.state(sid) == sid  # it parks
    again = host.found(child.path, SWARM, "a1", child.seed)  # a later run finds it
    # The same repository and index, whatever its .git says.
    assert (again.odb, again.index) == (child.odb, child.index)
    grandchild = host.child(SWARM, "g1", sid)
    (grandchild.path / "from-g1.txt").write_text("g1\n")
    late = host.capture(grandchild, SWARM)
    session = result_session(child.path, {"agent_id": "g1", "state": "done", "delta": late,
                                          "seed": sid})
    homecoming.bring_home(host, session, child.path, SWARM, None, again)
    body = json.loads(session.messages[-1]["content"])
    assert body.get("landing") == "landed", body
    assert (child.path / "from-g1.txt").read_text() == "g1\n"
    return delta


@needs_sandbox
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_what_a_command_plants_never_runs_in_the_workers_git(
        redis: redis_lib.Redis, tmp_path: Path, marks: Path, plant: str) -> None:
    repo = make_repo(tmp_path / "repo")
    laptop = seeds(redis, tmp_path / "home-a")
    parent = g.discover(repo / "pkg")
    assert parent is not None and parent.top == repo
    sid = laptop.take(repo / "pkg", SWARM, tree_of=parent)  # the parent works in pkg/
    host = seeds(redis, tmp_path / "home-w")  # a worker on the same host
    child = host.child(SWARM, "a1", sid)
    assert child.odb is not None and child.path == child.top / "pkg"
    assert child.odb.resolve() == (repo / ".git").resolve()
    box = child_box(child, tmp_path / "home-w")
    done = box.execute(f"{arm(marks)} && {PLANTS[plant]} && echo planted", 30)
    assert done.output.endswith("planted\n"), done.output
    try:
        delta = what_the_worker_does(host, child)
    finally:  # first: what ran, whether or not the worker got through
        assert sorted(os.listdir(marks)) == []
    # What it captured holds what the command wrote (in the user's object store, where
    # the worker wrote it).
    assert "pkg/pwn/fsmonitor" in sh(repo, "ls-tree", "-r", "--name-only", delta)


@needs_sandbox
def test_the_repository_files_the_workers_git_reads_are_read_only_in_the_box(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """What git reads as config, attributes, excludes or hooks in the user's repository
    cannot be written from a root's box in it, nor from the box of a child on its host
    (whose repository borrows its objects); the child's own repository can (the worker's
    git never reads it)."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a").take(repo, SWARM, tree_of=g.discover(repo))
    child = seeds(redis, tmp_path / "home-w").child(SWARM, "a1", sid)
    assert child.odb is not None and child.odb.resolve() == (repo / ".git").resolve()
    common = repo / ".git"
    targets = [common / "config", common / "info" / "attributes", common / "info" / "exclude",
               common / "hooks" / "post-commit"]
    # Not there to bind read-only in a root's box (see the xfail test below).
    absent = [common / "config.worktree", common / "commondir"]
    before = {p: p.read_bytes() for p in targets if p.exists()}
    command = "; ".join(f"echo x >> {t}; echo {t.relative_to(common)}=$?" for t in targets)
    out = LocalEnvironment(repo, sandbox="bwrap", hide=(tmp_path / "home-a",)).execute(
        f"{command}; echo x >> .git/config; echo own=$?", 10).output
    for target in targets:
        assert f"{target.relative_to(common)}=1" in out, out
    assert "own=1" in out, out  # the root's .git is the user's
    # The child's box has nothing of the user's repository but its objects (what it writes
    # at those paths goes to the box's own /tmp); its own .git is its to write.
    command = "; ".join(f"echo x >> {t}" for t in targets + absent)
    out = child_box(child, tmp_path / "home-w").execute(
        f"{command}; echo x >> .git/config; echo own=$?", 10).output
    assert "own=0" in out, out
    assert {p: p.read_bytes() for p in targets if p.exists()} == before
    assert not any(p.exists() for p in absent)
    assert not (common / "info" / "attributes").exists()


@needs_sandbox
@pytest.mark.xfail(strict=True, reason="known gap: a root's box can create .git/config.worktree "
                   "(its .git is writable; only files already there are bound read-only), "
                   "which the root's git obeys when the repository enables "
                   "extensions.worktreeConfig")
def test_a_roots_box_cannot_plant_a_config_worktree_its_git_obeys(
        redis: redis_lib.Redis, tmp_path: Path, marks: Path) -> None:
    repo = make_repo(tmp_path / "repo")  # extensions.worktreeConfig is on
    laptop = seeds(redis, tmp_path / "home-a")
    tree = laptop.pinned("root:s1", repo)
    box = LocalEnvironment(repo, sandbox="bwrap", hide=(tmp_path / "home-a",))
    box.execute(f"{arm(marks)} && cp evil.cfg .git/config.worktree", 30)
    try:
        laptop.take(repo, SWARM, tree_of=tree)
    finally:
        (repo / ".git" / "config.worktree").unlink(missing_ok=True)
    assert sorted(os.listdir(marks)) == []


@needs_sandbox
def test_git_works_in_the_box_of_a_child_seeded_from_a_subfolder(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """A parent working in a subfolder of its repository seeds children that work in that
    subfolder of their workspace: the box binds their own repository from above it (and
    the rest of their workspace read-only)."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a").take(repo / "pkg", SWARM,
                                                 tree_of=g.discover(repo / "pkg"))
    child = seeds(redis, tmp_path / "home-w").child(SWARM, "a1", sid)
    assert child.path == child.top / "pkg"
    result = child_box(child, tmp_path / "home-w").execute(
        "echo more >> code.txt && git -c user.name=c -c user.email=c@c commit -qam box && "
        "git log --format=%s -1 && { echo x > ../top.txt; echo above=$?; }", 10)
    assert result.output.startswith("box\n"), result.output
    assert "above=1" in result.output, result.output  # the rest of its workspace: read-only
    assert sh(child.path, "log", "--format=%s", "-1", "swarm/a1") == "box\n"
    assert "swarm/a1" not in sh(repo, "branch", "--list")  # its own repository's branch


@needs_sandbox
def test_a_childs_box_cannot_write_the_users_refs_or_objects(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """A child on the user's host borrows the user's objects: its box shows them read-only
    and nothing else of the user's repository; git in the box commits to its own."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a").take(repo, SWARM, tree_of=g.discover(repo))
    child = seeds(redis, tmp_path / "home-w").child(SWARM, "a1", sid)
    dot = repo / ".git"
    assert child.odb is not None and child.odb.resolve() == dot.resolve()
    refs = sh(repo, "for-each-ref")
    objects = sorted(str(p) for p in (dot / "objects").rglob("*"))
    # The objects are shown read-only; the rest of the user's .git is not there at all
    # (what a command writes at its path goes to the box's own /tmp).
    tries = {"object": f"mkdir -p {dot}/objects/ab && echo x > {dot}/objects/ab/cd",
             "pack": f"echo x > {dot}/objects/pack/evil.pack",
             "ref": f"mkdir -p {dot}/refs/heads && echo x > {dot}/refs/heads/evil",
             "update-ref": f"git --git-dir={dot} update-ref refs/heads/evil HEAD",
             "push": f"git push -q {dot} HEAD:refs/heads/evil",
             "packed": f"echo x >> {dot}/packed-refs"}
    commit = "git -c user.name=c -c user.email=c@c commit -q --allow-empty -m box; echo commit=$?"
    out = child_box(child, tmp_path / "home-w").execute(
        "; ".join(f"{{ {c}; }} 2>/dev/null; echo {n}=$?" for n, c in tries.items())
        + f"; {commit}", 30).output
    assert "object=1" in out and "pack=1" in out, out
    assert "commit=0" in out, out
    assert sh(repo, "for-each-ref") == refs
    assert sorted(str(p) for p in (dot / "objects").rglob("*")) == objects
    assert not (dot / "packed-refs").exists() and not (dot / "refs" / "heads" / "evil").exists()
    assert sh(child.path, "log", "--format=%s", "-1") == "box\n"


@needs_sandbox
def test_a_roots_own_git_stays_where_it_is_in_the_box(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """A repository's own .git folder with what git obeys in it (a root's or a job's
    folder) cannot be moved, replaced or rewritten from the box; git still commits
    there."""
    repo = make_repo(tmp_path / "repo")
    commit = "git -c user.name=c -c user.email=c@c commit -q --allow-empty -m box; echo commit=$?"
    before = {p: p.read_bytes() for p in (repo / ".git").glob("*") if p.is_file()}
    tries = {"move": "mv .git moved", "config": "echo x >> .git/config",
             "hook": "echo x > .git/hooks/post-commit", "info": "echo x > .git/info/attributes",
             "replace": "mv .git/config c && echo x > .git/config"}
    out = LocalEnvironment(repo, sandbox="bwrap").execute(
        "; ".join(f"{c}; echo {n}=$?" for n, c in tries.items()) + f"; {commit}", 10).output
    assert [f"{n}=1" in out for n in tries] == [True] * len(tries), out
    assert "commit=0" in out, out
    assert (repo / ".git" / "config").read_bytes() == before[repo / ".git" / "config"]
    assert not (repo / ".git" / "hooks" / "post-commit").exists()


@needs_sandbox
def test_what_a_roots_command_plants_in_its_repository_never_runs(
        redis: redis_lib.Redis, tmp_path: Path, marks: Path) -> None:
    """A root in its own repository's top folder: its commands plant a filter for the
    files they write, a commondir file naming a repository of theirs, a .git in a
    subfolder; the root's git (which found its repository before its commands ran) runs
    none of it as it seeds children, and finds the same repository again."""
    repo = make_repo(tmp_path / "repo")
    laptop = seeds(redis, tmp_path / "home-a")
    tree = laptop.pinned("root:s1", repo)
    assert tree == g.WorkTree(repo, repo / ".git")
    box = LocalEnvironment(repo, sandbox="bwrap", hide=(tmp_path / "home-a",))
    done = box.execute(f"{arm(marks)} && {evil_repo('evil.git')} && "
                       "{ cat evil.cfg >> .git/config; echo config=$?; } && "
                       "echo \"$PWD/evil.git\" > .git/commondir && "
                       "mkdir -p pkg && cd pkg && cp ../evil.cfg . && "
                       f"{evil_repo('.git')} && echo planted", 30)
    assert "config=1" in done.output and done.output.endswith("planted\n"), done.output
    try:
        again = laptop.pinned("root:s1", repo)  # as it resumes, attached elsewhere
        laptop.take(repo / "pkg", SWARM, tree_of=again)
        laptop.take(repo, SWARM, tree_of=again)
        assert again == tree
    finally:
        assert sorted(os.listdir(marks)) == []


# -- end to end: real workers --------------------------------------------------------------

#: In pkg/, each whether or not the other could be planted.
E2E_PLANT = "; ".join(f"( {PLANTS[name]} )" for name in ("own-config", "git-dir"))


@needs_sandbox
@pytest.mark.slow
def test_a_childs_planted_git_never_runs_on_a_real_worker(
        tmp_path: Path, marks: Path) -> None:
    """A root in a subfolder of a repository; its child (on a real worker, in the box, in
    that subfolder of its workspace) plants a config and hooks in its own repository and a
    .git folder, then calls a grandchild (the worker snapshots it as a parent, then lands
    the grandchild's work in it) and settles (the worker captures it); its work lands in
    the root's repository. No planted program runs anywhere."""
    from click.testing import CliRunner

    from swarm.cli import main
    from swarm.runtime.local import LocalCluster, wait_for
    from swarm.store.connection import connect
    from swarm.store.server import EmbeddedServer
    from swarm.testing.scripts import ByTask, tool_results
    from swarm.testing.server import Reply, ScriptedModelServer, ToolCall

    repo = make_repo(tmp_path / "repo")
    home = tmp_path / "home"
    script = ByTask({
        "ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "PLANT then call"})]),
                 lambda r: Reply(content=tool_results(r)[0])],
        "PLANT": [Reply(tool_calls=[ToolCall("run_cli", {
                      "command": f"{arm(marks)} && {{ {E2E_PLANT}; }}; echo planted"})]),
                  Reply(tool_calls=[ToolCall("agent", {"message": "LEAF write a file"})]),
                  lambda r: Reply(content="planted and called: " + tool_results(r)[0])],
        "LEAF": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo leaf > leaf.txt"})]),
                 Reply(content="leaf done")],
    })
    server = EmbeddedServer(home)
    url = server.ensure()
    try:
        cluster = LocalCluster(url, home, workers=1, concurrency=4,
                               env={"GIT_CONFIG_GLOBAL": os.environ["GIT_CONFIG_GLOBAL"]}
                               ).start()
        try:
            wait_for(connect(url), 30, cluster.procs)
            with ScriptedModelServer(responder=script) as model:
                env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_"))}
                env.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url,
                           SWARM_HOME=str(home), SWARM_API_KEY="sk-test", SWARM_RETRIES="1")
                result = CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C",
                                                   str(repo / "pkg"), "ROOT"],
                                            env=env, catch_exceptions=False)
        finally:
            cluster.stop()
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    child = cast("dict[str, Any]", json.loads(result.stdout))
    assert child["state"] == "done", child
    assert "planted and called" in child["answer"], child
    assert sorted(os.listdir(marks)) == []
    assert child["landing"] == "landed", child
    # What the child wrote and its grandchild's file landed in the user's folder.
    assert (repo / "pkg" / "pwn" / "fsmonitor").is_file()
    assert (repo / "pkg" / "leaf.txt").read_text() == "leaf\n"
    assert not (repo / "pkg" / ".git").exists()  # no planted repository
    assert not (repo / ".git" / "worktrees").exists()


def test_the_workers_git_runs_no_hook_of_the_users_repository(
        redis: redis_lib.Redis, tmp_path: Path, marks: Path) -> None:
    """Hooks and an fsmonitor the user configured for their own git are not run by the
    worker's (as root, on a child's workspace, on what commands wrote)."""
    repo = make_repo(tmp_path / "repo")
    hooks = repo / ".git" / "hooks"
    for name in HOOKS:
        (hooks / name).write_text(f"#!/bin/sh\ntouch {marks / name}\n")
        (hooks / name).chmod(0o755)
    (tmp_path / "fsmonitor").write_text(f"#!/bin/sh\ntouch {marks / 'fsmonitor'}\n")
    (tmp_path / "fsmonitor").chmod(0o755)
    sh(repo, "config", "core.fsmonitor", str(tmp_path / "fsmonitor"))
    laptop = seeds(redis, tmp_path / "home-a")
    sid = laptop.take(repo, SWARM, tree_of=g.discover(repo))
    host = seeds(redis, tmp_path / "home-w")
    child = host.child(SWARM, "a1", sid)
    (child.path / "new.txt").write_text("new\n")
    what_the_worker_does(host, child)
    assert sorted(os.listdir(marks)) == []
