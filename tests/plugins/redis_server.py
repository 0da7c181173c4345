"""Pytest plugin: one real embedded Valkey server for the whole test session.

``redis_server`` is its URL; ``redis`` is a connected client on a flushed database.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis as redis_py

from swarm.store.connection import connect
from swarm.store.server import EmbeddedServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a real server started once in a temporary SWARM_HOME (stopped at the end)."""
    server = EmbeddedServer(tmp_path_factory.mktemp("redis-home"))
    url = server.ensure()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture
def redis(redis_server: str) -> Iterator[redis_py.Redis]:
    """A client of ``redis_server`` on an empty database."""
    client = connect(redis_server)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()
