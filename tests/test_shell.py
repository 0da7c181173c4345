"""LocalEnvironment: real bash, real process groups."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import swarm.agent.shell as shell_mod
from swarm import procs
from swarm.agent import sandbox
from swarm.agent.shell import BACKGROUND_NOTE, LocalEnvironment, clamp_timeout
from swarm.errors import ToolError
from tests.helpers import wait_until


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _gone_soon(pid: int, within: float = 3.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def pids(tmp_path: Path) -> Iterator[list[int]]:
    """Pids a test's commands wrote down; whatever still lives is killed afterwards."""
    found: list[int] = []
    yield found
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _read_pids(path: Path, into: list[int]) -> list[int]:
    got = [int(x) for x in path.read_text().split()]
    into.extend(got)
    return got


def _when_written(path: Path, action: Callable[[], object]) -> threading.Thread:
    """Do ``action`` in a thread as soon as the command has written its pid to ``path``."""
    def run() -> None:
        wait_until(lambda: path.exists() and path.read_text().strip(),
                   f"the command to write {path.name}")
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_exit_code_and_interleaved_stderr(tmp_path: Path) -> None:
    r = LocalEnvironment(tmp_path).execute("echo one; echo two >&2; echo three; exit 7", 10)
    assert r.output == "one\ntwo\nthree\n"
    assert r.exit_code == 7
    assert not r.timed_out and r.cut_chars == 0
    assert r.for_model().endswith("[exit code: 7]")


def test_cwd_is_workspace_and_process_cwd_unchanged(tmp_path: Path) -> None:
    before = os.getcwd()
    r = LocalEnvironment(tmp_path).execute("pwd; touch made-here", 10)
    assert r.output.strip() == os.path.realpath(tmp_path)
    assert (tmp_path / "made-here").exists()
    assert os.getcwd() == before


def test_threads_each_run_in_their_own_workspace(tmp_path: Path) -> None:
    dirs = [tmp_path / f"w{i}" for i in range(4)]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        dirs[i].mkdir()
        results[i] = LocalEnvironment(dirs[i]).execute("sleep 0.2; pwd", 10).output.strip()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: os.path.realpath(d) for i, d in enumerate(dirs)}


def test_stdin_is_closed(tmp_path: Path) -> None:
    start = time.monotonic()
    r = LocalEnvironment(tmp_path).execute("cat; read x; echo read=$?", 20)
    assert r.output == "read=1\n"
    assert r.exit_code == 0
    assert time.monotonic() - start < 10


def test_missing_workspace_is_a_tool_error(tmp_path: Path) -> None:
    with pytest.raises(ToolError, match="does not exist"):
        LocalEnvironment(tmp_path / "nope").execute("true", 5)


def test_output_cap_keeps_head_and_tail(tmp_path: Path) -> None:
    cmd = "echo START; yes 0123456789 | head -c 5000000; echo; echo END"
    r = LocalEnvironment(tmp_path, output_cap=20_000).execute(cmd, 30)
    total = len("START\n") + 5_000_000 + len("\nEND\n")
    assert r.exit_code == 0
    assert r.cut_chars == total - 20_000
    assert r.output.startswith("START\n0123456789\n")
    assert r.output.endswith("0123456789\n01234\nEND\n")  # 5e6 % 11 == 5
    assert f"\n[... {r.cut_chars} characters cut ...]\n" in r.output
    head, _, tail = r.output.partition(f"\n[... {r.cut_chars} characters cut ...]\n")
    assert len(head) == len(tail) == 10_000


def test_output_cap_counts_multibyte_characters(tmp_path: Path) -> None:
    # 2-byte characters crossing read boundaries and the head/tail split.
    cmd = "python3 -c \"import sys; sys.stdout.write('é' * 100000 + 'Z')\""
    r = LocalEnvironment(tmp_path, output_cap=1000).execute(cmd, 30)
    assert r.cut_chars == 100_001 - 1000
    assert "\ufffd" not in r.output
    assert r.output.startswith("é" * 500 + "\n[...")
    assert r.output.endswith("é" * 499 + "Z")


