"""A whole local swarm for tests, demos and benchmarks: an embedded server, a coordinator
and worker processes, started together and stopped together."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from swarm.runtime.local import LocalCluster, wait_for
from swarm.store.connection import connect
from swarm.store.server import EmbeddedServer


@contextmanager
def local_swarm(home: Path, *, workers: int = 1, concurrency: int = 16,
                env: Mapping[str, str] | None = None, timeout: float = 30) -> Iterator[str]:
    """Yield the Redis URL of a ready swarm under ``home``; ``env`` is set in the
    coordinator's and workers' environment. Everything is stopped on exit."""
    server = EmbeddedServer(home)
    url = server.ensure()
    try:
        cluster = LocalCluster(url, home, workers, concurrency, env=dict(env or {})).start()
        try:
            wait_for(connect(url), timeout, cluster.procs)
            yield url
        finally:
            cluster.stop()
    finally:
        server.stop()
