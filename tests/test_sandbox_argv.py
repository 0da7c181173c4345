"""What a command sees of the box its argument list builds (``Box.argv``), through the
public way in: a sandboxed :class:`LocalEnvironment` running it."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.agent import sandbox
from swarm.agent.shell import LocalEnvironment

pytestmark = pytest.mark.skipif(not sandbox.probe().ok,
                                reason="bubblewrap cannot run here")


def test_dev_shm_is_a_private_writable_tmpfs_of_the_capped_size(tmp_path: Path) -> None:
    result = LocalEnvironment(tmp_path, sandbox="bwrap").execute(
        "echo x > /dev/shm/probe && cat /dev/shm/probe; df -B1 --output=size /dev/shm | tail -1",
        10)
    assert result.output.split() == ["x", str(sandbox.TMP_SIZE)], result.output