def test_small_overflow_is_cut_exactly(tmp_path: Path) -> None:
    r = LocalEnvironment(tmp_path, output_cap=100).execute("printf 'x%.0s' $(seq 150)", 10)
    assert r.cut_chars == 50
    assert r.output == "x" * 50 + "\n[... 50 characters cut ...]\n" + "x" * 50


def test_binary_output_does_not_crash(tmp_path: Path) -> None:
    env = LocalEnvironment(tmp_path)
    r = env.execute("head -c 1000 /dev/urandom", 10)
    assert r.exit_code == 0
    assert isinstance(r.output, str) and "\x00" not in r.output
    r = env.execute(r"printf 'a\0b\377c'", 10)
    assert r.output == "a\ufffdb\ufffdc"


def test_timeout_kills_the_whole_process_group(tmp_path: Path, pids: list[int]) -> None:
    cmd = "sleep 30 & echo $! > bg.pid; sh -c 'echo $$ > fg.pid; exec sleep 30'"
    start = time.monotonic()
    r = LocalEnvironment(tmp_path).execute(f"echo before; {cmd}", 1)
    elapsed = time.monotonic() - start
    assert r.timed_out and r.exit_code is None
    assert r.output.startswith("before")
    assert "timed out" in r.for_model()
    assert elapsed < 10  # far below the 30 s the sleeps wanted
    for pid in _read_pids(tmp_path / "bg.pid", pids) + _read_pids(tmp_path / "fg.pid", pids):
        assert _gone_soon(pid), f"pid {pid} survived the timeout"


def test_timeout_sigkills_what_ignores_sigterm(tmp_path: Path, pids: list[int]) -> None:
    start = time.monotonic()
    r = LocalEnvironment(tmp_path).execute("trap '' TERM; sleep 30 & echo $! > p.pid; wait", 1)
    assert r.timed_out and time.monotonic() - start < 10  # not the 30 s of the sleep
    (pid,) = _read_pids(tmp_path / "p.pid", pids)
    assert _gone_soon(pid)  # SIGKILLed after the grace


def test_a_group_of_only_zombies_is_dead() -> None:
    # White-box: a killed command's group whose members are all zombies nobody reaps (an
    # init that never reaps, in some containers) must not count as running. Through
    # execute() the only sign is a kill that waits out the whole grace, so the group's
    # own check is asked here.
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        group = shell_mod._Group(child.pid)
        assert group.alive()
        os.kill(child.pid, signal.SIGKILL)
        wait_until(lambda: not _alive(child.pid), "the child to be a zombie", timeout=5)
        wait_until(lambda: not group.alive(), "the group of a zombie to count as dead",
                   timeout=5)
        os.killpg(child.pid, 0)  # the unreaped zombie still counts for killpg, not for us
    finally:
        child.kill()
        child.wait()
    assert not group.alive()


def test_parse_stat() -> None:
    text = f"77 (a) b (c)) Z 1 99 {' '.join(['0'] * 16)} 123456 0\n"
    assert procs.parse_stat(text) == procs.ProcStat(state="Z", ppid=1, pgrp=99, start="123456")
    assert procs.parse_stat("77 (x) S 1 2") is None
    assert procs.parse_stat("") is None
    own = procs.read_stat(os.getpid())
    assert own is not None and own.pgrp == os.getpgid(0) and not own.zombie
    assert procs.read_stat(-1) is None


def test_a_nul_byte_in_the_command_is_a_tool_error(tmp_path: Path) -> None:
    with pytest.raises(ToolError, match="contains a NUL byte"):
        LocalEnvironment(tmp_path).execute("echo a\0b", 10)
    with pytest.raises(ToolError, match="cannot start bash"):
        LocalEnvironment(tmp_path, extra_env={"X": "a\0b"}).execute("true", 10)


def test_background_child_holding_stdout_does_not_hang(
    tmp_path: Path, pids: list[int]
) -> None:
    start = time.monotonic()
    r = LocalEnvironment(tmp_path).execute("sleep 30 & echo $! > bg.pid; echo started", 20)
    assert time.monotonic() - start < 10
    assert r.exit_code == 0 and not r.timed_out
    assert r.output == f"started\n{BACKGROUND_NOTE}"
    (pid,) = _read_pids(tmp_path / "bg.pid", pids)
    assert _alive(pid)  # left alone, as documented


