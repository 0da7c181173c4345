"""run_cli inside bubblewrap: the workspace writable, the rest read-only, SWARM_HOME hidden,
an allowlisted environment, network optional; how SWARM_SANDBOX is chosen. The escape
attempts are tests/test_sandbox_escape.py."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from swarm.agent import grants as sandbox_grants
from swarm.agent import later, sandbox
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings
from swarm.errors import ConfigError, ToolError
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
needs_sandbox = pytest.mark.skipif(not sandbox.probe().ok,
                                   reason=f"no sandbox here: {sandbox.probe().reason}")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a root runner's box needs root")



@needs_sandbox
def test_workspace_writable_rest_read_only(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    outside = Path("/usr") / f"swarm-sandbox-{tmp_path.name}.txt"
    env = LocalEnvironment(ws, sandbox="bwrap")
    result = env.execute(f"echo in > inside.txt && pwd && touch {outside}", 10)
    assert (ws / "inside.txt").read_text() == "in\n"
    assert str(ws) in result.output
    assert "Read-only file system" in result.output  # a system folder: shown, read-only
    assert result.exit_code != 0
    assert not outside.exists()
    private = env.execute(f"touch /tmp/x-{tmp_path.name} && ls /tmp", 10)
    assert private.exit_code == 0  # a private /tmp: tools that need one work
    assert not (Path("/tmp") / f"x-{tmp_path.name}").exists()


@needs_sandbox
def test_network_can_be_cut(tmp_path: Path) -> None:
    env = LocalEnvironment(tmp_path, sandbox="bwrap", network=False)
    result = env.execute("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '", 10)
    assert result.output.split() == ["lo"]


@needs_sandbox
def test_swarm_home_is_hidden_but_a_workspace_in_it_is_not(tmp_path: Path) -> None:
    home = tmp_path / "home"
    ws = home / "workspaces" / "s1" / "a1"
    ws.mkdir(parents=True)
    (home / "hints.md").write_text("private\n")
    env = LocalEnvironment(ws, sandbox="bwrap", hide=(home,))
    result = env.execute(f"echo child > out.txt; ls -A {home}; cat {home}/hints.md", 10)
    assert (ws / "out.txt").read_text() == "child\n"
    assert result.output.split("\n")[0] == "workspaces"  # nothing else of the home shows
    assert "private" not in result.output


@needs_sandbox
def test_git_works_in_a_worktree_whose_repository_is_in_a_hidden_folder(
        tmp_path: Path) -> None:
    """A seeded child's workspace is a git worktree of SWARM_HOME's host cache, which the
    box hides: git in the workspace still reads and writes its repository, and the
    runner's own git works on what the box wrote (a root runner's box is another uid)."""
    home = tmp_path / "home"
    cache, ws = home / "seeds" / "cache.git", home / "workspaces" / "s1" / "a1"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(cache)], check=True)
    (cache / "f.txt").write_text("seed\n")
    subprocess.run([*git, "-C", str(cache), "add", "f.txt"], check=True)
    subprocess.run([*git, "-C", str(cache), "commit", "-qm", "seed"], check=True)
    subprocess.run([*git, "-C", str(cache), "worktree", "add", "-q", "-b", "swarm/a1",
                    str(ws)], check=True)
    env = LocalEnvironment(ws, sandbox="bwrap", hide=(home,))
    result = env.execute("echo more >> f.txt && git -c user.name=c -c user.email=c@c "
                         "commit -qam child && git branch --list 'swarm/*' && cat f.txt", 10)
    assert result.exit_code == 0, result.output
    assert result.output.split() == ["*", "swarm/a1", "seed", "more"], result.output
    log = subprocess.run(["git", "-C", str(cache), "log", "--format=%s", "swarm/a1"],
                         capture_output=True, text=True, check=True)
    assert log.stdout.split() == ["child", "seed"]
    (ws / "by-runner.txt").write_text("runner\n")
    again = env.execute("echo box > by-box.txt && echo box >> by-runner.txt && git add -A && "
                        "git -c user.name=c -c user.email=c@c commit -qm box", 10)
    assert again.exit_code == 0, again.output
    subprocess.run(["git", "-C", str(ws), "status", "--porcelain"], check=True)
    (ws / "by-box.txt").write_text("runner again\n")
    subprocess.run([*git, "-C", str(ws), "commit", "-qam", "runner"], check=True)
    log = subprocess.run(["git", "-C", str(cache), "log", "--format=%s", "swarm/a1"],
                         capture_output=True, text=True, check=True)
    assert log.stdout.split() == ["runner", "box", "child", "seed"]


@needs_sandbox
def test_git_works_in_a_view_whose_worktree_is_registered_on_its_upper_folder(
        tmp_path: Path) -> None:
    """A copy-on-write view shows its upper folder's ``.git`` file, whose worktree folder
    names the upper folder back, not the view: with ``linked`` the box binds that git."""
    repo, upper, ws = tmp_path / "repo", tmp_path / "views" / "a1" / "a1", tmp_path / "ws"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-q", "--allow-empty", "-m", "seed"],
                   check=True)
    subprocess.run([*git, "-C", str(repo), "worktree", "add", "-q", "-b", "swarm/a1",
                    str(upper)], check=True)
    shutil.copytree(upper, ws)  # what the mounted view shows (its files and .git file)
    command = "git -c user.name=c -c user.email=c@c commit -q --allow-empty -m box && echo ok"
    unlinked = LocalEnvironment(ws, sandbox="bwrap", hide=(tmp_path,)).execute(command, 10)
    assert "not a git repository" in unlinked.output, unlinked.output
    linked = LocalEnvironment(ws, sandbox="bwrap", hide=(tmp_path,), linked=upper)
    assert linked.execute(command, 10).output == "ok\n"
    log = subprocess.run(["git", "-C", str(repo), "log", "--format=%s", "swarm/a1"],
                         capture_output=True, text=True, check=True)
    assert log.stdout.split() == ["box", "seed"]


@needs_sandbox
def test_what_the_workers_git_obeys_stays_read_only_in_a_worktree(tmp_path: Path) -> None:
    """The worker's own git (unconfined) reads the repository's config and hooks and the
    worktree's pointers to it: the box writes objects, refs and reflogs only."""
    repo, ws = tmp_path / "repo", tmp_path / "ws"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-q", "--allow-empty", "-m", "seed"],
                   check=True)
    subprocess.run([*git, "-C", str(repo), "worktree", "add", "-q", "-b", "w", str(ws)],
                   check=True)
    common, own = repo / ".git", repo / ".git" / "worktrees" / "ws"
    before = {p: p.read_bytes() for p in (common / "config", own / "commondir", own / "gitdir")}
    result = LocalEnvironment(ws, sandbox="bwrap").execute(
        "git config core.fsmonitor 'touch /var/tmp/owned'; echo config=$?; "
        f"echo evil > {common}/hooks/reference-transaction; echo hook=$?; "
        f"echo evil > {common}/config; echo config2=$?; "
        f"echo /tmp > {own}/commondir; echo commondir=$?; "
        f"mv {own}/gitdir {own}/gone; echo gitdir=$?; "
        "git -c user.name=c -c user.email=c@c commit -q --allow-empty -m box; echo commit=$?",
        10)
    out = result.output
    for name in ("config", "hook", "config2", "commondir", "gitdir"):
        assert f"\n{name}=0\n" not in f"\n{out}", out
    assert "commit=0" in out, out
    assert {p: p.read_bytes() for p in before} == before
    assert not (common / "hooks" / "reference-transaction").exists()


