"""``swarm flower``: no login is refused off loopback and warned about on it; and through
Flower's real HTTP API, every agent task names its parent agent's task (``parent_id``) and
its swarm's root task (``root_id``)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from click.testing import CliRunner

from swarm.broker.app import configure
from swarm.cli import main
from swarm.cli.runtime import is_loopback
from swarm.coordinator.service import root_task_id
from swarm.runtime.jobs import job_run_id, submit_job
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall

LOGIN = ("watcher", "flower-test-pw-3c1e")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_", "FLOWER_"))}
    env.update(extra)
    return env


def wait_until(check: Callable[[], Any], what: str, proc: subprocess.Popen[bytes],
               timeout: float = 60.0) -> Any:
    """Poll ``check`` until it returns something true (HTTP errors count as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            value = check()
            if value:
                return value
        assert proc.poll() is None, f"flower exited with code {proc.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@contextlib.contextmanager
def flower(redis_url: str, *args: str, stderr: IO[bytes] | None = None
           ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``swarm flower`` on a free loopback port; yields its URL and process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm", "flower", "--port", str(port), *args],
        env=clean_env(SWARM_REDIS_URL=redis_url), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=stderr or subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- authentication -----------------------------------------------------------------------


@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost",
                                     "LOCALHOST"])
def test_loopback_addresses(address: str) -> None:
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["0.0.0.0", "", "::", "10.0.0.5", "192.168.1.2",
                                     "flower.example.com", "128.0.0.1"])
def test_other_addresses_are_not_loopback(address: str) -> None:
    assert not is_loopback(address)


@pytest.mark.parametrize("address", ["0.0.0.0", "10.0.0.5", ""])
def test_flower_off_loopback_without_a_login_is_refused(address: str, tmp_path: Path) -> None:
    # A store nobody answers on: had the command gone past its check, it would say so.
    env = clean_env(SWARM_HOME=str(tmp_path), SWARM_REDIS_URL="redis://127.0.0.1:1/0")
    result = CliRunner().invoke(main, ["flower", "--address", address], env=env)
    assert result.exit_code == 1
    assert "no login" in result.output
    assert "--basic-auth user:password" in result.output
    assert "FLOWER_BASIC_AUTH" in result.output
    assert "Redis" not in result.output  # refused before touching the store

    # With a login (flag or environment) it goes on, to the store here.
    for args, extra in ((["--basic-auth", "a:b"], {}), ([], {"FLOWER_BASIC_AUTH": "a:b"})):
        result = CliRunner().invoke(main, ["flower", "--address", address, *args],
                                    env={**env, **extra})
        assert result.exit_code == 1
        assert "no login" not in result.output
        assert "cannot reach Redis" in result.output


@pytest.mark.slow
def test_flower_on_loopback_without_a_login_warns_and_serves(redis_server: str,
                                                             tmp_path: Path) -> None:
    log = tmp_path / "flower.err"
    with open(log, "wb") as err, flower(redis_server, stderr=err) as (url, proc):
        page = wait_until(lambda: httpx.get(url, timeout=5), "flower to answer", proc)
        assert page.status_code == 200  # no login asked
    text = log.read_text()
    assert f"warning: Flower on {url} has no login" in text
    assert "--basic-auth user:password" in text


# -- parent and root links ------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("flower-home")
    with local_swarm(home) as url:
        yield url, home


def agent_calls(*messages: str) -> Reply:
    return Reply(tool_calls=[ToolCall("agent", {"message": m}, id=f"call{i}")
                             for i, m in enumerate(messages)])


def echo(request: dict[str, Any]) -> Reply:
    return Reply(content=" | ".join(tool_results(request)))