def test_background_child_with_redirected_output_is_not_reported(tmp_path: Path) -> None:
    r = LocalEnvironment(tmp_path).execute("(sleep 0.1 &) >/dev/null 2>&1; echo ok", 10)
    assert r.output == "ok\n"


def test_cancel_kills_the_command(tmp_path: Path, pids: list[int]) -> None:
    cancel = threading.Event()
    canceller = _when_written(tmp_path / "p.pid", cancel.set)  # cancelled while it runs
    start = time.monotonic()
    r = LocalEnvironment(tmp_path, cancel=cancel).execute("echo $$ > p.pid; sleep 30", 30)
    canceller.join()
    assert time.monotonic() - start < 10
    assert r.exit_code is None and not r.timed_out
    assert "cancelled" in r.output
    (pid,) = _read_pids(tmp_path / "p.pid", pids)
    assert _gone_soon(pid)


def test_keyboard_interrupt_kills_the_group_and_reraises(
    tmp_path: Path, pids: list[int]
) -> None:
    interrupter = _when_written(tmp_path / "p.pid", _thread.interrupt_main)  # Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        LocalEnvironment(tmp_path).execute("sleep 30 & echo $! > p.pid; wait", 30)
    interrupter.join()
    (pid,) = _read_pids(tmp_path / "p.pid", pids)
    assert _gone_soon(pid)


def test_child_env_has_no_secrets_and_no_pager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("SWARM_API_KEY", "OPENAI_API_KEY", "EVA_API_KEY"):
        monkeypatch.setenv(var, f"secret-{var.lower()}")
    monkeypatch.setenv("SWARM_REDIS_URL", "redis://:secret-password@redis.test:6379/0")
    monkeypatch.setenv("SWARM_TEST_VISIBLE", "visible-value")
    monkeypatch.setenv("PAGER", "less")
    r = LocalEnvironment(tmp_path, extra_env={"SWARM_AGENT_ID": "a1"}).execute("env", 10)
    assert "secret-" not in r.output
    assert "SWARM_TEST_VISIBLE=visible-value" in r.output
    lines = set(r.output.splitlines())
    assert {"PAGER=cat", "GIT_PAGER=cat", "TERM=dumb", "GIT_TERMINAL_PROMPT=0",
            "SWARM_AGENT_ID=a1"} <= lines
    assert os.environ["OPENAI_API_KEY"] == "secret-openai_api_key"  # parent env untouched


def test_clamp_timeout() -> None:
    assert clamp_timeout(None, 300, 3600) == 300
    assert clamp_timeout(0, 300, 3600) == 300
    assert clamp_timeout(-5, 300, 3600) == 300
    assert clamp_timeout(10, 300, 3600) == 10
    assert clamp_timeout(99_999, 300, 3600) == 3600
    assert clamp_timeout(None, 300, 60) == 60


@pytest.mark.skipif(not sandbox.pdeathsig_setpriv(), reason="setpriv with --pdeathsig is not here")
def test_an_unconfined_command_whose_runner_died_before_it_started_does_not_run(
        tmp_path: Path) -> None:
    """A worker SIGKILLed between the fork of a command and ``setpriv``'s parent-death
    signal sends no signal: the command must not run on, orphaned, after its lease can have
    been handed over (the chaos campaign saw two such journal lines, written 1.5 and 6.4 s
    after their worker's SIGKILL). Here the runner exits before the command's process
    execs ``setpriv`` at all."""
    marker = tmp_path / "ran"
    runner = (
        "import os, sys, time\n"
        "from swarm.agent.shell import unconfined_argv\n"
        f"argv = unconfined_argv('echo ran > {marker}')\n"
        "parent = os.getpid()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    while os.getppid() == parent:\n"
        "        time.sleep(0.01)\n"  # until the runner is gone
        "    os.execv(argv[0], argv)\n"
        "print(pid, flush=True)\n"
        "os._exit(0)\n")
    started = subprocess.run([sys.executable, "-c", runner], check=True, timeout=30,
                             capture_output=True, text=True)
    orphan = Path(f"/proc/{int(started.stdout)}")
    wait_until(lambda: not orphan.exists(), "the orphaned command's shell to end", timeout=30)
    assert not marker.exists(), "the command ran after its runner had died"
