"""A misbehaving model cannot hurt the swarm: `swarm run` against the scripted server's
misbehaving modes (:mod:`swarm.testing.misbehave`), over real HTTP with real Redis. Each
run ends by itself, in bounded memory, saying what happened; the folder's session and
Redis stay usable (the next run in the folder works)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from swarm.cli.waiting import ERASE
from swarm.domain.messages import Message
from swarm.store import keys
from swarm.store.sessions import RedisSessionStore
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.test_waiting import exit_code, on_a_terminal, read_until, stop

pytestmark = pytest.mark.slow

KEPT = 1 << 20
"""Bytes of each output stream a test keeps (the rest is only counted)."""


class Finished:
    """A finished ``swarm run``: exit code, the start of its output, its size, its peak
    memory and how long it ran."""

    def __init__(self, code: int, out: bytes, err: bytes, err_size: int, peak_mb: float,
                 seconds: float) -> None:
        self.code, self.out = code, out.decode(errors="replace")
        self.err, self.err_size = err.decode(errors="replace"), err_size
        self.peak_mb, self.seconds = peak_mb, seconds


#: Runs a command and writes its exit code and peak memory (KiB) to the file argv[1]. A
#: forked child's ru_maxrss starts at its parent's: measured from this small launcher, not
#: from the test process, it is the command's own.
LAUNCHER = """\
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as out:
    out.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def swarm_run(env: dict[str, str], cwd: Path, task: str, *, limit: float = 60) -> Finished:
    """``swarm run --yes TASK``; killed after ``limit`` seconds or 20 MB of stderr (a run
    that never ends must fail the test, not fill its memory)."""
    started = time.monotonic()
    measured = cwd.parent / f"measured-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(measured), sys.executable, "-m", "swarm", "run",
         "--yes", task], env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)

    def kill() -> None:  # the launcher, the run and what the run started: all ours
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    kept = {1: bytearray(), 2: bytearray()}
    sizes = {1: 0, 2: 0}

    def read(pipe: Any, fd: int) -> None:
        while chunk := os.read(pipe.fileno(), 65536):
            sizes[fd] += len(chunk)
            if len(kept[fd]) < KEPT:
                kept[fd].extend(chunk[:KEPT - len(kept[fd])])
            if sizes[fd] > 20_000_000:
                kill()

    readers = [threading.Thread(target=read, args=(proc.stdout, 1), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, 2), daemon=True)]
    for reader in readers:
        reader.start()
    timer = threading.Timer(limit, kill)
    timer.start()
    try:
        proc.wait()
    finally:
        timer.cancel()
    for reader in readers:
        reader.join(10)
    for pipe in (proc.stdout, proc.stderr):
        assert pipe is not None
        pipe.close()
    code, peak = measured.read_text().split() if measured.exists() else ("-9", "0")
    return Finished(int(code), bytes(kept[1]), bytes(kept[2]), sizes[2], int(peak) / 1024,
                    time.monotonic() - started)


@pytest.fixture
def env(model_server: ScriptedModelServer, redis_server: str, redis: redis_lib.Redis,
        tmp_path: Path) -> dict[str, str]:
    model_server.context_length = 1_000_000  # room for answers of SWARM_ANSWER_MAX
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model_server.base_url, SWARM_MODEL=model_server.models[0],
               SWARM_REDIS_URL=redis_server, SWARM_HOME=str(tmp_path / "home"),
               SWARM_WORKERS="0", SWARM_RETRIES="1", SWARM_ANSWER_MAX="100000",
               SWARM_CALL_TIMEOUT="30")
    return env


