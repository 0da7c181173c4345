"""Signs of life with a slow model: the waiting line, streamed thinking, the answer once."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swarm.cli.waiting import ERASE, Waiting, public_url
from swarm.testing.server import Reply, ScriptedModelServer, Slow
from tests.helpers import wait_until

# -- the waiting line on its own ------------------------------------------------------------

@pytest.mark.parametrize(("url", "shown"), [
    ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/v1"),
    ("https://alice:hunter2@llm.example/v1", "https://llm.example/v1"),
    ("https://sk-secret@llm.example:8443/v1?api-key=sk-secret#x", "https://llm.example:8443/v1"),
    ("http://[::1", "the configured endpoint"),
])
def test_public_url_drops_credentials(url: str, shown: str) -> None:
    assert public_url(url) == shown


def test_on_a_terminal_the_line_is_redrawn_in_place_and_erased() -> None:
    stream = io.StringIO()
    waiting = Waiting(stream, "http://bob:pw@127.0.0.1:9/v1", threshold=0.05, tick=0.01,
                      tty=True, color=False)
    waiting.start(lambda: "my-model")
    wait_until(lambda: stream.getvalue().count("waiting for my-model") >= 3, "3 redraws",
               timeout=10)
    waiting.stop()
    shown = stream.getvalue()
    assert shown.startswith(ERASE + "| waiting for my-model at http://127.0.0.1:9/v1 ... 0 s")
    assert "\n" not in shown and shown.endswith(ERASE)


def test_elsewhere_one_plain_line_every_interval() -> None:
    stream = io.StringIO()
    waiting = Waiting(stream, "http://127.0.0.1:9/v1", threshold=0.05, interval=0.05, tty=False)
    waiting.start(lambda: "")
    wait_until(lambda: stream.getvalue().count("\n") >= 3, "3 lines", timeout=10)
    waiting.stop()
    lines = stream.getvalue().splitlines()
    assert all(re.fullmatch(r"waiting for the model at http://127\.0\.0\.1:9/v1 \.\.\. \d+ s",
                            line) for line in lines), lines
    assert ERASE not in stream.getvalue()


def test_a_retry_joins_the_line_on_a_terminal_and_is_a_line_elsewhere() -> None:
    stream = io.StringIO()
    waiting = Waiting(stream, "http://127.0.0.1:9/v1", threshold=60, tty=True, color=False)
    waiting.start(lambda: "m")
    waiting.retrying("model call: try 1 of 3 failed, the next in 1.0 s: refused\nreally")
    waiting.retrying("model call: try 2 of 3 failed, the next in 2.0 s: refused")
    waiting.stop()
    # Once the wait is over (the answer began), nothing would erase a drawn line: a line.
    waiting.retrying("model call: try 3 of 4 failed, the next in 2.0 s: cut")
    assert stream.getvalue() == (
        ERASE + "| 0 s, model call: try 1 of 3 failed, the next in 1.0 s: refused really"
        + ERASE + "| 0 s, model call: try 2 of 3 failed, the next in 2.0 s: refused" + ERASE
        + "model call: try 3 of 4 failed, the next in 2.0 s: cut\n")
    plain = io.StringIO()
    waiting = Waiting(plain, "http://127.0.0.1:9/v1", threshold=60, tty=False)
    waiting.start(lambda: "m")
    waiting.retrying("model call: try 1 of 3 failed, the next in 1.0 s: refused")
    waiting.stop()
    assert plain.getvalue() == "model call: try 1 of 3 failed, the next in 1.0 s: refused\n"


# -- `swarm run` and `swarm chat` against a slow model --------------------------------------

@pytest.fixture
def env(model_server: ScriptedModelServer, redis_server: str, tmp_path: Path
        ) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model_server.base_url, SWARM_MODEL=model_server.models[0],
               SWARM_REDIS_URL=redis_server, SWARM_HOME=str(tmp_path / "home"),
               SWARM_RETRIES="1", TERM="xterm")
    return env


class Run:
    """`swarm run` with stdout and stderr on pipes, read as they come."""

    def __init__(self, env: dict[str, str], cwd: Path, *task: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarm", "run", "--yes", *task], env=env, cwd=cwd,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._out, self._err = bytearray(), bytearray()
        self._readers = [threading.Thread(target=self._read, args=(pipe, buf), daemon=True)
                         for pipe, buf in ((self.proc.stdout, self._out),
                                           (self.proc.stderr, self._err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(pipe: io.BufferedReader | None, buffer: bytearray) -> None:
        assert pipe is not None
        while chunk := os.read(pipe.fileno(), 4096):
            buffer.extend(chunk)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.proc.poll() is None:  # a failed test: do not leave it running
            self.proc.kill()
        self.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    @property
    def out(self) -> str:
        return self._out.decode(errors="replace")

    @property
    def err(self) -> str:
        return self._err.decode(errors="replace")

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
        return code


@pytest.mark.slow
def test_run_says_which_model_it_waits_for_without_credentials(
        model_server: ScriptedModelServer, env: dict[str, str], tmp_path: Path) -> None:
    model_server.require_key = "sk-test-secret"
    model_server.script(Slow(3, Reply(content="the answer")))
    port = model_server.port
    env.update(SWARM_BASE_URL=f"http://alice:hunter2@127.0.0.1:{port}/v1",
               SWARM_API_KEY="sk-test-secret", SWARM_WAIT_NOTICE="0.5")
    waiting = re.compile(rf"^waiting for scripted-model at http://127\.0\.0\.1:{port}/v1 "
                         r"\.\.\. (\d+) s$", re.M)
    with Run(env, tmp_path, "slow", "question") as run:
        # Lines come while the model is still silent, one every SWARM_WAIT_NOTICE seconds.
        wait_until(lambda: len(waiting.findall(run.err)) >= 2, "two waiting lines")
        assert run.proc.poll() is None and run.out == ""
        assert run.wait() == 0, run.err
    assert run.out == "the answer\n"
    seconds = [int(s) for s in waiting.findall(run.err)]
    assert seconds[0] >= 2 and seconds == sorted(seconds)
    assert "sk-test-secret" not in run.err
    for line in run.err.splitlines():
        if "waiting for" in line:
            assert "hunter2" not in line and "alice" not in line, line


@pytest.mark.slow
def test_run_shows_thinking_as_it_streams_before_the_answer(
        model_server: ScriptedModelServer, env: dict[str, str], tmp_path: Path) -> None:
    model_server.script(Slow(3, Reply(content="the answer", reasoning="pondering deeply"),
                             after_thinking=True))
    with Run(env, tmp_path, "think") as run:
        wait_until(lambda: "thinking: pondering deeply" in run.err, "the thinking")
        # The model has only thought so far: the answer is neither on stdout nor on stderr.
        assert run.proc.poll() is None and run.out == "" and "the answer" not in run.err
        assert run.wait() == 0, run.err
    assert run.out == "the answer\n"
    assert "thinking: pondering deeply\nthe answer\n" in run.err  # the text streams too
    assert "waiting for" not in run.err  # the first token came at once


def read_until(fd: int, transcript: bytearray, needle: bytes | None, timeout: float = 30,
               after: bytes = b"") -> None:
    """Read the terminal's output into ``transcript`` until it holds ``needle`` after the
    last ``after`` (None: until the program ends)."""
    deadline = time.monotonic() + timeout
    def seen() -> bool:
        start = transcript.rfind(after) if after else 0
        return needle is not None and start >= 0 and needle in transcript[start + len(after):]

    while not seen():
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {needle!r}; got {bytes(transcript[-500:])!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # Linux: EIO once the child is gone
                chunk = b""
            if not chunk and needle is None:
                return
            assert chunk, f"the program ended before {needle!r}: {bytes(transcript[-500:])!r}"
            transcript.extend(chunk)


def on_a_terminal(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, int]:
    pid, fd = pty.fork()
    if pid == 0:  # the child: swarm on a terminal
        os.chdir(cwd)
        os.execve(sys.executable, [sys.executable, "-m", "swarm", *args], env)
    return pid, fd


def exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def stop(pid: int, fd: int) -> None:
    """Kill the child if a failed test left it running; close the terminal."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    os.close(fd)