@pytest.mark.slow
def test_flower_links_each_task_to_its_parent_and_root(swarm_home: tuple[str, Path],
                                                       tmp_path: Path) -> None:
    url, home = swarm_home
    ledger = Ledger(connect(url))
    model = ScriptedModelServer(responder=ByTask({
        "TREEROOT": [agent_calls("TREECHILD go one level down"), echo],
        "TREECHILD": [agent_calls("TREEGRAND one", "TREEGRAND two"), echo],
        "TREEGRAND": [Reply(content="leaf")],
        "JOBROOT": [agent_calls("JOBKID say hello"), echo],
        "JOBKID": [Reply(content="hello")],
    }))
    with (model, flower(url, "--basic-auth", ":".join(LOGIN)) as (api_url, proc),
          httpx.Client(base_url=f"{api_url}/api", auth=LOGIN, timeout=5) as api):
        # Flower reads the event stream once it reports the worker from its heartbeats.
        wait_until(lambda: True in api.get("/workers", params={"status": "true"}).json()
                   .values(), "flower to see the worker's events", proc)
        assert httpx.get(f"{api_url}/api/tasks", timeout=5).status_code == 401  # no login

        # A root in a terminal (no task of its own) -> child -> 2 grandchildren, one child
        # in flight at a time: the second grandchild waits, and is sent when the first
        # settles (both ways of sending a run name the parent).
        env: dict[str, str | None] = {
            k: None for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
        env.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
                   SWARM_API_KEY="unused", SWARM_MAX_PARALLEL="1")
        result = CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C",
                                           str(tmp_path), "TREEROOT start"], env=env)
        assert result.exit_code == 0, result.output
        assert "leaf" in result.stdout
        swarm_id = ledger.latest_swarm()
        assert swarm_id is not None
        agents = ledger.agents(swarm_id)
        [child_agent] = [a for a in agents if a["depth"] == "1"]
        grands = [a["run"] for a in agents if a["depth"] == "2"]
        assert len(grands) == 2, agents
        root, child = root_task_id(swarm_id), child_agent["run"]
        assert root == job_run_id(swarm_id)

        def info(task_id: str) -> dict[str, Any]:
            reply = api.get(f"/task/info/{task_id}")
            return dict(reply.json()) if reply.status_code == 200 else {}  # 404: not yet

        def settled(*task_ids: str) -> dict[str, dict[str, Any]] | None:
            infos = {t: info(t) for t in task_ids}
            return infos if all(i.get("state") == "SUCCESS" for i in infos.values()) else None

        def resumes_of(run: str) -> list[str]:
            """The resume tasks of ``run`` Flower lists as done (named "resume agent ..."
            or, when its task-sent event came last, after the task)."""
            return [i for i, t in api.get("/tasks").json().items()
                    if "resume" in str(t["name"]) and run in str(t["args"])
                    and t["state"] == "SUCCESS"]

        infos = wait_until(lambda: resumes_of(child) and settled(child, *grands),
                           "the tree's tasks in flower", proc)
        assert (infos[child]["parent_id"], infos[child]["root_id"]) == (root, root)
        for grand in grands:
            assert (infos[grand]["parent_id"], infos[grand]["root_id"]) == (child, root)
        # The child's resume (after its own children settled) hangs under the run it
        # carries on; Flower lists the child's tasks under it.
        [resume] = resumes_of(child)
        assert (info(resume)["parent_id"], info(resume)["root_id"]) == (child, root)
        assert sorted(infos[child]["children"]) == sorted([*grands, resume])
        # /api/tasks shows the same links as the task pages.
        listed = api.get("/tasks").json()
        for grand in grands:
            assert (listed[grand]["parent_id"], listed[grand]["root_id"]) == (child, root)

        # A job: its root runs as a task, the root every task of the job names.
        (tmp_path / "job").mkdir()
        job = submit_job(ledger, configure(url), "JOBROOT start", tmp_path / "job",
                         {"base_url": model.base_url, "yes": True})
        job_root = job_run_id(job)

        def job_child() -> str:
            return next((a["run"] for a in ledger.agents(job) if a.get("depth") == "1"), "")

        job_kid = wait_until(job_child, "the job's child in the ledger", proc)
        infos = wait_until(lambda: settled(job_root, job_kid), "the job's tasks", proc)
        assert infos[job_root]["root_id"] == job_root
        assert (infos[job_kid]["parent_id"], infos[job_kid]["root_id"]) == (job_root, job_root)
        assert job_kid in infos[job_root]["children"]
