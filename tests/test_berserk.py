"""Berserk mode end to end: real Redis, a real coordinator and Celery worker processes,
the scripted model over HTTP answering many conversations at once."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result

from swarm.cli import main
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.snapshots import SnapshotStore
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, task_of, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until

pytestmark = pytest.mark.slow
SECRET = "sk-planted-secret-7f3a"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("berserk-home")
    # The workers get the key in their own environment, as in a deployment.
    with local_swarm(home, env={"SWARM_API_KEY": SECRET}) as url:
        yield url, home


@pytest.fixture(scope="module")
def model(cluster: tuple[str, Path]) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture
def client(cluster: tuple[str, Path]) -> redis_lib.Redis:
    return connect(cluster[0])


def swarm_run(cluster: tuple[str, Path], model: ScriptedModelServer, workspace: Path,
              task: str, **env: str) -> Result:
    url, home = cluster
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
                SWARM_API_KEY=SECRET, SWARM_RETRIES="1")
    base.update(env)
    return CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C", str(workspace),
                                     task], env=base, catch_exceptions=False)


def results_of(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(text) for text in tool_results(request)]


def agent_calls(*messages: str, prefix: str = "c") -> Reply:
    return Reply(tool_calls=[ToolCall("agent", {"message": m}, id=f"{prefix}{i}")
                             for i, m in enumerate(messages)])


def summarise(request: dict[str, Any]) -> Reply:
    return Reply(content=" | ".join(f"{r['state']}:{r.get('answer', r.get('error', ''))}"
                                    for r in results_of(request)))


def test_parallel_children_fan_in_in_call_order(cluster: tuple[str, Path],
                                                model: ScriptedModelServer,
                                                tmp_path: Path) -> None:
    model.responder = ByTask({
        "FANOUT": [agent_calls(*(f"CHILD-{i}: write your number" for i in range(5))), summarise],
        **{f"CHILD-{i}": [
            Reply(tool_calls=[ToolCall("run_cli", {"command": f"echo {i} > n.txt && sleep 0.5"})]),
            Reply(content=f"answer {i}")] for i in range(5)},
    })
    started = time.monotonic()
    result = swarm_run(cluster, model, tmp_path, "FANOUT the job")
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == " | ".join(f"done:answer {i}" for i in range(5))
    # Five children each sleeping 0.5 s: in parallel, not one after another.
    assert elapsed < 2.5 + 2.0, elapsed
    final = [r for r in model.requests if task_of(r) == "FANOUT the job"][-1]
    results = results_of(final)
    assert [r["answer"] for r in results] == [f"answer {i}" for i in range(5)]
    for r in results:
        assert r["files_changed"] == ["n.txt"]
        assert Path(r["workspace"]).is_dir() and r["workspace"] != str(tmp_path)
        assert r["usage"]["total_tokens"] > 0
        assert re.fullmatch(r"a[0-9a-f]{15}", r["agent_id"])
    assert len({r["workspace"] for r in results}) == 5


def test_depth_three_and_the_depth_limit(cluster: tuple[str, Path], model: ScriptedModelServer,
                                         tmp_path: Path) -> None:
    def leaf(request: dict[str, Any]) -> Reply:
        (refused,) = results_of(request)
        return Reply(content=f"leaf: {refused['state']}: {refused['error']}")

    def relay(request: dict[str, Any]) -> Reply:
        (child,) = results_of(request)
        return Reply(content=f"via: {child['answer']}")

    model.responder = ByTask({
        "LEVEL0": [agent_calls("LEVEL1 go deeper"), relay],
        "LEVEL1": [agent_calls("LEVEL2 go deeper"), relay],
        "LEVEL2": [agent_calls("LEVEL3 go deeper"), relay],
        "LEVEL3": [agent_calls("LEVEL4 too deep"), leaf],
    })
    result = swarm_run(cluster, model, tmp_path, "LEVEL0 root", SWARM_MAX_DEPTH="3")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("via: via: via: leaf: refused: depth limit reached: a child "
                                    "here would be at depth 4"), result.stdout
    assert "SWARM_MAX_DEPTH" in result.stdout


def test_root_depth_refusal_and_children_limit(cluster: tuple[str, Path],
                                               model: ScriptedModelServer,
                                               tmp_path: Path) -> None:
    model.responder = ByTask({
        "LIMITS": [agent_calls("KID one", "KID two", "KID three"), summarise],
        "KID": [Reply(content="kid done")],
    })
    result = swarm_run(cluster, model, tmp_path, "LIMITS", SWARM_MAX_CHILDREN="2")
    assert result.exit_code == 0, result.stderr
    parts = result.stdout.strip().split(" | ")
    assert parts[:2] == ["done:kid done", "done:kid done"]
    assert parts[2].startswith("refused:children limit reached")


def test_in_flight_limit_queues_instead_of_refusing(cluster: tuple[str, Path],
                                                    model: ScriptedModelServer,
                                                    tmp_path: Path) -> None:
    model.responder = ByTask({
        "SERIAL": [agent_calls("ONE-AT-A-TIME a", "ONE-AT-A-TIME b", "ONE-AT-A-TIME c"),
                   summarise],
        "ONE-AT-A-TIME": [Reply(content="ok")],
    })
    result = swarm_run(cluster, model, tmp_path, "SERIAL", SWARM_MAX_PARALLEL="1")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "done:ok | done:ok | done:ok"


def test_continue_a_child_by_agent_id(cluster: tuple[str, Path], model: ScriptedModelServer,
                                      tmp_path: Path) -> None:
    def continue_it(request: dict[str, Any]) -> Reply:
        (first,) = results_of(request)
        return Reply(tool_calls=[ToolCall("agent", {"message": "MEMO now recall it",
                                                    "agent_id": first["agent_id"]}, id="again")])

    def recall(request: dict[str, Any]) -> Reply:
        users = [m["content"] for m in request["messages"] if m["role"] == "user"]
        return Reply(content=f"I was asked {len(users)} times; first: {users[0][:30]}")

    model.responder = ByTask({
        "CONTINUE": [agent_calls("MEMO remember 42"), continue_it,
                     lambda r: Reply(content="final: " + results_of(r)[0]["answer"])],
        "MEMO": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo 42 > memo.txt"})]),
                 Reply(content="noted"), recall],
    })
    result = swarm_run(cluster, model, tmp_path, "CONTINUE")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "final: I was asked 2 times; first: MEMO remember 42"
    root_requests = [r for r in model.requests if task_of(r) == "CONTINUE"]
    first = results_of(root_requests[1])[0]
    second = results_of(root_requests[2])[0]
    assert first["agent_id"] == second["agent_id"]
    assert first["workspace"] == second["workspace"]
    assert (Path(first["workspace"]) / "memo.txt").read_text() == "42\n"


def test_output_schema_valid_retried_and_invalid(cluster: tuple[str, Path],
                                                 model: ScriptedModelServer,
                                                 tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"count": {"type": "integer"}},
              "required": ["count"], "additionalProperties": False}
    model.responder = ByTask({
        "SCHEMAS": [Reply(tool_calls=[
            ToolCall("agent", {"message": f"SHAPE-{k}", "output_schema": schema}, id=k)
            for k in ("good", "retry", "bad")]),
            lambda r: Reply(content=json.dumps(results_of(r)))],
        "SHAPE-good": [Reply(content='{"count": 3}')],
        "SHAPE-retry": [Reply(content="it is three"), Reply(content='```json\n{"count": 3}\n```')],
        "SHAPE-bad": [Reply(content='{"count": "three"}')],
    })
    result = swarm_run(cluster, model, tmp_path, "SCHEMAS")
    assert result.exit_code == 0, result.stderr
    good, retry, bad = json.loads(result.stdout)
    assert good["state"] == "done" and good["output"] == {"count": 3}
    assert retry["state"] == "done" and retry["output"] == {"count": 3}
    assert bad["state"] == "failed"
    assert "did not match output_schema" in bad["error"]
    assert "'three' is not of type" in bad["error"]
    asked = next(r for r in model.requests if "SHAPE-good" in json.dumps(r["messages"][1]))
    assert '"count"' in asked["messages"][1]["content"]  # the schema was shown to the child


def test_status_and_ledger(cluster: tuple[str, Path], model: ScriptedModelServer,
                           tmp_path: Path, client: redis_lib.Redis) -> None:
    model.responder = ByTask({"STATUS": [agent_calls("SMALL one", "SMALL two"), summarise],
                              "SMALL": [Reply(content="small")]})
    assert swarm_run(cluster, model, tmp_path, "STATUS job").exit_code == 0
    ledger = Ledger(client)
    swarm_id = ledger.latest_swarm()
    assert swarm_id is not None
    agents = ledger.agents(swarm_id)
    assert [a.depth for a in agents] == [0, 1, 1]
    assert {a.state for a in agents} == {"done"}
    url, home = cluster
    out = CliRunner().invoke(main, ["status"], env={"SWARM_REDIS_URL": url,
                                                    "SWARM_HOME": str(home)})
    assert out.exit_code == 0, out.output
    assert swarm_id in out.stdout and "3 done" in out.stdout
    assert out.stdout.count("SMALL") == 2
    as_json = CliRunner().invoke(main, ["status", "--json", swarm_id],
                                 env={"SWARM_REDIS_URL": url, "SWARM_HOME": str(home)})
    assert len(json.loads(as_json.stdout)["agents"]) == 3


def test_no_secret_in_ledger_or_task_args(cluster: tuple[str, Path], client: redis_lib.Redis,
                                          model: ScriptedModelServer, tmp_path: Path) -> None:
    model.responder = ByTask({"SECRETS": [agent_calls("PEEK at env"), summarise],
                              "PEEK": [Reply(tool_calls=[ToolCall("run_cli", {"command": "env"})]),
                                       Reply(content="looked")]})
    assert swarm_run(cluster, model, tmp_path, "SECRETS").exit_code == 0
    dump = []
    raw = SnapshotStore(client).raw  # snapshot chunks are binary
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == "string":
            dump.append(raw.get(key).decode("utf-8", "replace"))
        elif kind == "hash":
            dump.append(json.dumps(client.hgetall(key)))
        elif kind == "list":
            dump.append(json.dumps(client.lrange(key, 0, -1)))
        elif kind == "stream":
            dump.append(json.dumps(client.xrange(key)))
    text = "\n".join(dump)
    assert "PEEK" in text  # the dump did read the ledger and the task messages
    assert SECRET not in text


def test_a_childs_work_in_a_git_workspace_lands_uncommitted_in_the_users_folder(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("base\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    model.responder = ByTask({
        "GITROOT": [agent_calls("GITCHILD edit"), lambda r: Reply(content=tool_results(r)[0])],
        "GITCHILD": [Reply(tool_calls=[ToolCall("run_cli", {
            "command": "cat README && echo child > CHILD.txt"})]), Reply(content="edited")],
    })
    result = swarm_run(cluster, model, repo, "GITROOT")
    assert result.exit_code == 0, result.stderr
    child = json.loads(result.stdout)
    assert child["landing"] == "landed" and "git_branch" not in child, child
    assert child["files_changed"] == ["CHILD.txt"]
    # The child started from the parent's HEAD; its work is in the parent's folder,
    # uncommitted, and kept under a ref git branch does not list.
    assert (repo / "CHILD.txt").read_text() == "child\n"
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True,
                            check=True).stdout
    assert status == "?? CHILD.txt\n"
    assert child["kept"].startswith("refs/swarm/") and child["kept"].endswith(child["agent_id"])
    shown = subprocess.run([*git, "show", f"{child['kept']}:CHILD.txt"],
                           capture_output=True, text=True, check=True)
    assert shown.stdout == "child\n"
    branches = subprocess.run([*git, "branch", "--list"], capture_output=True, text=True,
                              check=True).stdout
    assert "swarm/" not in branches and not (repo / ".git" / "worktrees").exists()


def test_children_start_with_the_users_hints(cluster: tuple[str, Path], client: redis_lib.Redis,
                                             model: ScriptedModelServer, tmp_path: Path) -> None:
    from swarm.store.hints import HomeHints

    HomeHints(client, cluster[1]).save("HINT-7: the data is in /srv/data")
    model.responder = ByTask({"HINTED": [agent_calls("HINTCHILD look"), summarise],
                              "HINTCHILD": [Reply(content="seen")]})
    try:
        assert swarm_run(cluster, model, tmp_path, "HINTED").exit_code == 0
    finally:
        client.delete("swarm:hints:global")
    child = next(r for r in model.requests if task_of(r) == "HINTCHILD look")
    system = child["messages"][0]["content"]
    assert "HINT-7: the data is in /srv/data" in system
    assert "You are agent a" in system and "depth 1" in system


def test_a_job_runs_its_root_on_the_workers(cluster: tuple[str, Path], client: redis_lib.Redis,
                                            model: ScriptedModelServer, tmp_path: Path) -> None:
    from swarm.broker.app import configure
    from swarm.runtime.jobs import job_state, submit_job

    model.responder = ByTask({"JOBROOT": [agent_calls("JOBKID a", "JOBKID b"), summarise],
                              "JOBKID": [Reply(content="kid")]})
    ledger = Ledger(client)
    settings = {"base_url": model.base_url, "model": model.models[0], "yes": True}
    swarm_id = submit_job(ledger, configure(cluster[0]), "JOBROOT do it", tmp_path, settings)
    wait_until(lambda: job_state(ledger, swarm_id)["state"] not in ("queued", "running"),
               "the job to settle", every=0.1)
    job = job_state(ledger, swarm_id)
    assert job["state"] == "done" and job["answer"] == "done:kid | done:kid"
    assert [a["depth"] for a in job["agents"]] == [0, 1, 1]
    assert job["usage"]["total_tokens"] > 0
    assert ledger.swarm(swarm_id)["state"] == "done"
    root_request = next(r for r in model.requests if task_of(r) == "JOBROOT do it")
    assert "running a job submitted to the swarm" in root_request["messages"][0]["content"]


def test_parked_parents_free_their_slot(cluster: tuple[str, Path], model: ScriptedModelServer,
                                        tmp_path: Path) -> None:
    """With one child in flight at a time, a parent waiting on its own child must not hold
    the only slot (that deadlocked: the grandchild waited forever)."""
    def relay(request: dict[str, Any]) -> Reply:
        return Reply(content="via " + results_of(request)[0].get("answer", "?"))

    model.responder = ByTask({
        "NEST0": [agent_calls("NEST1 down"), relay],
        "NEST1": [agent_calls("NEST2 down", "NEST2 again"), relay],
        "NEST2": [Reply(content="bottom")],
    })
    result = swarm_run(cluster, model, tmp_path, "NEST0", SWARM_MAX_PARALLEL="1")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "via via bottom"


def test_a_workspace_that_is_gone_fails_the_run_instead_of_an_empty_folder(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    def break_workspace_and_continue(request: dict[str, Any]) -> Reply:
        (first,) = results_of(request)
        workspace = Path(first["workspace"])
        shutil.rmtree(workspace)
        workspace.write_text("not a folder any more")  # the worker cannot prepare it
        return Reply(tool_calls=[ToolCall("agent", {"message": "BROKEN again",
                                                    "agent_id": first["agent_id"]}, id="again")])

    model.responder = ByTask({
        "CRASH": [agent_calls("BROKEN first"), break_workspace_and_continue, summarise],
        "BROKEN": [Reply(content="first ok")],
    })
    result = swarm_run(cluster, model, tmp_path, "CRASH")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("failed:workspace lost: the workspace of a"), result.stdout
    assert "no snapshot of it was taken" in result.stdout


def _repo_with_work_in_progress(path: Path) -> Path:
    path.mkdir()
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "tracked.txt").write_text("committed\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    (path / "tracked.txt").write_text("uncommitted\n")
    (path / "new.txt").write_text("untracked\n")
    (path / ".env").write_text("API_TOKEN=do-not-ship\n")
    return path


def test_a_child_starts_from_the_parents_uncommitted_and_untracked_files(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    repo = _repo_with_work_in_progress(tmp_path / "repo")
    model.responder = ByTask({
        "SEEDROOT": [agent_calls("SEEDKID look"), lambda r: Reply(content=tool_results(r)[0])],
        "SEEDKID": [Reply(tool_calls=[ToolCall("run_cli", {
            "command": "cat tracked.txt new.txt; ls -a | grep -c '^.env$' || true"})]),
            lambda r: Reply(content=tool_results(r)[0])],
    })
    result = swarm_run(cluster, model, repo, "SEEDROOT")
    assert result.exit_code == 0, result.stderr
    child = json.loads(result.stdout)
    assert child["answer"].split()[:3] == ["uncommitted", "untracked", "0"], child
    # It changed nothing: nothing lands, nothing is kept, and the user's repository got
    # neither a branch nor a worktree for it (its repository was its own).
    assert child["changes"].startswith("none") and child["landing"] == "no changes", child
    assert "kept" not in child and "git_branch" not in child
    refs = subprocess.run(["git", "-C", str(repo), "for-each-ref", "refs/heads",
                           "refs/swarm/*/" + child["agent_id"]],
                          capture_output=True, text=True, check=True).stdout
    assert "swarm" not in refs and not (repo / ".git" / "worktrees").exists()


def test_seed_false_starts_a_child_in_an_empty_folder(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    repo = _repo_with_work_in_progress(tmp_path / "repo")
    model.responder = ByTask({
        "EMPTYROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "EMPTYKID look",
                                                           "seed": False}, id="e")]),
                      lambda r: Reply(content=tool_results(r)[0])],
        "EMPTYKID": [Reply(tool_calls=[ToolCall("run_cli", {"command": "ls -A | wc -l"})]),
                     lambda r: Reply(content=tool_results(r)[0])],
    })
    result = swarm_run(cluster, model, repo, "EMPTYROOT")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["answer"].split()[0] == "0"


def test_an_agent_call_over_the_snapshot_cap_is_refused_with_what_to_do(
        cluster: tuple[str, Path], model: ScriptedModelServer, tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"x" * 5000)
    model.responder = ByTask({
        "CAPROOT": [agent_calls("CAPKID never"), lambda r: Reply(content=tool_results(r)[0])],
        "CAPKID": [Reply(content="should not run")],
    })
    result = swarm_run(cluster, model, tmp_path, "CAPROOT", SWARM_SNAPSHOT_MAX="1000")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("error: the child was not started: the workspace "
                                    "snapshot is 5.0 KB in 1 files; the cap is 1.0 KB "
                                    "(SWARM_SNAPSHOT_MAX)"), result.stdout
    assert not [r for r in model.requests if task_of(r) == "CAPKID never"]


def test_a_child_that_changed_nothing_sends_nothing_home_and_says_so(
        cluster: tuple[str, Path], client: redis_lib.Redis, model: ScriptedModelServer,
        tmp_path: Path) -> None:
    repo = _repo_with_work_in_progress(tmp_path / "repo")
    model.responder = ByTask({
        "SAMEROOT": [agent_calls("SAMEKID look", "SAMEKID write"),
                     lambda r: Reply(content=json.dumps(results_of(r)))],
        "SAMEKID look": [Reply(tool_calls=[ToolCall("run_cli", {"command": "cat new.txt"})]),
                         Reply(content="looked")],
        "SAMEKID write": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo x > x.txt"})]),
                          Reply(content="wrote")],
    })
    result = swarm_run(cluster, model, repo, "SAMEROOT")
    assert result.exit_code == 0, result.stderr
    looked, wrote = json.loads(result.stdout)
    assert looked["changes"].startswith("none") and not looked.get("files_changed")
    assert looked["landing"] == "no changes" and "kept" not in looked
    assert Ledger(client).agent(looked["agent_id"]).ws_state == ""  # type: ignore[union-attr]
    assert "changes" not in wrote and wrote["landing"] == "landed"
    # The snapshot its work went home in, on its record (with its settlement): a
    # continuation on another host restores it.
    assert Ledger(client).agent(wrote["agent_id"]).ws_state  # type: ignore[union-attr]
    assert wrote["kept"].endswith(f"/{wrote['agent_id']}")
    assert wrote["files_changed"] == ["x.txt"]
    assert (repo / "x.txt").read_text() == "x\n"
