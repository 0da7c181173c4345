"""Local processes for the embedded default: one coordinator and N worker processes.

``swarm run`` starts them the first time its agent goes berserk (a job that never
calls ``agent`` starts nothing) and stops them when it exits. Their logs go to
``SWARM_HOME/logs/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import redis

from swarm import secrets
from swarm.errors import RuntimeUnavailable, SwarmError
from swarm.store import keys

log = logging.getLogger(__name__)

#: Seconds a stopping worker gets before it is killed (its children are abandoned).
STOP_GRACE = 5.0


def alive(redis_: redis.Redis, kind: str) -> list[str]:
    """Names of live coordinators or workers (``kind``), from their heartbeat keys."""
    prefix = keys.heartbeat(kind, "")
    return sorted(str(k)[len(prefix):] for k in redis_.scan_iter(match=prefix + "*", count=200))


def wait_for(redis_: redis.Redis, timeout: float,
             procs: list[subprocess.Popen[bytes]] | None = None) -> None:
    """Wait until a coordinator and a worker answer; raise :class:`RuntimeUnavailable`."""
    deadline = time.monotonic() + timeout
    while True:
        missing = [k for k in ("coordinator", "worker") if not alive(redis_, k)]
        if not missing:
            return
        for proc in procs or []:
            if proc.poll() is not None:
                raise RuntimeUnavailable(
                    f"a local swarm process ({proc.args!r}) exited with code "
                    f"{proc.returncode}; see its log under SWARM_HOME/logs")
        if time.monotonic() >= deadline:
            raise RuntimeUnavailable(
                f"no {' and no '.join(missing)} answered within {timeout:.0f} s on this Redis. "
                "Start them (`swarm coordinator`, `swarm worker`) where SWARM_REDIS_URL points, "
                "or pass --workers N to run local ones")
        time.sleep(0.05)


class LocalCluster:
    """A coordinator and ``workers`` worker processes on ``redis_url``."""

    def __init__(self, redis_url: str, home: Path, workers: int = 1, concurrency: int = 64,
                 env: dict[str, str] | None = None) -> None:
        self.extra_env = dict(env or {})
        """Set in the processes' environment on top of this one's (tests plant keys here)."""
        self.redis_url = redis_url
        self.home = home
        self.workers = max(1, workers)
        self.concurrency = max(1, concurrency)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[tuple[str, str]] = []
        self._logs: list[IO[bytes]] = []

    def _spawn(self, name: str, *args: str) -> None:
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115  (closed in stop())
        self._logs.append(out)
        env = {**os.environ, **self.extra_env, "SWARM_REDIS_URL": self.redis_url,
               "SWARM_HOME": str(self.home), "SWARM_PARENT_PID": str(os.getpid())}
        # The secrets go by a pipe, never in the environment the process's /proc shows.
        env, fd = secrets.handover(env)
        try:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "swarm", *args], env=env, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                pass_fds=(fd,) if fd >= 0 else ()))
        finally:
            if fd >= 0:
                os.close(fd)

    def start(self) -> LocalCluster:
        host = socket.gethostname()
        pid = os.getpid()
        self._spawn("coordinator", "coordinator", "--name", f"local-{pid}@{host}")
        self.names = [("coordinator", f"local-{pid}@{host}")]
        for i in range(self.workers):
            self._spawn(f"worker-{i}", "worker", "--concurrency", str(self.concurrency),
                        "--hostname", f"local{i}-{pid}@{host}")
            self.names.append(("worker", f"local{i}-{pid}@{host}"))
        return self

    def stop(self) -> None:
        """Stop every process: SIGTERM, then SIGKILL after :data:`STOP_GRACE` seconds."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        # Their heartbeats would otherwise outlive them by up to HEARTBEAT_TTL, and the
        # next `swarm run` would wait for workers that are gone.
        with contextlib.suppress(redis.RedisError, SwarmError):
            from swarm.store.connection import connect

            connect(self.redis_url, retries=0).delete(
                *(keys.heartbeat(kind, name) for kind, name in self.names),
                *(keys.worker_sandbox(name) for kind, name in self.names if kind == "worker"))
        for out in self._logs:
            out.close()
        self.procs.clear()
        self._logs.clear()


def exit_with_parent() -> None:
    """In a process started by :class:`LocalCluster`: stop when the ``swarm run`` that
    started it is gone (even SIGKILLed), so no local worker outlives its job."""
    parent = int(os.environ.get("SWARM_PARENT_PID") or 0)
    if not parent:
        return

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                log.warning("the swarm process %d that started this one is gone; stopping",
                            parent)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(STOP_GRACE)
                os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
