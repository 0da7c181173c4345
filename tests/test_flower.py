"""``swarm flower``: no login is refused off loopback and warned about on it; through
Flower's real HTTP API, every agent task names its parent agent's task (``parent_id``) and
its swarm's root task (``root_id``); and nothing Flower serves shows the API key or the
Redis password of the swarm it watches."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from click.testing import CliRunner

from swarm.broker.app import configure
from swarm.cli import main
from swarm.cli.runtime import is_loopback
from swarm.coordinator.service import root_task_id
from swarm.runtime.jobs import job_run_id, submit_job
from swarm.runtime.local import LocalCluster, wait_for
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.server import EmbeddedServer
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests import helpers

LOGIN = ("watcher", "flower-test-pw-3c1e")
#: Planted in the workers' environment and the root's: Flower must never show it.
API_KEY = "sk-planted-flower-5e0b17"
#: The password of the swarm's Redis, in every process's SWARM_REDIS_URL: never shown either.
REDIS_PASSWORD = "pw-flower-redis-91d4c"


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
    """Poll ``check`` until it returns something true (HTTP errors count as not yet), as
    long as Flower runs."""
    def attempt() -> Any:
        assert proc.poll() is None, f"flower exited with code {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            return check()
        return None

    return helpers.wait_until(attempt, what, timeout=timeout, every=0.2)


@contextlib.contextmanager
def flower(redis_url: str, *args: str, stderr: IO[bytes] | None = None, **env: str
           ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``swarm flower`` on a free loopback port (``env`` set in its environment); yields
    its URL and process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm", "flower", "--port", str(port), *args],
        env=clean_env(SWARM_REDIS_URL=redis_url, **env), stdin=subprocess.DEVNULL,
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
    """A coordinator and a worker on a Redis with a password (:data:`REDIS_PASSWORD`, in
    the URL yielded), the worker holding the planted :data:`API_KEY`."""
    home = tmp_path_factory.mktemp("flower-home")
    server = EmbeddedServer(home)
    own = server.ensure()  # redis://:ITS_OWN_PASSWORD@127.0.0.1:PORT/0
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{urlsplit(own).port}/0"
    try:
        with connect(own) as admin:
            admin.config_set("requirepass", REDIS_PASSWORD)
        cluster = LocalCluster(url, home, workers=1, concurrency=16,
                               env={"SWARM_API_KEY": API_KEY}).start()
        try:
            wait_for(connect(url), 30, cluster.procs)
            yield url, home
        finally:
            cluster.stop()
    finally:
        with contextlib.suppress(redis.RedisError), connect(url) as admin:
            # Its own again, so the server stops by SHUTDOWN, at once.
            admin.config_set("requirepass", str(urlsplit(own).password))
        server.stop()


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
        [child_agent] = [a for a in agents if a.depth == 1]
        grands = [a.run for a in agents if a.depth == 2]
        assert len(grands) == 2, agents
        root, child = root_task_id(swarm_id), child_agent.run
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
            return next((a.run for a in ledger.agents(job) if a.depth == 1), "")

        job_kid = wait_until(job_child, "the job's child in the ledger", proc)
        infos = wait_until(lambda: settled(job_root, job_kid), "the job's tasks", proc)
        assert infos[job_root]["root_id"] == job_root
        assert (infos[job_kid]["parent_id"], infos[job_kid]["root_id"]) == (job_root, job_root)
        assert job_kid in infos[job_root]["children"]


# -- no secret in Flower ------------------------------------------------------------------


def run_env(url: str, home: Path, model: ScriptedModelServer, **extra: str
            ) -> dict[str, str | None]:
    """The environment of a `swarm run` whose root is this process, on the module's swarm."""
    env: dict[str, str | None] = {
        k: None for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
               **extra)
    return env


@pytest.mark.slow
def test_flower_lists_tasks_without_secrets(swarm_home: tuple[str, Path],
                                            tmp_path: Path) -> None:
    url, home = swarm_home
    # The model wants the planted key: the root and the worker did hold and use it.
    model = ScriptedModelServer(require_key=API_KEY, responder=ByTask({
        "FLOWERSECRET": [agent_calls("WATCHED one", "WATCHED two"), echo],
        "WATCHED": [Reply(content="seen")]}))
    with (model, flower(url, "--basic-auth", ":".join(LOGIN), SWARM_API_KEY=API_KEY)
          as (web_url, proc), httpx.Client(base_url=web_url, auth=LOGIN, timeout=10) as web):
        workers = wait_until(lambda: [name for name, up in web.get(
            "/api/workers", params={"status": "true"}).json().items() if up],
            "flower to see the worker's events", proc)
        result = CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C",
                                           str(tmp_path), "FLOWERSECRET start"],
                                    env=run_env(url, home, model, SWARM_API_KEY=API_KEY))
        assert result.exit_code == 0, result.output
        assert result.stdout.count("seen") == 2, result.stdout

        def watched() -> dict[str, dict[str, Any]] | None:
            """Every task Flower lists, once both children's runs are listed as done."""
            tasks: dict[str, dict[str, Any]] = web.get("/api/tasks").json()
            runs = [t for t in tasks.values() if "depth 1: WATCHED" in str(t["name"])
                    and t["state"] == "SUCCESS"]
            return tasks if len(runs) == 2 else None

        tasks = wait_until(watched, "both children's runs done in flower", proc)
        # Named after their agents (Celery's shadow name), with ids alone as arguments.
        runs = [t for t in tasks.values() if "depth 1: WATCHED" in str(t["name"])]
        assert all(re.fullmatch(r"\('r[0-9a-f]{15}',\)", t["args"]) for t in runs), runs
        assert all(t["kwargs"] == "{}" for t in runs), runs

        # Everything Flower serves about these tasks and workers: its API (task list,
        # each task's info and stored result, the workers with their stats and Celery
        # configuration, the queues) and its pages, as the watcher sees them.
        table = ("/tasks/datatable?draw=1&start=0&length=1000&search[value]="
                 "&order[0][column]=0&order[0][dir]=asc&columns[0][data]=name")
        pages = ["/api/tasks", "/api/workers?refresh=true", "/api/queues/length",
                 "/api/task/types", "/metrics", "/", "/workers", "/tasks", "/broker", table]
        for task_id in tasks:
            pages += [f"/api/task/info/{task_id}", f"/api/task/result/{task_id}",
                      f"/task/{task_id}"]
        pages += [f"/worker/{name}" for name in workers]
        shown = {page: web.get(page) for page in pages}
        assert {p: r.status_code for p, r in shown.items() if r.status_code != 200} == {}
        text = {page: reply.text for page, reply in shown.items()}
        # The pages do hold what was watched: the agents' tasks and the worker.
        assert "WATCHED one" in text["/api/tasks"] and "WATCHED one" in text[table]
        assert all(name in text["/api/workers?refresh=true"] for name in workers)
        # Some show the Redis URL itself (the workers' broker, Flower's broker page):
        # with its password masked.
        address = url.rpartition("@")[2]
        assert address in text["/broker"] and address in text["/api/workers?refresh=true"]
        for secret in (API_KEY, REDIS_PASSWORD):
            assert [page for page, body in text.items() if secret in body] == []
