"""Real `swarm` processes on the embedded default: nothing started by hand."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.store.server import EmbeddedServer
from swarm.testing.server import Reply, ScriptedModelServer, Slow, ToolCall
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


def env_for(server: ScriptedModelServer, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=server.base_url, SWARM_HOME=str(home), SWARM_RETRIES="1")
    return env


def swarm(*args: str, env: dict[str, str], cwd: Path, timeout: float = 60
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_run_on_the_embedded_default_and_resume_after_the_server_restarts(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = env_for(model_server, home)
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo 42 > answer.txt"})]),
        Reply(content="wrote answer.txt"),
        Reply(content="it holds 42"),
    )
    first = swarm("run", "--yes", "write the answer", env=env, cwd=work)
    assert first.returncode == 0, first.stderr
    assert first.stdout == "wrote answer.txt\n"
    assert (work / "answer.txt").read_text() == "42\n"
    # The CLI and the local processes it started in the background were the server's only
    # users: once they have stopped on their own, so has the server...
    wait_until(lambda: not EmbeddedServer(home).status().running, "the server to stop")
    # ...and the next run starts it again from its append-only file, resuming the session.
    second = swarm("run", "--yes", "what does it hold?", env=env, cwd=work)
    assert second.returncode == 0, second.stderr
    assert second.stdout == "it holds 42\n"
    history = [m.get("content") for m in model_server.requests[-1]["messages"]]
    assert history[1] == "write the answer" and history[-1] == "what does it hold?"
    wait_until(lambda: not EmbeddedServer(home).status().running, "the server to stop")


def test_sigint_during_a_command_kills_it_and_saves_the_session(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = env_for(model_server, home)
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo $$ > pid; sleep 60"})]),
        Reply(content="resumed fine"),
    )
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "run", "--yes", "sleep"], env=env,
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    wait_until(lambda: (work / "pid").exists() and (work / "pid").read_text().strip(),
               "the command to start")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and out == ""
    pid = int((work / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    resumed = swarm("run", "--yes", "again", env=env, cwd=work)
    assert resumed.stdout == "resumed fine\n"
    tools = [m for m in model_server.requests[-1]["messages"] if m["role"] == "tool"]
    assert "interrupted by the user" in tools[0]["content"]


class Terminal:
    """Reads what a program in a pty prints, consuming up to each awaited text."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def expect(self, needle: bytes, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"never saw {needle!r}; got {self.buffer[-500:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                self.buffer += chunk
        self.buffer = self.buffer[self.buffer.index(needle) + len(needle):]


def test_chat_ctrl_c_returns_to_the_prompt_and_ctrl_d_exits(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    model_server.script(Slow(30, Reply(content="too late")), Reply(content="pong"))
    pid, fd = pty.fork()
    if pid == 0:  # the child: swarm chat on a terminal
        os.chdir(work)
        os.execve(sys.executable, [sys.executable, "-m", "swarm", "chat", "--yes"],
                  env_for(model_server, home))
    term = Terminal(fd)
    try:
        term.expect(b"> ")
        os.write(fd, b"slow question\r")
        term.expect(b"slow question")
        # Ctrl-C while the model is answering (slowly), not before the question left.
        wait_until(lambda: model_server.requests, "the question to reach the model")
        os.write(fd, b"\x03")  # Ctrl-C
        term.expect(b"(interrupted)")
        term.expect(b"> ")
        os.write(fd, b"ping\r")
        term.expect(b"pong")
        term.expect(b"> ")
        os.write(fd, b"\x04")  # Ctrl-D
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def test_with_the_task_on_stdin_approvals_are_asked_on_the_terminal(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    """`swarm run -` reads the task from a pipe, so the answer to an approval comes from the
    terminal (/dev/tty), as sudo's password does."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    model_server.script(Reply(tool_calls=[ToolCall("run_cli", {"command": "touch approved"})]),
                        Reply(content="made it"))
    env = {**env_for(model_server, home), "SWARM_APPROVAL": "run_cli=always"}
    task_out, task_in = os.pipe()
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin a pipe, the pty its terminal (and stdout, stderr)
        os.dup2(task_out, 0)
        os.chdir(work)
        os.execve(sys.executable, [sys.executable, "-m", "swarm", "run", "-"], env)
    os.close(task_out)
    os.write(task_in, b"make the file\n")
    os.close(task_in)
    term = Terminal(fd)
    try:
        term.expect(b"run_cli wants to run: touch approved")
        term.expect(b"Allow?")
        os.write(fd, b"y\r")
        term.expect(b"made it")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    assert (work / "approved").exists()
    assert model_server.requests[0]["messages"][-1]["content"] == "make the file"


def test_berserk_on_the_embedded_default_starts_and_stops_everything(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    from swarm.testing.scripts import ByTask, tool_results

    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    model_server.responder = ByTask({
        "ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": f"CHILD {i}: count"},
                                            id=f"c{i}") for i in range(3)]),
                 lambda r: Reply(content=f"{len(tool_results(r))} children answered")],
        "CHILD": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo hi > out.txt"})]),
                  Reply(content="child ok")],
    })
    result = swarm("run", "--yes", "ROOT fan out", env=env_for(model_server, home), cwd=work)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "3 children answered\n"
    assert result.stderr.count("] done") == 3
    # Coordinator, worker and server were started for the job and stop on their own once
    # it has answered (the command does not wait for them).
    wait_until(lambda: not EmbeddedServer(home).status().running, "the server to stop")
    import re

    worker_log = (home / "logs" / "worker-0.log").read_text()
    cli_pid = re.search(r"local0-(\d+)@", worker_log)
    assert cli_pid, worker_log[-2000:]
    wait_until(lambda: subprocess.run(["pgrep", "-f", f"-{cli_pid.group(1)}@"],
                                      capture_output=True, text=True).stdout == "",
               "the local coordinator and worker to stop")
    for log in (home / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()[-2000:]
    # A second job right after: the first one's workers are gone, so it starts its own
    # (their heartbeats must not make it wait for workers that no longer exist).
    again = swarm("run", "--yes", "--new", "ROOT fan out", env=env_for(model_server, home),
                  cwd=work, timeout=60)
    assert again.returncode == 0, again.stderr
    assert again.stdout == "3 children answered\n"