def assert_waited_in_place(shown: bytes, port: int, then: bytes) -> None:
    """The waiting line was drawn in place and erased before ``then`` appeared."""
    line = b"waiting for scripted-model at http://127.0.0.1:%d/v1 ... 2 s" % port
    first = shown.index(line)
    erased = shown.index(ERASE.encode(), shown.rindex(b"waiting for"))
    assert b"\n" not in shown[first:erased], "the waiting line was not redrawn in place"
    assert erased < shown.index(then)


@pytest.mark.slow
def test_run_on_a_terminal_spins_then_shows_dim_thinking_and_the_answer_once(
        model_server: ScriptedModelServer, env: dict[str, str], tmp_path: Path) -> None:
    model_server.script(Slow(3, Reply(content="pong-answer", reasoning="hmm")))
    pid, fd = on_a_terminal(["run", "--yes", "ping"], env, tmp_path)
    shown = bytearray()
    try:
        read_until(fd, shown, None)
        assert exit_code(pid) == 0, bytes(shown)
    finally:
        stop(pid, fd)
    assert_waited_in_place(bytes(shown), model_server.port, b"\x1b[2mthinking: hmm")
    assert shown.count(b"pong-answer") == 1  # streamed to the terminal, not printed again


@pytest.mark.slow
def test_chat_on_a_terminal_spins_until_the_answer_starts(
        model_server: ScriptedModelServer, env: dict[str, str], tmp_path: Path) -> None:
    model_server.script(Slow(3, Reply(content="chat-answer")))
    pid, fd = on_a_terminal(["chat", "--yes"], env, tmp_path)
    shown = bytearray()
    try:
        read_until(fd, shown, b"> ")
        os.write(fd, b"hello\r")
        read_until(fd, shown, b"chat-answer")
        read_until(fd, shown, b"> ", after=b"chat-answer")
        os.write(fd, b"\x04")  # Ctrl-D
        assert exit_code(pid) == 0
    finally:
        stop(pid, fd)
    assert_waited_in_place(bytes(shown), model_server.port, b"chat-answer")