@needs_sandbox
@as_root
def test_a_root_runner_runs_the_box_as_the_sandbox_uid(outside_tmp: Path) -> None:
    ws = outside_tmp / "ws"
    (ws / "old").mkdir(parents=True)
    (ws / "old" / "mine.txt").write_text("root's\n")
    env = LocalEnvironment(ws, sandbox="bwrap", sandbox_uid=4242)
    assert env.choice.summary == ("bwrap (uid 65534, host uid 4242, no capabilities, seccomp, "
                                  "network: user-mode, host and Redis unreachable)")
    first = env.execute("echo box >> old/mine.txt && echo new > new.txt && id -u", 10)
    assert first.exit_code == 0 and first.output == "65534\n", first.output
    assert (ws / "new.txt").stat().st_uid == 4242
    assert (ws / "old" / "mine.txt").read_text() == "root's\nbox\n"
    # What root adds later (git checking out, a seed brought home) is the box's too.
    (ws / "later").mkdir()
    (ws / "later" / "added.txt").write_text("added\n")
    (ws / "added.txt").write_text("added\n")
    later = env.execute("echo box >> later/added.txt && echo box >> added.txt && "
                        "mkdir later/deeper && echo ok", 10)
    assert later.output == "ok\n", later.output


@needs_sandbox
def test_a_git_file_written_in_the_box_opens_nothing_outside(outside_tmp: Path) -> None:
    """The box may write its workspace's ``.git`` file: a folder it names is neither bound
    writable nor granted at the next command, nor at the next agent's in that workspace."""
    ws, private = outside_tmp / "ws", outside_tmp / "private"
    ws.mkdir()
    (private / "worktrees" / "w").mkdir(parents=True)
    (private / "objects").mkdir()
    (private / "secret").write_text("root only\n")
    (private / "secret").chmod(0o600)
    env = LocalEnvironment(ws, sandbox="bwrap")
    env.execute(f"echo 'gitdir: {private}' > .git", 10)
    attempts = f"cat {private}/secret; echo x > {private}/planted; echo w=$?"
    for named in (private, private / "worktrees" / "w", private / "worktrees" / "w"):
        result = env.execute(f"{attempts}; echo 'gitdir: {named}' > .git", 10)
        assert "root only" not in result.output and "w=1" in result.output, result.output
        env = LocalEnvironment(ws, sandbox="bwrap")  # the next one starts afresh
    assert not (private / "planted").exists()
    for path in (private, private / "secret"):
        with pytest.raises(OSError) as no_acl:
            os.getxattr(path, "system.posix_acl_access")
        assert no_acl.value.errno == errno.ENODATA


@needs_sandbox
@as_root
def test_the_trial_fails_a_box_that_is_root_on_the_host(
        monkeypatch: pytest.MonkeyPatch, outside_tmp: Path) -> None:
    """A root worker's trial checks the box is not host uid 0: a ``setpriv`` that does not
    switch (the box as root's, as before SWARM_SANDBOX_UID) fails it."""
    fake = outside_tmp / "setpriv"
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{outside_tmp}:{os.environ['PATH']}")
    sandbox.probe.cache_clear()
    try:
        found = sandbox.probe()
        assert not found.ok
        assert "could read a file only root may read" in found.reason, found
        assert f"owner was uid 0, not {sandbox.UID}" in found.reason, found
        assert "as set" not in found.reason and "could not write" not in found.reason, found
    finally:
        sandbox.probe.cache_clear()


