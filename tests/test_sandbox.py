"""run_cli inside bubblewrap: the workspace writable, the rest read-only, network optional."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from swarm.agent.shell import LocalEnvironment, sandbox_binary
from swarm.errors import ConfigError

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (apt-get install bubblewrap)")


@needs_bwrap
def test_workspace_writable_rest_read_only(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    outside = Path("/var/tmp") / f"swarm-sandbox-{tmp_path.name}.txt"
    env = LocalEnvironment(ws, sandbox="bwrap")
    result = env.execute(f"echo in > inside.txt && pwd && touch {outside}", 10)
    assert (ws / "inside.txt").read_text() == "in\n"
    assert str(ws) in result.output
    assert "Read-only file system" in result.output
    assert result.exit_code != 0
    assert not outside.exists()
    private = env.execute(f"touch /tmp/x-{tmp_path.name} && ls /tmp", 10)
    assert private.exit_code == 0  # a private /tmp: tools that need one work
    assert not (Path("/tmp") / f"x-{tmp_path.name}").exists()


@needs_bwrap
def test_network_can_be_cut(tmp_path: Path) -> None:
    env = LocalEnvironment(tmp_path, sandbox="bwrap", network=False)
    result = env.execute("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '", 10)
    assert result.output.split() == ["lo"]


def test_modes() -> None:
    assert sandbox_binary("none") is None
    if shutil.which("bwrap") is None:
        assert sandbox_binary("auto") is None
        with pytest.raises(ConfigError, match="apt-get install bubblewrap"):
            sandbox_binary("bwrap")
    else:
        assert sandbox_binary("auto") == shutil.which("bwrap")
