"""``swarm serve`` as a real process on its own SWARM_HOME: stopped by a signal (a service
manager's SIGTERM, Ctrl-C, a closed terminal's SIGHUP), it shuts down gracefully and leaves
nothing running (issue 14: SIGTERM orphaned the embedded Valkey server)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

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