@needs_sandbox
@as_root
def test_a_link_in_the_workspace_passes_no_grant_on(outside_tmp: Path) -> None:
    """The grants never follow a link: a box cannot plant one to reach a root-only file at
    the next command (symbolic or, on one filesystem, hard)."""
    ws, private = outside_tmp / "ws", outside_tmp / "private"
    ws.mkdir()
    private.mkdir()
    targets = [private / "by-symlink", private / "by-hardlink"]
    for target in targets:
        target.write_text("root only\n")
        target.chmod(0o600)
    (ws / "sym").symlink_to(targets[0])
    os.link(targets[1], ws / "hard")
    private.chmod(0o700)
    (ws / "folder").symlink_to(private)  # a link to a folder: not walked into
    result = LocalEnvironment(ws, sandbox="bwrap").execute(
        "cat sym; echo sym=$?; cat hard; echo hard=$?; ls folder; echo folder=$?", 10)
    assert "root only" not in result.output and "by-symlink" not in result.output
    assert "sym=1" in result.output and "hard=1" in result.output, result.output
    # The folder is not listed (not there at all when the box does not show /var/tmp).
    assert "by-hardlink" not in result.output, result.output
    for target in [*targets, private]:
        with pytest.raises(OSError) as no_acl:
            os.getxattr(target, "system.posix_acl_access")
        assert no_acl.value.errno == errno.ENODATA


def no_acl(*paths: Path) -> bool:
    """Whether none of ``paths`` has an ACL entry (access or default) of its own."""
    for path in paths:
        for name in ("system.posix_acl_access", "system.posix_acl_default"):
            try:
                os.getxattr(path, name, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.ENODATA, errno.EACCES):
                    raise
            else:
                return False
    return True


def root_only(folder: Path) -> Path:
    """``folder`` made root-only (0700), holding a root-only (0600) ``secret``."""
    folder.mkdir(mode=0o700, parents=True)
    secret = folder / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    return secret


@needs_sandbox
@as_root
@pytest.mark.parametrize("swapped", ["workspace", "folder above it"])
def test_a_workspace_swapped_for_a_link_after_its_check_is_refused_and_granted_nothing(
        outside_tmp: Path, swapped: str) -> None:
    """A job's workspace (or a folder between it and its jobs root) replaced by a link to
    a root-only folder after it was checked: the box's first command is refused, saying
    why, and neither that folder nor its secret gets an ACL entry or is read."""
    root, private = outside_tmp / "jobs", outside_tmp / "private"
    ws = root / "team" / "ws"
    ws.mkdir(parents=True)
    secret = root_only(private / "ws")
    env = LocalEnvironment(ws, sandbox="bwrap", sandbox_uid=4242, beneath=root)
    if swapped == "workspace":
        ws.rmdir()
        ws.symlink_to(private / "ws")
        link = ws
    else:
        shutil.rmtree(root / "team")
        (root / "team").symlink_to(private)
        link = root / "team"
    with pytest.raises(ToolError) as refused:
        env.execute("cat secret; echo planted > written", 10)
    assert f"{link} is a symbolic link" in str(refused.value)
    assert str(root) in str(refused.value)
    assert no_acl(private, private / "ws", secret)
    assert not (private / "ws" / "written").exists()


@needs_sandbox
@as_root
def test_a_workspace_beneath_its_root_is_opened_and_granted(outside_tmp: Path) -> None:
    """The same job's workspace as it was checked: the box works in it as the sandbox uid,
    whose ACL entries land on the workspace, not on the root above it."""
    root = outside_tmp / "jobs"
    ws = root / "team" / "ws"
    ws.mkdir(parents=True)
    root.chmod(0o700)  # only the box's search entry lets bubblewrap reach the workspace
    env = LocalEnvironment(ws, sandbox="bwrap", sandbox_uid=4242, beneath=root)
    result = env.execute("echo box > made.txt && id -u", 10)
    assert result.exit_code == 0 and result.output == "65534\n", result.output
    assert (ws / "made.txt").stat().st_uid == 4242
    assert not no_acl(ws) and not no_acl(root)
    assert os.getxattr(root, "system.posix_acl_access")  # search only, not read
    entries = sandbox_grants.decode(os.getxattr(root, "system.posix_acl_access"))
    assert (sandbox_grants.USER, 1, 4242) in entries


@needs_sandbox
@as_root
def test_a_parent_workspace_swapped_for_a_link_opens_no_way_to_where_it_leads(
        outside_tmp: Path) -> None:
    """A child's parent's workspace (shown read-only) replaced by a link to a folder in a
    root-only one: no search entry is given on the root-only folder, so nothing in it is
    read."""
    ws, private = outside_tmp / "ws", outside_tmp / "private"
    ws.mkdir()
    secret = root_only(private / "inner")
    (private / "inner" / "open.txt").write_text("readable by its mode\n")
    (private / "inner" / "open.txt").chmod(0o644)
    (private / "inner").chmod(0o755)
    private.chmod(0o700)  # only a search entry on it would let the box in
    parent = outside_tmp / "parent"
    parent.symlink_to(private / "inner")
    result = LocalEnvironment(ws, sandbox="bwrap", sandbox_uid=4242,
                              read_only=(parent,)).execute(f"cat {parent}/open.txt", 10)
    assert "readable by its mode" not in result.output, result.output
    assert no_acl(private, private / "inner", secret)


