"""The worker's own git (unconfined, root on a root worker) on workspaces sandboxed commands
wrote: a command in the box plants a repository, a ``.git`` file or folder, a worktree
config, hooks, filters and the like, each set to run a program; the worker then does
what it does with a child's workspace (capture it, commit it to its branch, snapshot it
as a parent, park it, find it again, bring a grandchild's work home into it), and the
program never runs. The worker's global config trusts every folder
(``safe.directory=*``, as many CI images and containers set), so git's ownership check
is not what stops it. The end-to-end case, through real workers, is at the bottom."""

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
from swarm.runtime import gitstate as g
from swarm.runtime import homecoming, parked
from swarm.runtime.seed import Seeds, Workspace
from swarm.store.snapshots import SnapshotStore
from swarm.workers import workspace as ws

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
#: subfolder of its worktree, as its parent worked in a subfolder of its repository),
#: after arm(). Its worktree's own .git file is out of its reach (tested below).
PLANTS = {
    # A .git file naming a git folder the command made.
    "git-file": f"{evil_repo('.evil')} && echo \"gitdir: $PWD/.evil\" > .git",
    # A git folder.
    "git-dir": evil_repo(".git"),
    # The worktree's own git folder (writable in the box) gets a config.worktree, which
    # git reads when the repository enables extensions.worktreeConfig.
    "worktree-config": "cp evil.cfg \"$(git rev-parse --absolute-git-dir)/config.worktree\"",
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


def what_the_worker_does(host: Seeds, child: Workspace) -> None:
    """Everything a worker's git does with a child's workspace after its commands ran."""
    assert host.capture(child, SWARM)  # it settles: its work is sent home
    ws.commit_changes(child, "swarm a1: settled")  # on its branch in the user's repository
    sid = host.take(child.path, SWARM, base=child.seed, tree_of=child.tree)  # as a parent
    parked.state(host, child, sid, SWARM, [])  # it parks
    again = host.found(child.path, SWARM, "a1", child.seed)  # a later run finds it
    assert again.tree == child.tree  # the same git folders, whatever its .git says
    grandchild = host.child(SWARM, "g1", sid)
    (grandchild.path / "from-g1.txt").write_text("g1\n")
    delta = host.capture(grandchild, SWARM)
    session = result_session(child.path, {"agent_id": "g1", "state": "done", "delta": delta,
                                          "seed": sid})
    homecoming.bring_home(host, session, child.path, SWARM, again.tree)
    body = json.loads(session.messages[-1]["content"])
    assert body.get("git_branch") == "swarm/g1", body


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
    assert child.home_branch and child.path == child.top / "pkg"
    box = LocalEnvironment(child.path, sandbox="bwrap", hide=(tmp_path / "home-w",))
    done = box.execute(f"{arm(marks)} && {PLANTS[plant]} && echo planted", 30)
    assert done.output.endswith("planted\n"), done.output
    try:
        what_the_worker_does(host, child)
    finally:  # first: what ran, whether or not the worker got through
        assert sorted(os.listdir(marks)) == []
    # The branch holds what the command wrote, and git in the box still works on it.
    log = sh(repo, "log", "--format=%s", "swarm/a1")
    assert log.split("\n")[0] == "swarm a1: settled", log
    assert "pkg/pwn/fsmonitor" in sh(repo, "ls-tree", "-r", "--name-only", "swarm/a1")


@needs_sandbox
def test_the_repository_files_the_workers_git_reads_are_read_only_in_the_box(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """What git reads as config, attributes, excludes or hooks in a child's repository
    cannot be written from its box; its worktree's own folder can (the worker's git
    never reads config from there)."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a").take(repo, SWARM, tree_of=g.discover(repo))
    child = seeds(redis, tmp_path / "home-w").child(SWARM, "a1", sid)
    common = repo / ".git"
    own = common / "worktrees" / "a1"
    targets = [common / "config", common / "config.worktree", common / "info" / "attributes",
               common / "info" / "exclude", common / "hooks" / "post-commit",
               common / "commondir", own / "commondir", own / "gitdir"]
    command = "; ".join(f"echo x >> {t}; echo {t.relative_to(common)}=$?" for t in targets)
    out = LocalEnvironment(child.path, sandbox="bwrap", hide=(tmp_path / "home-w",)).execute(
        f"{command}; echo x > {own}/config.worktree; echo own=$?", 10).output
    for target in targets:
        assert f"{target.relative_to(common)}=1" in out, out
    assert "own=0" in out, out
    assert not (common / "config.worktree").exists()
    assert not (common / "info" / "attributes").exists()


@needs_sandbox
def test_git_works_in_the_box_of_a_child_seeded_from_a_subfolder(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """A parent working in a subfolder of its repository seeds children that work in that
    subfolder of their worktree: the box binds the worktree's git from above it."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a").take(repo / "pkg", SWARM,
                                                 tree_of=g.discover(repo / "pkg"))
    child = seeds(redis, tmp_path / "home-w").child(SWARM, "a1", sid)
    assert child.path == child.top / "pkg"
    result = LocalEnvironment(child.path, sandbox="bwrap", hide=(tmp_path / "home-w",)).execute(
        "echo more >> code.txt && git -c user.name=c -c user.email=c@c commit -qam box && "
        "git log --format=%s -1", 10)
    assert result.output == "box\n", result.output
    assert sh(repo, "log", "--format=%s", "-1", "swarm/a1") == "box\n"


@needs_sandbox
def test_a_workspaces_own_git_stays_where_it_is_in_the_box(
        redis: redis_lib.Redis, tmp_path: Path) -> None:
    """A worktree's .git file, and a repository's own .git folder with what git obeys in
    it (a root's or a job's folder), cannot be moved, replaced or rewritten from the box;
    git still commits there."""
    repo = make_repo(tmp_path / "repo")
    sid = seeds(redis, tmp_path / "home-a").take(repo, SWARM, tree_of=g.discover(repo))
    child = seeds(redis, tmp_path / "home-w").child(SWARM, "a1", sid)
    commit = "git -c user.name=c -c user.email=c@c commit -q --allow-empty -m box; echo commit=$?"
    tries = {"write": "echo 'gitdir: /tmp' > .git", "move": "mv .git moved",
             "remove": "rm -f .git"}
    out = LocalEnvironment(child.path, sandbox="bwrap", hide=(tmp_path / "home-w",)).execute(
        "; ".join(f"{c}; echo {n}=$?" for n, c in tries.items()) + f"; {commit}", 10).output
    assert [f"{n}=1" in out for n in tries] == [True] * len(tries), out
    assert "commit=0" in out, out
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
E2E_PLANT = "; ".join(f"( {PLANTS[name]} )" for name in ("worktree-config", "git-dir"))


@needs_sandbox
@pytest.mark.slow
def test_a_childs_planted_git_never_runs_on_a_real_worker(
        tmp_path: Path, marks: Path) -> None:
    """A root in a subfolder of a repository; its child (on a real worker, in the box, in
    that subfolder of its worktree) plants a worktree config and a .git folder, then calls
    a grandchild (the worker snapshots it as a
    parent) and settles (the worker captures it and commits it to its branch); the root
    brings its work home. No planted program runs anywhere."""
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
    files = sh(repo, "ls-tree", "-r", "--name-only", child["git_branch"])
    assert "pkg/pwn/fsmonitor" in files, files


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