@pytest.fixture
def work(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


def session(redis: redis_lib.Redis, folder: Path) -> list[Message]:
    loaded = RedisSessionStore(redis).load(keys.session_id_for(str(folder.resolve())))
    assert loaded is not None
    return loaded.messages


def still_usable(env: dict[str, str], work: Path, model: ScriptedModelServer) -> None:
    """The folder's next run works: the session loads, the lock was let go, Redis answers."""
    model.misbehave = None
    again = swarm_run(env, work, "run `echo again`")
    assert again.code == 0, again.err[-2000:]
    assert again.out.startswith("Done. Output:\nagain\n")


def test_an_endless_stream_is_cut_at_the_answer_cap_in_bounded_memory(
        env: dict[str, str], work: Path, model_server: ScriptedModelServer,
        redis: redis_lib.Redis) -> None:
    run = swarm_run(env, work, "misbehave: endless")
    assert run.code == 0, run.err[-2000:]
    assert "[the model's answer was cut at 100,000 characters (SWARM_ANSWER_MAX=100000)" \
        in run.err
    assert run.err_size < 200_000  # the live echo stopped at the cap too
    assert run.peak_mb < 300, f"peak memory {run.peak_mb:.0f} MB"
    assert run.seconds < 30  # well within the call's time cap: the size cap ended it
    answer = session(redis, work)[-1]
    assert answer["role"] == "assistant"
    assert answer["content"].endswith(
        "[swarm: this answer was cut at 100,000 characters (SWARM_ANSWER_MAX=100000); the "
        "rest of it was dropped]")
    still_usable(env, work, model_server)


@pytest.mark.parametrize("stream", ["1", "0"])
def test_a_trickle_ends_at_the_call_time_cap(
        env: dict[str, str], work: Path, model_server: ScriptedModelServer, stream: str) -> None:
    model_server.trickle_every = 0.5  # never silent for SWARM_READ_TIMEOUT
    env.update(SWARM_READ_TIMEOUT="5", SWARM_CALL_TIMEOUT="3", SWARM_STREAM=stream)
    run = swarm_run(env, work, "misbehave: trickle", limit=40)
    assert run.code == 1, run.err[-2000:]
    assert re.search(r"had not finished its answer after 3 s \(SWARM_CALL_TIMEOUT\), \d+ "
                     r"bytes in", run.err), run.err[-2000:]
    assert run.seconds < 15
    still_usable(env, work, model_server)


def test_absurd_usage_neither_compacts_the_conversation_nor_costs_millions(
        env: dict[str, str], work: Path, model_server: ScriptedModelServer,
        redis: redis_lib.Redis) -> None:
    first = swarm_run(env, work, "run `echo the first task`")
    assert first.code == 0, first.err[-2000:]
    earlier = session(redis, work)[1:]
    # Every answer now claims 10^12 prompt and completion tokens: two commands (with today's
    # trust in the figure, the first asks for compaction and the second compacts), then a
    # child, so that `swarm status` has a swarm to price.
    model_server.misbehave = "absurd-usage"
    model_server.script(Reply(tool_calls=[ToolCall("run_cli", {"command": "echo a"})]),
                        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo b"})]),
                        Reply(tool_calls=[ToolCall("agent", {"message": "run `echo c`"})]))
    env.update(SWARM_WORKERS="1", SWARM_PRICE_INPUT="3", SWARM_PRICE_OUTPUT="15")
    run = swarm_run(env, work, "three steps")
    assert run.code == 0, run.err[-2000:]
    assert run.out.startswith("1 child: 1 done.")
    notices = [line for line in run.err.splitlines() if "cannot be true" in line]
    assert len(notices) == 1, run.err  # said once, though every answer lied
    assert "1,000,000,000,000 prompt tokens for a request of" in notices[0]
    assert "compacted" not in run.err and "context" not in run.err.replace(notices[0], "")
    messages = session(redis, work)
    assert messages[1:len(earlier) + 1] == earlier  # the first task is all still there
    assert not [m for m in messages if "EMERGENCY" in str(m.get("content"))]
    status = subprocess.run([sys.executable, "-m", "swarm", "status", "--json"], env=env,
                            cwd=work, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    usage: dict[str, int] = {}
    for agent in json.loads(status.stdout)["agents"]:
        for name, value in agent["usage"].items():
            usage[name] = usage.get(name, 0) + value
    assert 0 < usage["total_tokens"] < 100_000, usage
    shown = subprocess.run([sys.executable, "-m", "swarm", "status"], env=env, cwd=work,
                           capture_output=True, text=True, timeout=60).stdout
    cost = re.search(r"~\$([\d,.]+)", shown)
    assert cost and float(cost[1].replace(",", "")) < 1, shown
    still_usable(env, work, model_server)


@pytest.mark.parametrize("stream", ["1", "0"])
def test_a_50_mb_answer_is_stored_cut_and_marked_and_the_next_request_is_small(
        env: dict[str, str], work: Path, model_server: ScriptedModelServer,
        redis: redis_lib.Redis, stream: str) -> None:
    env["SWARM_STREAM"] = stream
    run = swarm_run(env, work, "misbehave: huge")
    assert run.code == 0, run.err[-2000:]
    assert run.peak_mb < 300, f"peak memory {run.peak_mb:.0f} MB"
    answer = session(redis, work)[-1]
    assert 100_000 < len(answer["content"]) < 100_300
    assert answer["content"].endswith("(SWARM_ANSWER_MAX=100000); the rest of it was dropped]")
    assert run.out.rstrip("\n") == answer["content"]
    still_usable(env, work, model_server)
    sent = model_server.requests[-2]  # the next run's first request carries the cut answer
    assert len(json.dumps(sent)) < 200_000


def test_a_long_retry_after_is_capped_and_the_error_says_so(
        env: dict[str, str], work: Path, model_server: ScriptedModelServer) -> None:
    env.update(SWARM_RETRIES="2", SWARM_BACKOFF_MAX="0.2")
    run = swarm_run(env, work, "misbehave: retry-after")
    assert run.code == 1
    error = run.err.strip().splitlines()[-1]
    assert error.startswith("Error: ModelRateLimitError: ")
    assert ("It asked to wait 3600 s (Retry-After); swarm waits at most 0.2 s between tries "
            "(SWARM_BACKOFF_MAX: raise it to wait as long as asked) (gave up after 2 tries)"
            ) in error
    assert run.seconds < 15
    still_usable(env, work, model_server)


def test_bytes_that_are_not_utf8_are_replaced_alike_streamed_or_not(
        env: dict[str, str], tmp_path: Path, model_server: ScriptedModelServer) -> None:
    runs = []
    for stream in ("1", "0"):
        folder = tmp_path / f"stream-{stream}"
        folder.mkdir()
        runs.append(swarm_run({**env, "SWARM_STREAM": stream}, folder, "misbehave: bad-utf8"))
        assert runs[-1].code == 0, runs[-1].err[-2000:]
    assert runs[0].out == runs[1].out == \
        "caf\ufffd au lait, \ufffd\ufffd and a lone \ufffd\ufffd\ufffd surrogate\n"
    notice = ("[the model server sent bytes that are not UTF-8; each such sequence was "
              "replaced by \ufffd]")
    assert [notice in run.err for run in runs] == [True, True]
    still_usable(env, tmp_path / "stream-0", model_server)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_retries_of_a_missing_model_are_a_line_each_off_a_terminal_not_warnings(
        env: dict[str, str], work: Path, model_server: ScriptedModelServer) -> None:
    missing = {**env, "SWARM_BASE_URL": f"http://127.0.0.1:{closed_port()}/v1",
               "SWARM_RETRIES": "4", "SWARM_BACKOFF_MAX": "0.05"}
    run = swarm_run(missing, work, "hello")
    assert run.code == 1
    lines = run.err.strip().splitlines()
    assert "WARNING" not in run.err
    assert lines[-1].startswith("Error: ModelConnectionError: cannot connect to the model "
                                "server at http://127.0.0.1:")
    assert lines[-1].endswith("(gave up after 4 tries)")
    retries = [re.match(r"listing models: try (\d) of 4 failed, the next in \d\.\d s: cannot "
                        r"connect to the model server at http://127\.0\.0\.1:", line)
               for line in lines]
    assert [found[1] for found in retries if found] == ["1", "2", "3"], lines
    assert len(lines) == 4, lines
    still_usable(env, work, model_server)


def test_retries_on_a_terminal_redraw_one_line(env: dict[str, str], work: Path,
                                               model_server: ScriptedModelServer) -> None:
    missing = {**env, "SWARM_BASE_URL": f"http://127.0.0.1:{closed_port()}/v1",
               "SWARM_RETRIES": "4", "SWARM_BACKOFF_MAX": "0.05", "TERM": "xterm"}
    pid, fd = on_a_terminal(["run", "--yes", "hello"], missing, work)
    shown = bytearray()
    try:
        read_until(fd, shown, None)
        assert exit_code(pid) == 1
    finally:
        stop(pid, fd)
    text = bytes(shown).decode(errors="replace")
    assert "WARNING" not in text
    before, _, error = text.partition("Error: ModelConnectionError: cannot connect")
    assert error.rstrip().endswith("(gave up after 4 tries)")
    drawn = before.split(ERASE)
    for number in (1, 2, 3):  # each retry drew the line
        assert [d for d in drawn if f"s, listing models: try {number} of 4 failed" in d], before
    assert "\n" not in before, before  # redrawn in place, and erased
    still_usable(env, work, model_server)