@needs_sandbox
def test_a_childs_parent_workspace_is_shown_read_only_even_in_swarm_home(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    parent, ws = home / "jobs" / "j1", home / "workspaces" / "s1" / "a1"
    for folder in (parent, ws):
        folder.mkdir(parents=True)
    (parent / "data.txt").write_text("from the parent\n")
    env = LocalEnvironment(ws, sandbox="bwrap", hide=(home,), read_only=(parent,))
    result = env.execute(f"cat {parent}/data.txt; echo x > {parent}/new.txt; echo w=$?; "
                         "echo mine > mine.txt", 10)
    assert result.output.startswith("from the parent\n"), result.output
    assert "Read-only file system" in result.output and "w=1" in result.output
    assert (ws / "mine.txt").read_text() == "mine\n" and not (parent / "new.txt").exists()


@needs_sandbox
def test_a_childs_box_cannot_read_its_parents_env_in_place(
        redis: redis_lib.Redis, outside_tmp: Path) -> None:
    """A same-host child's box hides its parent's folder (its .env, what seeding left out)
    even where the box shows the folder that holds it, as a deployment's /opt or
    SWARM_SANDBOX_SHOW would; the objects its own repository borrows from the parent's
    stay readable, so its git works."""
    from swarm.runtime.build import build_agent, new_session
    from swarm.store.snapshots import SnapshotStore
    from swarm.workspace import gitstate as g
    from swarm.workspace.seed import Seeds
    from tests.helpers import MemoryHints

    parent, home = outside_tmp / "project", outside_tmp / "home"
    parent.mkdir()
    subprocess.run(["git", "init", "-q", str(parent)], check=True)
    (parent / "app.py").write_text("print('app')\n")
    subprocess.run(["git", "-C", str(parent), "-c", "user.name=t", "-c", "user.email=t@t",
                    "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(parent), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "base"], check=True)
    (parent / ".env").write_text("PARENT_SECRET=1\n")
    seeds = Seeds(SnapshotStore(redis), home, "here", view="checkout")
    sid = seeds.take(parent, "sx", tree_of=g.discover(parent))
    child = seeds.child("sx", "cx", sid)
    assert child.odb is not None
    settings = Settings(home=home, sandbox="bwrap", sandbox_show=str(outside_tmp))
    agent = build_agent(settings, child.path, None, new_session(child.path),  # type: ignore[arg-type]
                        store=None, hints=MemoryHints(), approver=lambda r: "y",
                        read_only=(child.odb / "objects",), hidden=(parent,))
    result = agent.env.execute(f"cat {parent}/.env; echo env=$?; git log --format=%s; "
                               "cat app.py; ls .env; echo ls=$?", 10)
    assert "PARENT_SECRET" not in result.output and "env=1" in result.output, result.output
    assert "base" in result.output and "print('app')" in result.output  # its git works
    assert "ls=2" in result.output  # seeding left the .env out, too


@needs_sandbox
def test_a_hidden_folder_inside_another_hidden_one_is_hidden_with_it(tmp_path: Path) -> None:
    """A job's child: its parent's folder (hidden) is inside SWARM_HOME (hidden too)."""
    home = tmp_path / "home"
    parent, ws = home / "jobs" / "j1", home / "workspaces" / "s1" / "a1"
    for folder in (parent, ws):
        folder.mkdir(parents=True)
    (parent / ".env").write_text("SECRET=1\n")
    result = LocalEnvironment(ws, sandbox="bwrap", hide=(home, parent)).execute(
        f"cat {parent}/.env; echo mine > mine.txt && echo wrote", 10)
    assert "SECRET" not in result.output and "wrote" in result.output, result.output


@needs_sandbox
def test_a_swarm_home_inside_the_workspace_stays_hidden(tmp_path: Path) -> None:
    home = tmp_path / ".swarm"
    home.mkdir()
    (home / "hints.md").write_text("private\n")
    env = LocalEnvironment(tmp_path, sandbox="bwrap", hide=(home,))
    result = env.execute("ls -A .swarm; cat .swarm/hints.md; echo x > mine.txt", 10)
    assert result.output == "cat: .swarm/hints.md: No such file or directory\n"  # ls: nothing
    assert (tmp_path / "mine.txt").exists()


@needs_sandbox
def test_a_sandboxed_command_gets_an_allowlisted_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARM_TEST_HIDDEN", "hidden-value")
    monkeypatch.setenv("SWARM_TEST_NAMED", "named-value")
    monkeypatch.setenv("LC_TEST_SANDBOX", "locale-value")
    monkeypatch.setenv("SWARM_API_KEY", "sk-never")
    env = LocalEnvironment(tmp_path, sandbox="bwrap", extra_env={"SWARM_AGENT_ID": "a1"},
                           pass_env=("SWARM_TEST_NAMED",))
    lines = set(env.execute("env", 10).output.splitlines())
    assert {"SWARM_AGENT_ID=a1", "SWARM_TEST_NAMED=named-value", "PAGER=cat",
            "LC_TEST_SANDBOX=locale-value", f"PATH={os.environ['PATH']}"} <= lines
    assert not any(line.startswith(("SWARM_TEST_HIDDEN=", "SWARM_API_KEY=")) for line in lines)


@needs_sandbox
def test_the_seccomp_program_is_passed_and_closed(tmp_path: Path) -> None:
    before = set(os.listdir("/proc/self/fd"))
    result = LocalEnvironment(tmp_path, sandbox="bwrap").execute(
        "grep Seccomp: /proc/self/status", 10)
    assert result.output.split()[:2] == ["Seccomp:", "2"]
    leaked = [fd for fd in set(os.listdir("/proc/self/fd")) - before
              if stat.S_ISFIFO(os.stat(f"/proc/self/fd/{fd}").st_mode)]
    assert leaked == []


def test_choices(monkeypatch: pytest.MonkeyPatch, outside_tmp: Path) -> None:
    tmp_path = outside_tmp  # a root runner starts bubblewrap as uid 65534: it must reach it
    none = sandbox.choose("none")
    assert none.box is None and "unconfined" in none.notice and not none.refuse
    if sandbox.probe().ok:
        assert sandbox.choose("auto").box is not None
        assert sandbox.choose("bwrap").box is not None
    # Where bubblewrap fails: a root runs unconfined with a notice (auto) or stops (bwrap);
    # a worker refuses children whatever it was asked, but for an explicit none.
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    sandbox.probe.cache_clear()
    try:
        auto = sandbox.choose("auto")
        assert auto.box is None and "setting up uid map" in auto.notice
        with pytest.raises(ConfigError, match="setting up uid map"):
            sandbox.choose("bwrap")
        default = sandbox.for_worker(Settings())
        assert "setting up uid map" in default.refuse and "SWARM_SANDBOX=none" in default.refuse
        assert sandbox.for_worker(Settings().with_(sandbox="auto")).refuse
        explicit = sandbox.for_worker(Settings().with_(sandbox="none"))
        assert explicit.box is None and not explicit.refuse
        assert explicit.summary == "none (commands run unconfined)"
        # A terminal root's local worker: unconfined roots' children run, the rest refused.
        monkeypatch.setenv(sandbox.FALLBACK, "1")
        local = sandbox.for_worker(Settings())
        assert local.refuse and "setting up uid map" in local.fallback
        assert sandbox.unboxed(["none (commands run unconfined)", local.summary]) == \
            local.fallback
        assert not sandbox.for_worker(Settings().with_(sandbox="auto")).fallback
        monkeypatch.delenv(sandbox.FALLBACK)
        assert not sandbox.for_worker(Settings()).fallback
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        sandbox.probe.cache_clear()
        assert "apt-get install bubblewrap" in sandbox.choose("auto").notice
    finally:
        sandbox.probe.cache_clear()  # the next test tries again, with the whole PATH


@needs_sandbox
@as_root
def test_what_root_adds_to_a_repository_after_its_grant_is_the_next_boxs_too(
        outside_tmp: Path) -> None:
    """A repository's objects, refs and logs are granted to the box's uid once per process
    (its worktrees' boxes share them): what the runner's git adds there later (new object
    folders, reflogs) is writable by the next worktree's box all the same."""
    repo = outside_tmp / "repo"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-q", "--allow-empty", "-m", "seed"],
                   check=True)
    commit = ("for i in 1 2 3 4 5 6 7 8; do echo $i$RANDOM > f$i; done; git add -A && "
              "git -c user.name=c -c user.email=c@c commit -qm box && echo ok")
    for name in ("w1", "w2"):
        # The runner's git first: new object folders and reflogs, root's, after the grant.
        for i in range(8):
            (repo / f"r{i}").write_text(f"{name} {i} {uuid.uuid4()}\n")
        subprocess.run([*git, "-C", str(repo), "add", "-A"], check=True)
        subprocess.run([*git, "-C", str(repo), "commit", "-qm", f"runner {name}"], check=True)
        subprocess.run([*git, "-C", str(repo), "worktree", "add", "-q", "-b", name,
                        str(outside_tmp / name)], check=True)
        result = LocalEnvironment(outside_tmp / name, sandbox="bwrap").execute(commit, 10)
        assert result.output == "ok\n", result.output


@needs_sandbox
@pytest.mark.skipif(not sandbox.pdeathsig_setpriv(), reason="setpriv with --pdeathsig is not here")
def test_a_boxed_command_whose_runner_died_before_it_started_does_not_run(
        outside_tmp: Path) -> None:
    """A worker killed between the fork of a box and bubblewrap's own parent-death signal
    (set inside it, later) left the box running its command, orphaned, after the lease
    could have been handed over. Here the runner exits before the box's process execs at
    all; the command must not run."""
    ws = outside_tmp / "ws"
    ws.mkdir()
    runner = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from swarm.agent.sandbox import program_fd\n"
        "from swarm.agent.shell import LocalEnvironment\n"
        f"env = LocalEnvironment(Path({str(ws)!r}), sandbox='bwrap', die_with_runner=True)\n"
        "assert env.execute('true', 30).exit_code == 0\n"  # its grants made, as a worker's
        "fd = program_fd()\n"
        "os.set_inheritable(fd, True)\n"
        "argv, environ = env.argv('echo ran > ran', fd), env.env()\n"
        "parent = os.getpid()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    while os.getppid() == parent:\n"
        "        time.sleep(0.01)\n"  # until the runner is gone
        "    os.execvpe(argv[0], argv, environ)\n"
        "print(pid, flush=True)\n"
        "os._exit(0)\n")
    started = subprocess.run([sys.executable, "-c", runner], check=True, timeout=60,
                             capture_output=True, text=True, cwd=ROOT)
    orphan = Path(f"/proc/{int(started.stdout)}")
    wait_until(lambda: not orphan.exists(), "the orphaned box to end", timeout=30)
    assert not (ws / "ran").exists(), "the command ran after its runner had died"


@needs_sandbox
@pytest.mark.skipif(not sandbox.pdeathsig_setpriv(), reason="setpriv with --pdeathsig is not here")
def test_a_box_that_waits_for_its_worker_never_runs_once_the_worker_died_before_its_guard(
        outside_tmp: Path) -> None:
    """A box that waits for its worker (its network slot, its cgroup) says "up" only after
    ``setpriv`` set its parent-death signal, and runs only at the worker's "go": that
    handshake is its guard (no RUNNER_GUARD shell). Here the worker dies while the box is
    still in ``setpriv`` (a stand-in that waits for that, then runs the real one), without
    the runner's pipe; the command must not run."""
    ws = outside_tmp / "ws"
    ws.mkdir()
    fake, started = outside_tmp / "bin", outside_tmp / "started"
    fake.mkdir()
    (fake / "setpriv").write_text(
        "#!/bin/sh\n"
        f"echo $$ > {started}.new && mv {started}.new {started}\n"
        "while [ \"$(cut -d' ' -f4 /proc/$$/stat)\" = \"$PPID\" ]; do sleep 0.01; done\n"
        f"exec {sandbox.pdeathsig_setpriv()} \"$@\"\n")
    (fake / "setpriv").chmod(0o755)
    runner = (
        "import os, threading, time\n"
        "from pathlib import Path\n"
        "from swarm.agent.sandbox import Launch, program_fd\n"
        "from swarm.agent.shell import LocalEnvironment\n"
        f"ws = Path({str(ws)!r})\n"
        "env = LocalEnvironment(ws, sandbox='bwrap', die_with_runner=True)\n"
        "assert env.execute('true', 30).exit_code == 0\n"  # its grants and slot made
        "box, fd = env.choice.box, program_fd()\n"
        f"environ = dict(env.env(), PATH={str(fake)!r} + ':' + env.env()['PATH'])\n"
        "threading.Thread(target=Launch, daemon=True, args=(box, lambda hs: box.argv(\n"
        "    'echo ran > ran', ws, fd, runner=os.getpid(), handshake=hs)),\n"
        "    kwargs=dict(pass_fds=(fd,), cwd=ws, env=environ)).start()\n"
        f"while not os.path.exists({str(started)!r}):\n"
        "    time.sleep(0.01)\n"
        "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", runner], check=True, timeout=60, cwd=ROOT)
    orphan = Path(f"/proc/{int(started.read_text())}")
    wait_until(lambda: not orphan.exists(), "the orphaned box to end", timeout=30)
    assert not (ws / "ran").exists(), "the command ran after its worker had died"


