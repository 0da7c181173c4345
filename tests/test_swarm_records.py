"""A swarm's record is its own: what `status`, `report`, `attach` and the API show of a
swarm is what that swarm did, kept as it settled, whatever later runs do in its folder;
every failure keeps its reason. Real Redis, a real coordinator and worker, `swarm run`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result

from swarm.cli import main
from swarm.domain.records import RootEnd, RootStart
from swarm.domain.session import Session
from swarm.runtime.jobs import job_state
from swarm.store import keys
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.sessions import RedisSessionStore
from swarm.testing.cluster import local_swarm
from swarm.testing.responders import message_text
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("records-home")
    with local_swarm(home) as url:
        yield url, home


@pytest.fixture(scope="module")
def model(cluster: tuple[str, Path]) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture
def client(cluster: tuple[str, Path]) -> redis_lib.Redis:
    return connect(cluster[0])


def env_of(cluster: tuple[str, Path], **more: str) -> dict[str, str]:
    url, home = cluster
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_REDIS_URL=url, SWARM_HOME=str(home), SWARM_RETRIES="1", **more)
    return env


def swarm(cluster: tuple[str, Path], model: ScriptedModelServer, *args: str) -> Result:
    return CliRunner().invoke(main, list(args), env=env_of(cluster, SWARM_BASE_URL=model.base_url),
                              catch_exceptions=False)


def run(cluster: tuple[str, Path], model: ScriptedModelServer, folder: Path, task: str,
        *flags: str) -> Result:
    return swarm(cluster, model, "run", "--yes", "--workers", "0", "-C", str(folder), *flags,
                 task)


def last_user(request: dict[str, Any]) -> str:
    users = [m for m in request.get("messages") or [] if m.get("role") == "user"]
    return message_text(users[-1]) if users else ""


def scripted(on_child: Any = None) -> Any:
    """FAN N: N children, then the sum of their answers; anything else: one answer.
    ``on_child`` runs as a child answers (to cancel its swarm, say)."""

    def respond(request: dict[str, Any]) -> Reply:
        task, last = last_user(request), (request.get("messages") or [{}])[-1]
        if task.startswith("CHILD"):
            if on_child is not None:
                on_child()
            return Reply(content="child says hi")
        if task.startswith("FAN") and last.get("role") == "user":
            n = int(task.split()[1])
            return Reply(tool_calls=[ToolCall("agent", {"message": f"CHILD {i}"}, id=f"c{i}")
                                     for i in range(n)])
        if task.startswith("FAN"):
            return Reply(content=f"fanned out: {task}")
        return Reply(content=f"plain answer to {task}")

    return respond


def status_json(cluster: tuple[str, Path], model: ScriptedModelServer,
                swarm_id: str) -> dict[str, Any]:
    out = swarm(cluster, model, "status", "--json", swarm_id)
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def root_row(status: dict[str, Any]) -> dict[str, Any]:
    return next(a for a in status["agents"] if a["kind"] == "root")


def test_a_settled_swarms_record_does_not_change_with_later_runs_in_its_folder(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    model.responder = scripted()
    assert run(cluster, model, tmp_path, "PLAIN warm the folder up").exit_code == 0
    first = run(cluster, model, tmp_path, "FAN 2 the job")
    assert first.exit_code == 0, first.output
    swarm_id = Ledger(client).latest_swarm()
    assert swarm_id is not None
    before = status_json(cluster, model, swarm_id)
    root = root_row(before)
    # Its figures are this swarm's: the run before it in the folder is not counted.
    session = RedisSessionStore(client).load(keys.session_id_for(str(tmp_path.resolve())))
    assert session is not None
    assert 0 < root["usage"]["total_tokens"] < session.usage["total_tokens"]
    assert root["turns"] == 2 and root["answer"] == "fanned out: FAN 2 the job"

    assert run(cluster, model, tmp_path, "PLAIN a later run").exit_code == 0
    assert root_row(status_json(cluster, model, swarm_id)) == root
    assert run(cluster, model, tmp_path, "PLAIN a fresh start", "--new").exit_code == 0
    after = status_json(cluster, model, swarm_id)
    assert root_row(after) == root  # usage, turns, answer, state, times: as it settled
    assert after["totals"] == before["totals"]
    api = job_state(Ledger(client), swarm_id)
    assert api["answer"] == "fanned out: FAN 2 the job" and api["state"] == "done"
    attached = swarm(cluster, model, "attach", swarm_id)
    assert attached.exit_code == 0 and attached.stdout.strip() == "fanned out: FAN 2 the job"
    assert root_row(status_json(cluster, model, swarm_id)) == root


def test_attach_on_a_cancelled_swarm_says_so_after_a_newer_run_and_changes_nothing(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    ledger = Ledger(client)
    model.responder = scripted(on_child=lambda: ledger.cancel(
        ledger.latest_swarm() or "", "stopped by the test"))
    cancelled = run(cluster, model, tmp_path, "FAN 2 to be cancelled")
    assert cancelled.exit_code == 4, cancelled.output
    first = ledger.latest_swarm()
    assert first is not None
    model.responder = scripted()
    newer = run(cluster, model, tmp_path, "FAN 1 a newer job")
    assert newer.exit_code == 0, newer.output
    second = ledger.latest_swarm()
    assert second is not None and second != first
    records = {s: (client.hgetall(keys.swarm(s)), client.hgetall(keys.agent(s)))
               for s in (first, second)}

    out = swarm(cluster, model, "attach", first)
    assert out.exit_code == 4
    assert f"swarm {first} was cancelled" in out.output and "stopped by the test" in out.output
    assert "fanned out" not in out.stdout  # never the newer swarm's answer
    assert {s: (client.hgetall(keys.swarm(s)), client.hgetall(keys.agent(s)))
            for s in (first, second)} == records
    shown = status_json(cluster, model, first)
    assert shown["swarm"]["state"] == "cancelled"
    assert "stopped by the test" in root_row(shown)["error"]


def test_attach_refuses_a_swarm_whose_folder_went_on_without_it(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    model.responder = scripted()
    assert run(cluster, model, tmp_path, "PLAIN first").exit_code == 0
    sessions = RedisSessionStore(client)
    session_id = keys.session_id_for(str(tmp_path.resolve()))
    session = sessions.load(session_id)
    assert isinstance(session, Session)
    # A root that left its children running (detached) at the folder's turn as it is now.
    ledger = Ledger(client)
    ledger.create_swarm("s-detached", "s-detached", str(tmp_path.resolve()), "FAN 1 gone", {},
                        "h", session_id, start=RootStart(session.usage, session.turns,
                                                         session.created))
    ledger.finish_swarm("s-detached", "detached", root_id="s-detached",
                        end=RootEnd({}, 0, session.turns))
    assert run(cluster, model, tmp_path, "PLAIN a later run went on").exit_code == 0
    before = client.hgetall(keys.swarm("s-detached"))
    out = swarm(cluster, model, "attach", "s-detached")
    assert out.exit_code == 1
    assert "cannot be resumed: a later run in its folder went on" in out.output
    assert client.hgetall(keys.swarm("s-detached")) == before
    assert "plain answer" not in out.stdout


def test_a_failed_root_keeps_its_reason_in_status_and_the_api(
        redis_server: str, tmp_path: Path, model_server: ScriptedModelServer) -> None:
    """No coordinator or worker serves this Redis: the root's first spawn fails."""
    model_server.responder = scripted()
    home = tmp_path / "home"
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_REDIS_URL=redis_server, SWARM_HOME=str(home), SWARM_RETRIES="1",
               SWARM_BASE_URL=model_server.base_url)
    folder = tmp_path / "w"
    folder.mkdir()
    result = CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C", str(folder),
                                       "FAN 1 nobody serves"], env=env)
    assert result.exit_code == 1
    client = connect(redis_server)
    swarm_id = next(s for s in client.zrevrange(keys.swarms_index(), 0, -1)
                    if client.hget(keys.swarm(s), "workspace") == str(folder.resolve()))
    status = CliRunner().invoke(main, ["status", swarm_id], env=env)
    assert "no coordinator and no worker answered" in status.stdout, status.stdout
    assert "(no error)" not in status.stdout
    error = job_state(Ledger(client), swarm_id)["error"]
    assert "RuntimeUnavailable" in error and "no coordinator" in error
