"""``swarm serve`` as a real process on its own SWARM_HOME: stopped by a signal (a service
manager's SIGTERM, Ctrl-C, a closed terminal's SIGHUP), it shuts down gracefully and leaves
nothing running (issue 14: SIGTERM orphaned the embedded Valkey server)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from swarm.testing.server import ScriptedModelServer
from tests.helpers import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]
TOKEN = "serve-process-token-51c0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def processes_of(home: Path) -> dict[int, str]:
    """Live processes that work under ``home`` (their cwd), name it in their arguments, or
    have it as SWARM_HOME: the embedded server, local coordinators and workers."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, a zombie, or not ours
        if (cwd == str(home) or cwd.startswith(f"{home}/") or str(home) in args
                or f"SWARM_HOME={home}".encode() in environ):
            found[int(entry.name)] = f"{args.strip()} (cwd {cwd})"
    return found


def wait_answers(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2.0)
            return
        except httpx.TransportError:
            assert proc.poll() is None, f"swarm serve exited with code {proc.returncode}"
            assert time.monotonic() < deadline, "swarm serve did not answer"
            time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_serve_stopped_by_a_signal_leaves_no_process_behind(tmp_path: Path,
                                                            sig: signal.Signals) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_HOME=str(home), SWARM_SERVE_TOKEN=TOKEN)  # no SWARM_REDIS_URL
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm", "serve", "--port", str(port)], env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_answers(f"http://127.0.0.1:{port}/openapi.json", proc)
        started = processes_of(home)
        # The embedded server, the local coordinator and the worker (the check can see them).
        assert len(started) >= 3 and any("valkey" in a for a in started.values()), started
        proc.send_signal(sig)
        proc.wait(timeout=60)
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        left = processes_of(home)
        assert not left, f"left running: {left}\n{stderr}"
        assert proc.returncode == 0, stderr  # a graceful stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_of(home):  # a failed run must not leak into the next tests
            os.kill(pid, signal.SIGKILL)


def test_serve_stopped_ends_every_event_stream_and_exits_at_once(tmp_path: Path) -> None:
    """SIGTERM with clients following jobs (the API's event stream, an MCP call waiting for
    a job): each gets its last event at once and the service exits within 2 s, cleanly
    (before, uvicorn waited out its graceful timeout, cancelled them with two tracebacks,
    and the clients got no end)."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_HOME=str(home), SWARM_SERVE_TOKEN=TOKEN)
    port = free_port()
    # No local worker: the jobs stay queued, so their streams stay open until the stop.
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm", "serve", "--port", str(port), "--workers", "0"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    events: list[str] = []
    mcp: list[str] = []
    failures: list[BaseException] = []

    def read(lines: list[str], method: str, path: str, body: dict[str, object],
             **headers: str) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(5.0, read=60.0)) as client:
                if method == "GET":
                    job = client.post(f"{url}/v1/jobs", headers=auth, json=body).json()["id"]
                    path, body = f"/v1/jobs/{job}/events", {}
                with client.stream(method, f"{url}{path}", json=body or None,
                                   headers={**auth, **headers}) as response:
                    assert response.status_code == 200, response.read()
                    for line in response.iter_lines():
                        lines.append(line)
        except BaseException as exc:
            failures.append(exc)

    try:
        wait_answers(f"{url}/openapi.json", proc)
        followers = [
            threading.Thread(target=read, args=(events, "GET", "", {"task": "say hi"})),
            threading.Thread(target=read, args=(mcp, "POST", "/mcp", {
                "jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "submit_job", "_meta": {"progressToken": 1},
                           "arguments": {"task": "say hi", "wait_seconds": 600}}}),
                kwargs={"Accept": "application/json, text/event-stream"}),
        ]
        for follower in followers:
            follower.start()
        def following() -> bool:
            """Both follow their job: its "queued" event came (on MCP, as a progress
            notification)."""
            assert not failures, failures
            return "event: queued" in events and any("notifications/progress" in line
                                                     for line in mcp)

        wait_until(following, "both clients following their job", timeout=30)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - started
        for follower in followers:
            follower.join(timeout=10)
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        assert not failures, (failures, stderr)
        ends = [json.loads(line[5:]) for i, line in enumerate(events)
                if line.startswith("data:") and events[i - 1] == "event: end"]
        assert [e["reason"] for e in ends] == ["server stopping"], (events, stderr)
        (result,) = [json.loads(line[5:]) for line in mcp
                     if line.startswith("data:") and '"result"' in line]
        assert result["result"]["structuredContent"]["state"] == "queued", result
        assert proc.returncode == 0, stderr
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
        assert took < 2.0, f"stopped in {took:.2f} s\n{stderr}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_of(home):
            os.kill(pid, signal.SIGKILL)


def test_serve_stopped_while_its_local_worker_runs_a_child_exits_within_2_s(
        tmp_path: Path) -> None:
    """The local worker is busy with a job's command: the service still stops within 2 s
    (before, Celery's warm shutdown held it 5 s and more), cleanly, leaving no process."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    with ScriptedModelServer() as model:
        env.update(SWARM_HOME=str(home), SWARM_SERVE_TOKEN=TOKEN,
                   SWARM_BASE_URL=model.base_url, SWARM_SANDBOX="none")
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm", "serve", "--port", str(port)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        try:
            wait_answers(f"{url}/openapi.json", proc)
            with httpx.Client(timeout=10) as client:
                answer = client.post(f"{url}/v1/jobs", headers=auth,
                                     json={"task": "run `sleep 60`", "approve": "all"})
                assert answer.status_code == 201, answer.text

            def running_its_command() -> bool:
                assert proc.poll() is None
                return any("sleep 60" in args for args in processes_of(home).values())

            wait_until(running_its_command, "the job's command", timeout=60)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            took = time.monotonic() - started
            stderr = proc.stderr.read().decode() if proc.stderr else ""
            assert proc.returncode == 0, stderr
            assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
            assert took < 2.0, f"stopped in {took:.2f} s\n{stderr}"
            wait_until(lambda: not processes_of(home), "its processes to be gone", timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pid in processes_of(home):
                os.kill(pid, signal.SIGKILL)