def _children(pid: int) -> list[str]:
    try:
        return [c for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _age(pid: int) -> float:
    """Seconds since process ``pid`` started (inf: gone)."""
    try:
        start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return float("inf")
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start / os.sysconf("SC_CLK_TCK")


def _box_processes(ws: Path) -> list[int]:
    """Pids of the processes whose command line names ``ws`` (its boxes' bubblewrap)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(ws).encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


@needs_sandbox
def test_boxes_being_set_up_when_their_runner_is_killed_never_run_their_command(
        outside_tmp: Path) -> None:
    """bubblewrap sets its box's parent-death signal once the box is set up: a worker
    SIGKILLed meanwhile left boxes to start their commands orphaned (the sandboxed chaos
    campaign saw 12 such commands in a 3-minute run). A runner starts 16 boxes at once and
    is killed as soon as it started them; none of their commands may run."""
    ws = outside_tmp / "ws"
    ws.mkdir()
    runner = (
        "import sys, threading\n"
        "from pathlib import Path\n"
        "from swarm.agent.shell import LocalEnvironment\n"
        f"ws = Path({str(ws)!r})\n"
        "env = LocalEnvironment(ws, sandbox='bwrap', die_with_runner=True)\n"
        "assert env.execute('true', 30).exit_code == 0\n"  # its grants made, as a worker's
        "for i in range(16):\n"
        "    threading.Thread(target=env.execute, args=(f'sleep 1; echo ran > ran{i}', 30),\n"
        "                     daemon=True).start()\n"
        "print('started', flush=True)\n"
        "threading.Event().wait(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "started"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    try:
        # A box whose outer bubblewrap died before it let the box go on stays stuck, for
        # good, before it runs anything (bubblewrap's, with or without the runner's pipe):
        # done when no box process has a child (a command) and none is new (setting up).
        wait_until(lambda: all(not _children(p) and _age(p) > 3 for p in _box_processes(ws)),
                   "the killed runner's boxes to end or stall", timeout=60)
        assert sorted(p.name for p in ws.glob("ran*")) == [], \
            "commands ran after their runner died"
    finally:
        for pid in _box_processes(ws):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@needs_sandbox
def test_a_boxed_commands_background_jobs_and_output_are_its_own(outside_tmp: Path) -> None:
    """The runner's watcher in a worker's box is no job of the command's shell (``wait``
    returns) and holds none of its output open (the output ends with the command)."""
    ws = outside_tmp / "ws"
    ws.mkdir()
    env = LocalEnvironment(ws, sandbox="bwrap", die_with_runner=True)
    result = env.execute("sleep 0.2 & wait; jobs | wc -l; echo done", 30)
    assert (result.exit_code, result.output) == (0, "0\ndone\n")


@needs_sandbox
def test_the_boxs_git_keeps_the_git_config_a_command_was_given(
        outside_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The box adds its stat check to git's config variables after the ones the operator
    passes (SWARM_SANDBOX_ENV), instead of replacing them."""
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "user.name")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "the operator")
    ws = outside_tmp / "ws"
    ws.mkdir()
    env = LocalEnvironment(ws, sandbox="bwrap", pass_env=("GIT_CONFIG_*",))
    result = env.execute("git config --get user.name; git config --get core.checkStat", 30)
    assert result.output.split("\n")[:2] == ["the operator", "minimal"], result.output


