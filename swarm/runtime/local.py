"""Local processes for the embedded default: one coordinator and N worker processes.

``swarm run`` starts them in the background as it starts (they boot while the model
thinks about its first answer) and lets them go when it exits: :meth:`LocalCluster.let_go`
signals them and returns at once; they stop on their own, the embedded server after the
last of them (they are its users, like the ``swarm run`` that started them). Their logs go
to ``SWARM_HOME/logs/``.
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

from swarm.errors import RuntimeUnavailable, SwarmError
from swarm.runtime.malloc import worker_env
from swarm.store import keys
from swarm.store.server import release_held

log = logging.getLogger(__name__)

#: Seconds a stopping worker gets before it is killed (its children are abandoned).
STOP_GRACE = 5.0


#: Heartbeat names of the processes a ``swarm run`` starts for itself start with this.
LOCAL_PREFIX = "local"


def alive(redis_: redis.Redis, kind: str) -> list[str]:
    """Names of live coordinators or workers (``kind``), from their heartbeat keys."""
    prefix = keys.heartbeat(kind, "")
    return sorted(str(k)[len(prefix):] for k in redis_.scan_iter(match=prefix + "*", count=200))


def shared(names: list[str]) -> list[str]:
    """The names that are not another ``swarm run``'s own local processes (those stop
    with their run, so no other run can count on them)."""
    return [n for n in names if not n.startswith(LOCAL_PREFIX)]


def wait_for(redis_: redis.Redis, timeout: float,
             procs: list[subprocess.Popen[bytes]] | None = None,
             names: list[tuple[str, str]] | None = None) -> None:
    """Wait until a coordinator and a worker answer (``names``: these (kind, name) ones);
    raise :class:`RuntimeUnavailable`."""
    deadline = time.monotonic() + timeout
    while True:
        if names:
            here = redis_.exists(*(keys.heartbeat(k, n) for k, n in names))
            missing = [] if here == len(names) else sorted({k for k, _ in names})
        else:
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
        time.sleep(0.02)


class LocalCluster:
    """A coordinator and ``workers`` worker processes on ``redis_url``.

    ``embedded``: ``redis_url`` is the embedded server of ``home``, which the processes then
    use as its users (through ``SWARM_HOME``, not ``SWARM_REDIS_URL``): the server stays up
    until the last of them has stopped, so :meth:`let_go` need not wait for them.
    ``fallback``: the workers of a root in a terminal that runs its commands unconfined, on
    its own server: where they cannot box commands, they run such roots' children
    unconfined rather than refuse them (:data:`swarm.agent.sandbox.FALLBACK`, in their
    environment: no command of theirs can change it).
    """

    def __init__(self, redis_url: str, home: Path, workers: int = 1, concurrency: int = 64,
                 env: dict[str, str] | None = None, embedded: bool = False,
                 master: str = "", fallback: bool = False) -> None:
        self.extra_env = dict(env or {})
        """Set in the processes' environment on top of this one's (tests plant keys here)."""
        self.redis_url = redis_url
        self.master = master
        """The master's name when ``redis_url`` lists sentinels."""
        self.embedded = embedded
        self.fallback = fallback
        self.home = home
        self.workers = max(1, workers)
        self.concurrency = max(1, concurrency)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[tuple[str, str]] = []
        self._logs: list[IO[bytes]] = []

    def _start(self, name: str, *args: str, secrets: bool = False) -> None:
        """Start ``swarm ARGS``; ``secrets``: hand the secret variables over through a pipe
        (as :func:`swarm.secrets.hide_from_proc` does), so it need not re-execute itself."""
        from swarm.agent.sandbox import FALLBACK
        from swarm.secrets import handover

        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115  (closed in stop())
        self._logs.append(out)
        env = {**os.environ, **self.extra_env, "SWARM_HOME": str(self.home),
               "SWARM_PARENT_PID": str(os.getpid())}
        env.pop(FALLBACK, None)  # never inherited: only the root that starts them sets it
        if self.fallback:
            env[FALLBACK] = "1"
        if self.embedded:
            env.pop("SWARM_REDIS_URL", None)
        else:
            env["SWARM_REDIS_URL"] = self.redis_url
            if self.master:
                env["SWARM_REDIS_MASTER"] = self.master
        if args[0] == "worker":
            env = worker_env(env)  # it need not start itself again (swarm.runtime.malloc)
        fds: tuple[int, ...] = ()
        if secrets:
            env, fd = handover(env)
            fds = (fd,) if fd is not None else ()
        try:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "swarm", *args], env=env, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                pass_fds=fds))
        finally:
            for fd in fds:
                os.close(fd)

    def start(self) -> LocalCluster:
        host = socket.gethostname()
        pid = os.getpid()
        self._start("coordinator", "coordinator", "--name", f"{LOCAL_PREFIX}-{pid}@{host}")
        self.names = [("coordinator", f"{LOCAL_PREFIX}-{pid}@{host}")]
        for i in range(self.workers):
            self._start(f"worker-{i}", "worker", "--concurrency", str(self.concurrency),
                        "--hostname", f"{LOCAL_PREFIX}{i}-{pid}@{host}", secrets=True)
            self.names.append(("worker", f"{LOCAL_PREFIX}{i}-{pid}@{host}"))
        return self

    def let_go(self, redis_: redis.Redis) -> None:
        """Let the processes go without waiting for them: nobody counts on them from now
        on (their heartbeats are deleted) and they are told to stop (SIGTERM), which they
        do on their own, finishing what they run (nothing, at the end of a job)."""
        with contextlib.suppress(redis.RedisError):
            redis_.delete(*(keys.heartbeat(kind, name) for kind, name in self.names))
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for out in self._logs:
            out.close()
        self.procs.clear()
        self._logs.clear()

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop every process: SIGTERM, then SIGKILL after ``grace`` seconds (a run cut
        short so is taken over from its last saved step by the next worker to claim it)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
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

            connect(self.redis_url, retries=0, master=self.master).delete(
                *(keys.heartbeat(kind, name) for kind, name in self.names))
        for out in self._logs:
            out.close()
        self.procs.clear()
        self._logs.clear()


def started_for_a_run() -> bool:
    """Whether this process was started by :class:`LocalCluster` (for a ``swarm run``): it
    adopts that run's embedded server and never starts one of its own."""
    return bool(os.environ.get("SWARM_PARENT_PID"))


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
                release_held()  # os._exit skips atexit: the server must not be left running
                os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
