"""run_cli inside bubblewrap: the workspace writable, the rest read-only, SWARM_HOME hidden,
an allowlisted environment, network optional; how SWARM_SANDBOX is chosen. The escape
attempts are tests/test_sandbox_escape.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from swarm.agent import sandbox
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings
from swarm.errors import ConfigError

needs_sandbox = pytest.mark.skipif(not sandbox.probe().ok,
                                   reason=f"no sandbox here: {sandbox.probe().reason}")


@needs_sandbox
def test_workspace_writable_rest_read_only(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    outside = Path("/var/tmp") / f"swarm-sandbox-{tmp_path.name}.txt"
    env = LocalEnvironment(ws, sandbox="bwrap")
    result = env.execute(f"echo in > inside.txt && pwd && touch {outside}", 10)
    assert (ws / "inside.txt").read_text() == "in\n"
    assert str(ws) in result.output
    assert "Read-only file system" in result.output
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
    box hides: git in the workspace still reads and writes its repository."""
    import subprocess

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


def test_choices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
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
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        sandbox.probe.cache_clear()
        assert "apt-get install bubblewrap" in sandbox.choose("auto").notice
    finally:
        sandbox.probe.cache_clear()  # the next test tries again, with the whole PATH