@needs_sandbox
@as_root
def test_a_fork_bomb_in_one_box_does_not_stop_a_siblings_command(outside_tmp: Path) -> None:
    """Each box has its own cgroup's pids limit: a bomb filling its own does not take the
    processes its sibling (another child on the same worker) needs."""
    from swarm.agent.cgroups import Limits

    ws = outside_tmp / "ws"
    ws.mkdir()
    limits = Limits(pids=64)
    bomb_env = LocalEnvironment(ws, sandbox="bwrap", limits=limits, die_with_runner=True)
    tree = sandbox.cgroup_tree(limits)
    assert not isinstance(tree, str), tree
    results: list[object] = []
    bomb = threading.Thread(target=lambda: results.append(bomb_env.execute(
        "b() { b | b & }; b; sleep 30", 60)))
    bomb.start()
    try:
        def full() -> bool:
            for group in tree.bases["pids"].glob("box-*"):
                with contextlib.suppress(OSError):
                    if int((group / "pids.current").read_text()) >= limits.pids:
                        return True
            return False

        wait_until(full, "the bomb to fill its box's pids limit")
        sibling = LocalEnvironment(ws, sandbox="bwrap", limits=limits, die_with_runner=True)
        result = sibling.execute("for i in $(seq 20); do sh -c 'echo $$' >/dev/null; done; "
                                 "echo sibling ran", 30)
        assert result.output == "sibling ran\n", result.output
    finally:
        bomb_env.cancel = threading.Event()
        bomb_env.cancel.set()
        bomb.join(60)
    assert "limit of 64 processes and threads (SWARM_SANDBOX_PIDS)" in str(results), results



