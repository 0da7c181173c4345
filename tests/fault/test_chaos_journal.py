"""The chaos campaign's journal (:mod:`bench.chaos_journal`): a command's line reaches the
collector from a real shell, unconfined and in the product's box, and carries the pid of
the process that ran the command (the kernel's word, not the command's); and the checks
of :mod:`bench.chaos_evidence` that read what the collector added."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import chaos_evidence as ev
from bench.chaos_journal import Collector, client_command, python3
from swarm.agent import sandbox


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    journal = tmp_path / "journal.log"
    journal.touch()
    made = Collector(journal, f"test-{os.getpid()}")
    made.start()
    yield made
    made.close()
    assert not made.folder.exists()


def _lines(journal: Path) -> list[ev.Line]:
    return ev.journal(journal, {})


def test_an_unconfined_commands_line_names_the_process_that_ran_it(collector: Collector) -> None:
    command = "sleep 0.1; " + client_command(collector.socket, "t1 p0 c1 k2", python3())
    before = time.time()
    done = subprocess.run(["bash", "-c", f"bash -c {shlex.quote(command)}"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    [line] = _lines(collector.journal)
    assert (line.parent, line.child, line.turn) == (0, 1, 2)
    assert line.pid == os.getpid()  # past both shells: this process ran the command
    assert line.host == os.uname().nodename
    assert before < line.time <= line.received < time.time()


def test_a_boxed_commands_line_reaches_the_collector_with_its_workers_pid(
        collector: Collector, tmp_path: Path) -> None:
    """The box has its own pid namespace, /tmp and an allowlisted environment (and runs as
    SWARM_SANDBOX_UID under a root runner): the line still arrives, with this process's
    pid, which the box cannot see."""
    choice = sandbox.choose("auto", worker=True, show=(str(collector.folder),))
    if choice.box is None:
        pytest.skip(f"no sandbox here: {choice.refuse}")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    choice.box.prepare(workspace)
    fd = sandbox.program_fd()
    command = ("echo $$ > mine; " + client_command(collector.socket, "t1 p3 c-1 k0", python3()))
    try:
        done = subprocess.run(choice.box.argv(command, workspace, fd, runner=os.getpid()),
                              pass_fds=(fd,), cwd=workspace, capture_output=True, text=True,
                              timeout=60, env=sandbox.environment(os.environ), check=False)
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    [line] = _lines(collector.journal)
    assert (line.parent, line.child, line.turn, line.pid) == (3, -1, 0, os.getpid())
    assert int((workspace / "mine").read_text()) < 10  # it ran in a pid namespace of its own


def test_a_line_that_is_not_a_journal_line_is_refused(collector: Collector) -> None:
    command = client_command(collector.socket, "t1 p0 c0 k0 extra", python3())
    done = subprocess.run(["bash", "-c", command], capture_output=True, timeout=60, check=False)
    assert done.returncode == 1
    assert collector.journal.read_text() == ""


def test_a_line_whose_time_is_far_from_its_arrival_is_a_clock_violation() -> None:
    good = ev.Line(0, 0, 0, 100.0, "h1", 11, received=100.05)
    unset = ev.Line(0, 0, 1, 100.0, "h1", 11)
    ahead = ev.Line(0, 0, 2, 130.0, "h1", 11, received=100.05)  # an offset not taken off
    assert ev.clock_skewed([good, unset]) == []
    [found] = ev.clock_skewed([good, ahead])
    assert found.invariant == "journal clock" and str(ahead) in found.text


def test_a_line_with_no_worker_found_is_still_checked_against_the_runs_host_and_states() -> None:
    timeline = {"r1": [ev.Mark(100.0, "claim", "r1", "t1", "h1"),
                       ev.Mark(110.0, "claim", "r1", "t2", "h2"),
                       ev.Mark(120.0, "settle", "r1", state="done")]}
    lives = [ev.Life("h1", 11, 0.0), ev.Life("h2", 22, 0.0)]
    runs = {(0, 0): "r1"}
    assert ev.zombies([ev.Line(0, 0, 0, 105.0, "h1", 0)], runs, timeline, lives) == []
    assert len(ev.zombies([ev.Line(0, 0, 0, 112.0, "h1", 0)], runs, timeline, lives)) == 1
    assert len(ev.zombies([ev.Line(0, 0, 0, 121.0, "h2", 0)], runs, timeline, lives)) == 1
