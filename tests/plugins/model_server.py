"""The scripted OpenAI-compatible model over real HTTP on 127.0.0.1, one per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from swarm.testing.server import ScriptedModelServer


@pytest.fixture
def model_server() -> Iterator[ScriptedModelServer]:
    """A started :class:`ScriptedModelServer`; script it, point a client at ``.base_url``."""
    with ScriptedModelServer() as server:
        yield server