@needs_sandbox
@as_root
@pytest.mark.parametrize("lasting", [True, False], ids=["lasting", "per-command"])
def test_a_box_whose_first_process_cannot_join_its_cgroup_runs_nothing(
        outside_tmp: Path, monkeypatch: pytest.MonkeyPatch, lasting: bool) -> None:
    """bubblewrap waits for the worker itself (``--block-fd``), and goes on at the end of
    that pipe: where its box cannot join its cgroup, the worker kills it first, so no
    command runs without its limits (it says why)."""
    from swarm.agent import cgroups

    ws = outside_tmp / "ws"
    ws.mkdir()
    limits = cgroups.Limits(pids=64)
    first = LocalEnvironment(ws, sandbox="bwrap", limits=limits, die_with_runner=True)
    assert first.execute("true", 30).exit_code == 0  # the trial, and the cgroups made
    first.close()

    def refused(self: cgroups.Group, pid: int) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cgroups.Group, "join", refused)
    shakes = _recorded_handshakes(monkeypatch)
    env = LocalEnvironment(ws, sandbox="bwrap", limits=limits, die_with_runner=True,
                           lasting=lasting)
    result = env.execute("echo ran > ran", 30)
    env.close()
    assert shakes and all(h.direct for h in shakes), shakes  # bubblewrap waited itself
    assert result.exit_code != 0, result
    assert "could not join its cgroup" in result.output, result.output
    assert not (ws / "ran").exists(), "the command ran outside its cgroup"


class _Interrupted(BaseException):
    """An interrupt (as KeyboardInterrupt, which pytest would take for its own)."""


@needs_sandbox
@as_root
@pytest.mark.parametrize("lasting", [True, False], ids=["lasting", "per-command"])
def test_a_box_whose_start_is_interrupted_before_the_word_is_killed_and_runs_nothing(
        outside_tmp: Path, monkeypatch: pytest.MonkeyPatch, lasting: bool) -> None:
    """Whatever stops the worker between a box's start and its word (an exception, an
    interrupt) kills the box first: bubblewrap would go on at the end of its pipe, its
    command outside its cgroup and out of the worker's sight."""
    from swarm.agent import cgroups

    ws = outside_tmp / "ws"
    ws.mkdir()
    limits = cgroups.Limits(pids=64)
    first = LocalEnvironment(ws, sandbox="bwrap", limits=limits, die_with_runner=True)
    assert first.execute("true", 30).exit_code == 0
    first.close()

    def interrupted(self: cgroups.Group, pid: int) -> None:
        raise _Interrupted

    monkeypatch.setattr(cgroups.Group, "join", interrupted)
    shakes = _recorded_handshakes(monkeypatch)
    env = LocalEnvironment(ws, sandbox="bwrap", limits=limits, die_with_runner=True,
                           lasting=lasting)
    with pytest.raises(_Interrupted):
        env.execute("echo ran > ran; sleep 30", 30)
    assert shakes and all(h.direct for h in shakes), shakes
    wait_until(lambda: not _box_processes(ws), "the box's processes to be gone", timeout=10)
    assert not (ws / "ran").exists(), "the command ran after the worker was interrupted"


