"""What a command sees of the box its argument list builds (``Box.argv``), through the
public way in: a sandboxed :class:`LocalEnvironment` running it."""

from __future__ import annotations

import subprocess
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


def test_a_workspace_below_its_linked_worktrees_top_sees_the_rest_of_it_read_only(
        tmp_path: Path) -> None:
    """git in a subfolder reads the whole work tree: the rest of a linked worktree is in
    the box, read-only (mutants argv_146, _148: not bound, or bound with a wrong mode)."""
    repo, tree = tmp_path / "repo", tmp_path / "tree"
    (repo / "sub").mkdir(parents=True)
    (repo / "top.txt").write_text("top of the tree\n")
    (repo / "sub" / "mine.txt").write_text("mine\n")
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t",
                                                 "commit", "-qm", "one"],
                 ["worktree", "add", "-q", str(tree)]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    result = LocalEnvironment(tree / "sub", sandbox="bwrap").execute(
        "cat ../top.txt; echo changed > ../top.txt && echo wrote; echo ok > mine.txt && "
        "echo wrote mine", 10)
    assert "top of the tree" in result.output, result.output
    assert "wrote mine" in result.output and "wrote\n" not in result.output, result.output
    assert (tree / "top.txt").read_text() == "top of the tree\n"
    assert (tree / "sub" / "mine.txt").read_text() == "ok\n"
