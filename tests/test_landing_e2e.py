"""Work that lands, end to end: a real `swarm run` in a repository with the user's own
uncommitted work, three children on real workers (scripted model): two land, one
conflicts; the user ends with one working tree, told what landed and what did not, and
nothing in `git branch` or `git worktree list` to clean."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from swarm.cli import main
from swarm.runtime.jobs import job_state
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("landing-home")
    with local_swarm(home) as url:
        yield url, home


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], capture_output=True, text=True, check=True).stdout


def command(text: str) -> Reply:
    return Reply(tool_calls=[ToolCall("run_cli", {"command": text})])


def committed(tmp_path: Path, files: dict[str, str]) -> Path:
    """A repository holding ``files``, committed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for name, text in files.items():
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    return repo


def env_of(cluster: tuple[str, Path], model: ScriptedModelServer) -> dict[str, str]:
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=cluster[0],
               SWARM_HOME=str(cluster[1]), SWARM_RETRIES="1")
    return env


def swarm_run(env: dict[str, str], repo: Path) -> Result:
    return CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C", str(repo), "ROOT"],
                              env=env, catch_exceptions=False)


LINES = "".join(f"line {n}\n" for n in range(1, 21))


def test_children_land_in_the_users_dirty_tree_and_a_conflict_is_named(
        cluster: tuple[str, Path], tmp_path: Path) -> None:
    url = cluster[0]
    repo = committed(tmp_path, {"shared.py": LINES})
    (repo / "shared.py").write_text((repo / "shared.py").read_text()
                                    .replace("line 2\n", "line 2 by the user\n"))
    (repo / "mine.txt").write_text("untracked, the user's\n")
    seen: list[list[dict[str, Any]]] = []

    def root_sums_up(request: dict[str, Any]) -> Reply:
        seen.append([json.loads(t) for t in tool_results(request)])
        return Reply(content="summed up")

    with ScriptedModelServer() as model:
        model.responder = ByTask({
            "ROOT": [Reply(tool_calls=[
                ToolCall("agent", {"message": "ADD a file"}, id="c0"),
                ToolCall("agent", {"message": "EDIT line 15"}, id="c1"),
                ToolCall("agent", {"message": "CLASH with its sibling"}, id="c2")]),
                root_sums_up],
            "ADD": [command("echo added > added.py"), Reply(content="added")],
            "EDIT": [command("sed -i 's/^line 15$/line 15 by a child/' shared.py"),
                     Reply(content="edited")],
            "CLASH": [command("sed -i 's/^line 15$/line 15 by another child/' shared.py"),
                      Reply(content="clashed")],
        })
        env = env_of(cluster, model)
        result = swarm_run(env, repo)
        assert result.exit_code == 0, result.stderr
        status = CliRunner().invoke(main, ["status", "--json"], env=env)
    shared = (repo / "shared.py").read_text()
    assert "line 2 by the user\n" in shared and "line 15 by a child\n" in shared
    assert "another child" not in shared and "<<<<<<<" not in shared
    assert (repo / "added.py").read_text() == "added\n"
    assert (repo / "mine.txt").read_text() == "untracked, the user's\n"
    # What landed is uncommitted; nothing to clean up.
    assert git(repo, "log", "--format=%s") == "base\n"
    assert git(repo, "branch", "--list").split() in (["*", "master"], ["*", "main"])
    assert len(git(repo, "worktree", "list").splitlines()) == 1
    # The person is told; the root's model got each child's landing state, in call order.
    assert "2 children landed" in result.stderr and "conflicts in shared.py" in result.stderr
    # It ends the run's output: what landed, in files and lines, and how to see the conflict.
    last = result.stderr.strip().splitlines()[-1]
    assert "2 children landed: 2 files changed in your working tree, +2 -1 lines" in last, last
    assert "see: git diff" in last
    (results,) = seen
    assert [r["landing"] for r in results] == ["landed", "landed", "conflict"]
    assert results[2]["conflicts"] == ["shared.py"] and "+line 15 by another child" in \
        results[2]["hunks"]
    shown = json.loads(status.stdout)
    agents = {a["id"]: a for a in shown["agents"]}
    assert sorted(a["landing"] or "" for a in agents.values()) == \
        ["", "conflict", "landed", "landed"]
    # The HTTP API's job and its event stream (SSE) carry them too.
    ledger = Ledger(connect(url))
    swarm_id = str(shown["swarm"]["id"])
    api = {a["id"]: a["landing"] for a in job_state(ledger, swarm_id)["agents"]}
    assert sorted(v or "" for v in api.values()) == ["", "conflict", "landed", "landed"]
    events = [f for _, f in ledger.events_since(swarm_id, "0-0") if f["kind"] == "landed"]
    assert sorted(e["landing"] for e in events) == ["conflict", "landed", "landed"]
    # The conflicting child's changes are kept, and can be shown and landed later.
    clash = results[2]["agent_id"]
    shown = CliRunner().invoke(main, ["land", clash, "--show", "-C", str(repo)], env=env)
    assert "+line 15 by another child" in shown.stdout
    refused = CliRunner().invoke(main, ["land", clash, "-C", str(repo)], env=env)
    assert refused.exit_code == 1 and "conflict" in refused.output
    assert (repo / "shared.py").read_text() == shared  # a conflict changes nothing
    # Once the user takes the other change back, it lands.
    (repo / "shared.py").write_text(shared.replace("line 15 by a child\n", "line 15\n"))
    landed = CliRunner().invoke(main, ["land", clash, "-C", str(repo)], env=env)
    assert landed.exit_code == 0, landed.output
    assert "line 15 by another child\n" in (repo / "shared.py").read_text()
    assert clash in git(repo, "for-each-ref", "--format=%(refname)", "refs/swarm/")
    CliRunner().invoke(main, ["land", "--clean", "-C", str(repo)], env=env)
    kept = [r for r in git(repo, "for-each-ref", "--format=%(refname)", "refs/swarm/").split()
            if r.split("/")[2] not in ("snap", "local")]
    assert kept == []