def _recorded_handshakes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The handshakes the boxes started from now on were built with."""
    from swarm.agent.sandbox.box import Box

    shakes: list[Any] = []
    argv = Box.argv

    def recording(self: Box, *args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("handshake") is not None:
            shakes.append(kwargs["handshake"])
        return argv(self, *args, **kwargs)

    monkeypatch.setattr(Box, "argv", recording)
    return shakes


@needs_sandbox
def test_a_box_with_no_routes_to_set_waits_for_its_worker_in_bubblewrap(
        outside_tmp: Path) -> None:
    """No shell between ``setpriv`` and bubblewrap where the box's network namespace is a
    slot's (or none): bubblewrap names its box's first process and waits itself."""
    ws = outside_tmp / "ws"
    ws.mkdir()
    env = LocalEnvironment(ws, sandbox="bwrap", die_with_runner=True)
    assert env.execute("true", 30).exit_code == 0
    box = env.choice.box
    assert box is not None
    from swarm.agent.sandbox.box import Handshake

    shake = Handshake(7, 8, 9, 0 if box.net.mode != "user" else 1234, True)
    argv = box.argv("true", ws, 3, runner=os.getpid(), alive_fd=5, handshake=shake)
    bwrap = argv.index(box.binary)
    assert "bash" not in argv[:bwrap] and "sh" not in argv[:bwrap], argv[:bwrap]
    assert argv[argv.index("--info-fd") + 1] == "7"
    assert argv[argv.index("--block-fd") + 1] == "8"
    env.close()

@pytest.fixture
def other_netns() -> Iterator[str]:
    """A listener in another network namespace, joined to the host by a veth pair (as a
    server on the internet is reached through the host's routes): its address."""
    if shutil.which("ip") is None:
        pytest.fail("iproute2 is needed (apt-get install iproute2)")
    name = f"swarm-net-{os.getpid()}"
    host_end, far_end = f"sw{os.getpid() % 10**6}a", f"sw{os.getpid() % 10**6}b"
    octet = 16 + os.getpid() % 200

    def run(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    run("netns", "add", name)
    server = None
    try:
        run("link", "add", host_end, "type", "veth", "peer", "name", far_end)
        run("link", "set", far_end, "netns", name)
        run("addr", "add", f"172.31.{octet}.1/30", "dev", host_end)
        run("link", "set", host_end, "up")
        run("-n", name, "addr", "add", f"172.31.{octet}.2/30", "dev", far_end)
        run("-n", name, "link", "set", far_end, "up")
        serve = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 8765)); s.listen(); "
                 "print('up', flush=True)\n"
                 "while True:\n    c, _ = s.accept(); c.sendall(b'far side\\n'); c.close()")
        server = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", serve],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline() == "up\n"
        yield f"172.31.{octet}.2"
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_sandbox
@as_root
def test_a_box_reaches_a_server_beyond_the_host(tmp_path: Path, other_netns: str) -> None:
    """No internet on CI: a server in another network namespace, which the host reaches
    through a veth pair as it would the internet, stands for it; the box gets there
    through slirp4netns, and resolves names through slirp4netns's DNS."""
    env = LocalEnvironment(tmp_path, sandbox="bwrap", die_with_runner=True)
    assert env.choice.box is not None and env.choice.box.net.mode == "user", \
        env.choice.summary
    fetch = ("import socket, sys; s = socket.create_connection((sys.argv[1], 8765), 5); "
             "print(s.recv(100).decode().strip())")
    result = env.execute(f"python3 -c '{fetch}' {other_netns}; grep nameserver "
                         "/etc/resolv.conf", 30)
    assert result.output == "far side\nnameserver 10.0.2.3\n", result.output


@needs_sandbox
@as_root
def test_a_boxs_cgroup_is_lent_again_without_the_limit_its_last_box_reached(
        outside_tmp: Path) -> None:
    """An empty cgroup a box left is lent to the next box (made and removed for each, it
    was ~3 ms of a box's CPU); what the kernel counted for the last box (failed forks, OOM
    kills) is not reported as the next box's."""
    from swarm.agent.cgroups import Limits

    limits = Limits(pids=24)
    forks = ("python3 -c 'import os, time\n"
             "for i in range(64):\n"
             "    try:\n"
             "        if os.fork() == 0: time.sleep(5); os._exit(0)\n"
             "    except OSError: print(\"a fork failed\"); break'")
    tree = sandbox.cgroup_tree(limits)
    assert not isinstance(tree, str), tree
    envs = {}
    for name in ("a", "b"):  # made first: a trial of the sandbox (a box too) runs here
        (outside_tmp / name).mkdir()
        envs[name] = LocalEnvironment(outside_tmp / name, sandbox="bwrap", limits=limits,
                                      die_with_runner=True, lasting=False)

    def settled() -> None:
        """Once what waits for a box's last processes to lend its group has run."""
        done = threading.Event()
        later.soon(done.set)
        assert done.wait(30)

    settled()
    for group in list(tree._free):  # the trial's: only box "a"'s may be lent to "b"
        tree._free.remove(group)
        group.remove()
    hit = envs["a"].execute(forks, 30)
    assert "a fork failed" in hit.output, hit.output
    assert "limit of 24 processes" in hit.output, hit.output
    settled()
    (left,) = tree._free
    fine = envs["b"].execute("echo fine", 30)
    assert fine.output == "fine\n", fine.output
    settled()
    assert tree._free == [left]  # box "a"'s group, lent to "b" and free again
