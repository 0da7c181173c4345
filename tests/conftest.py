"""Shared fixtures: a real Redis-compatible server per session, the scripted model over HTTP,
and a folder a sandboxed command's uid may enter."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.plugins.redis_server", "tests.plugins.model_server"]


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A folder anyone may enter, outside /tmp (which the box replaces with its own)."""
    folder = Path(tempfile.mkdtemp(prefix="swarm-test-", dir="/var/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