def test_a_childs_landing_that_fails_its_check_is_taken_back(
        cluster: tuple[str, Path], tmp_path: Path) -> None:
    repo = committed(tmp_path, {"app.py": "print('app')\n"})
    seen: list[list[dict[str, Any]]] = []

    def root_sums_up(request: dict[str, Any]) -> Reply:
        seen.append([json.loads(t) for t in tool_results(request)])
        return Reply(content="summed up")

    gate = "test ! -e bad.txt || { echo bad.txt breaks it; exit 1; }"
    with ScriptedModelServer() as model:
        model.responder = ByTask({
            "ROOT": [Reply(tool_calls=[
                ToolCall("agent", {"message": "GOOD", "check": gate}, id="c0"),
                ToolCall("agent", {"message": "BAD", "check": gate}, id="c1")]),
                root_sums_up],
            "GOOD": [command("echo good > good.txt"), Reply(content="good")],
            "BAD": [command("echo bad > bad.txt"), Reply(content="bad")],
        })
        result = swarm_run(env_of(cluster, model), repo)
    assert result.exit_code == 0, result.stderr
    (results,) = seen
    assert [r["landing"] for r in results] == ["landed", "check failed"]
    assert "bad.txt breaks it" in results[1]["check_output"]
    assert (repo / "good.txt").exists() and not (repo / "bad.txt").exists()
    assert "failed the check" in result.stderr


def test_a_conflicting_child_continued_redoes_its_change_over_the_parents_files_and_lands(
        cluster: tuple[str, Path], tmp_path: Path) -> None:
    repo = committed(tmp_path, {"shared.py": LINES})
    seen: dict[str, Any] = {}

    def continue_the_conflict(request: dict[str, Any]) -> Reply:
        results = [json.loads(t) for t in tool_results(request)]
        seen["first"] = [r["landing"] for r in results]
        return Reply(tool_calls=[ToolCall("agent", {
            "message": "REDO yours on line 16 instead", "agent_id": results[1]["agent_id"]},
            id="c2")])

    def redo(request: dict[str, Any]) -> Reply:
        seen["told"] = request["messages"][-1]["content"]
        return command("cat shared.py | grep -c 'by a child'; "
                       "sed -i 's/^line 16$/line 16 by another child/' shared.py")

    def root_ends(request: dict[str, Any]) -> Reply:
        seen["then"] = [json.loads(t)["landing"] for t in tool_results(request)]
        return Reply(content="done")

    with ScriptedModelServer() as model:
        model.responder = ByTask({
            "ROOT": [Reply(tool_calls=[
                ToolCall("agent", {"message": "EDIT line 15"}, id="c0"),
                ToolCall("agent", {"message": "CLASH on line 15"}, id="c1")]),
                continue_the_conflict, root_ends],
            "EDIT": [command("sed -i 's/^line 15$/line 15 by a child/' shared.py"),
                     Reply(content="edited")],
            "CLASH": [command("sed -i 's/^line 15$/line 15 by another child/' shared.py"),
                      Reply(content="clashed"), redo, Reply(content="redone")],
        })
        result = swarm_run(env_of(cluster, model), repo)
    assert result.exit_code == 0, result.stderr
    assert seen["first"] == ["landed", "conflict"] and seen["then"] == ["landed"]
    # It was told, and found its sibling's landed line in its files.
    assert "except in shared.py, where your parent's version is kept" in seen["told"]
    shared = (repo / "shared.py").read_text()
    assert "line 15 by a child\n" in shared and "line 16 by another child\n" in shared
    assert "line 15 by another child" not in shared
