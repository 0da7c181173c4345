"""The timed scripted model in processes of its own, so that a wide job measures the swarm
and not the benchmark's process.

``python -m bench --model-processes K`` (the scaling part): K processes each serve the
scripted model (:class:`~bench.spawn.TimedModelServer`) on one port, bound with
``SO_REUSEPORT``, so the kernel spreads the children's connections over them. The
benchmark's process keeps only the root (``swarm run --workers 0``). Each process stamps
the requests it answers (``time.perf_counter``, the system's monotonic clock, the same in
every process); :meth:`ModelProcesses.take_stamps` gathers them. The responder (a
:class:`~bench.common.JobScript`) and the latency are sent to every process when set.
"""

from __future__ import annotations

import multiprocessing
import socket
from multiprocessing.connection import Connection
from typing import Any

from bench.spawn import MODEL, Stamp, TimedModelServer, _BenchHTTPServer


class _SharedPort(_BenchHTTPServer):
    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


def _serve(conn: Connection, port: int, latency: float) -> None:
    """One model process: serve, and answer the benchmark's requests on ``conn``."""
    server = TimedModelServer(latency=latency, models=[MODEL], nodelay=True, port=port)
    server.server_class = _SharedPort
    server.start()
    conn.send(server.port)
    try:
        while True:
            try:
                op, arg = conn.recv()
            except EOFError:
                return
            if op == "set":
                setattr(server, arg[0], arg[1])
                conn.send(True)
            elif op == "stamps":
                conn.send(server.take_stamps())
            else:
                conn.send(True)
                return
    finally:
        server.stop()


class ModelProcesses:
    """K model processes on one port; stands in for a :class:`TimedModelServer` (its
    ``base_url``, ``latency``, ``responder``, ``take_stamps``)."""

    def __init__(self, latency: float, processes: int) -> None:
        self._latency = latency
        self._responder: Any = None
        self.count = max(1, processes)
        self.port = 0
        self._procs: list[tuple[Any, Connection]] = []

    def start(self) -> ModelProcesses:
        ctx = multiprocessing.get_context("spawn")
        for _ in range(self.count):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, self.port, self._latency),
                               name="bench-model", daemon=True)
            proc.start()
            theirs.close()
            if not mine.poll(60):
                raise RuntimeError("bench: a model process did not start in 60 s")
            self.port = mine.recv()
            self._procs.append((proc, mine))
        return self

    def stop(self) -> None:
        for proc, conn in self._procs:
            try:
                conn.send(("stop", None))
                conn.recv()
            except (OSError, EOFError):
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
            conn.close()
        self._procs.clear()

    def __enter__(self) -> ModelProcesses:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [int(proc.pid) for proc, _ in self._procs]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _set(self, name: str, value: Any) -> None:
        for _, conn in self._procs:
            conn.send(("set", (name, value)))
        for _, conn in self._procs:
            conn.recv()

    @property
    def latency(self) -> float:
        return self._latency

    @latency.setter
    def latency(self, value: float) -> None:
        if value != self._latency:
            self._set("latency", value)
            self._latency = value

    @property
    def responder(self) -> Any:
        return self._responder

    @responder.setter
    def responder(self, value: Any) -> None:
        self._set("responder", value)
        self._responder = value

    def take_stamps(self) -> list[Stamp]:
        for _, conn in self._procs:
            conn.send(("stamps", None))
        stamps = [s for _, conn in self._procs for s in conn.recv()]
        return sorted(stamps, key=lambda s: s.arrived)
