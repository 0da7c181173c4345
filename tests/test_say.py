"""A message to a running agent (``swarm say``, ``POST .../messages``): it reaches the
agent's conversation at its next turn boundary (a parked parent's after its children's
results), a settled agent refuses it, a user token may message only its own jobs' agents,
and a crash between reading it and saving the session neither loses nor repeats it.

Real Redis; the end-to-end tests run a module's local swarm (embedded server, coordinator,
worker processes), the API in-process and the scripted model, whose replies are held on
events so the message is sent while the agent is at work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result

from swarm.agent.loop import FROM_A_PERSON
from swarm.cli import main
from swarm.errors import LeaseLost
from swarm.runtime.root import describe
from swarm.serve.auth import TokenStore
from swarm.store import keys
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.mailbox import Mailbox
from swarm.store.sessions import RedisSessionStore
from swarm.testing.cluster import local_swarm
from swarm.testing.responders import message_text
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import make_agent, wait_until
from tests.test_serve import AUTH, TestClient, make_app

PERSON = FROM_A_PERSON.split("{")[0]  # "[message from a person, ..."


def last_user(request: dict[str, Any]) -> str:
    users = [m for m in request.get("messages") or [] if m.get("role") == "user"]
    return message_text(users[-1]) if users else ""


def held(event: threading.Event, reply: Reply) -> Callable[[dict[str, Any]], Reply]:
    """A model reply held until ``event`` (the test has sent its message), at most 60 s."""

    def step(request: dict[str, Any]) -> Reply:
        event.wait(60)
        return reply

    return step


def heard(prefix: str) -> Callable[[dict[str, Any]], Reply]:
    """An answer that says what the last user message (a person's message) said."""
    return lambda request: Reply(content=f"{prefix}: {last_user(request)}")


# -- a crash between reading a message and saving the session ----------------------------


class CrashAfterRead(Mailbox):
    """The worker dies once it read the messages, before the session that holds them is
    saved (its next save raises, as a lost lease would)."""

    crashed = False

    def unread(self, after: str) -> list[tuple[str, str]]:
        got = super().unread(after)
        self.crashed = bool(got)
        return got


class CrashBeforeForget(Mailbox):
    """The worker dies after the save that holds the messages, before they are deleted."""

    def delivered(self, ids: list[str]) -> None:
        raise LeaseLost("the worker died here")


def agent_record(client: redis_lib.Redis, agent_id: str) -> None:
    client.hset(keys.agent(agent_id), mapping={"id": agent_id, "swarm": "s-say",
                                               "state": "running"})


def requests_with_message(model: ScriptedModelServer) -> list[int]:
    """How many person's messages each request to the model carried."""
    return [sum(1 for m in r["messages"] if m.get("role") == "user"
                and message_text(m).startswith(PERSON)) for r in model.requests]


def test_a_crash_after_reading_a_message_before_the_save_hears_it_again_once(
        redis: redis_lib.Redis, model_server: ScriptedModelServer, tmp_path: Path) -> None:
    agent_record(redis, "a-crash1")
    store = RedisSessionStore(redis)
    first = make_agent(model_server, tmp_path, store=store)
    first.session.id = "a-crash1"
    mailbox = CrashAfterRead(redis, "a-crash1")
    first.mailbox = mailbox

    def guard() -> None:
        if mailbox.crashed:
            raise LeaseLost("the worker died here")

    first.guard = guard
    mailbox.send("use the blue folder", "test")
    with pytest.raises(LeaseLost):
        first.run("the task")
    assert model_server.requests == []  # it died before its model call
    saved = store.load("a-crash1")
    assert saved is not None and saved.said == ""
    assert not any(PERSON in str(m.get("content")) for m in saved.messages)
    # Its successor carries on from the saved session and hears the message, once.
    model_server.responder = heard("heard")
    second = make_agent(model_server, tmp_path, store=store)
    second.session, second.mailbox = saved, Mailbox(redis, "a-crash1")
    assert second.resume() == f"heard: {FROM_A_PERSON.format(text='use the blue folder')}"
    assert requests_with_message(model_server) == [1]
    assert redis.xlen(keys.mailbox("a-crash1")) == 0


def test_a_crash_after_the_save_before_the_mailbox_forgets_does_not_repeat_the_message(
        redis: redis_lib.Redis, model_server: ScriptedModelServer, tmp_path: Path) -> None:
    agent_record(redis, "a-crash2")
    store = RedisSessionStore(redis)
    first = make_agent(model_server, tmp_path, store=store)
    first.session.id = "a-crash2"
    first.mailbox = CrashBeforeForget(redis, "a-crash2")
    first.mailbox.send("use the red folder", "test")
    with pytest.raises(LeaseLost):
        first.run("the task")
    assert redis.xlen(keys.mailbox("a-crash2")) == 1  # still there: the crash came first
    saved = store.load("a-crash2")
    assert saved is not None and saved.said
    model_server.responder = heard("heard")
    second = make_agent(model_server, tmp_path, store=store)
    second.session, second.mailbox = saved, Mailbox(redis, "a-crash2")
    second.resume()
    assert requests_with_message(model_server) == [1]  # in the conversation once
    # The next message is heard after it; the one already held is not added again.
    second.mailbox.send("and the green one", "test")
    second.resume()
    assert requests_with_message(model_server) == [1, 2]


# -- end to end: a swarm on workers ----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("say-home")
    with local_swarm(home, concurrency=4) as url:
        yield url, home


@pytest.fixture(scope="module")
def model(cluster: tuple[str, Path]) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture
def client(cluster: tuple[str, Path]) -> redis_lib.Redis:
    return connect(cluster[0])


@pytest.fixture
def api(cluster: tuple[str, Path], model: ScriptedModelServer) -> Iterator[TestClient]:
    url, home = cluster
    app = make_app(connect(url), url, home / "jobs", SWARM_BASE_URL=model.base_url,
                   SWARM_MODEL=model.models[0])
    with TestClient(app) as test_client:
        yield test_client


def cli(cluster: tuple[str, Path], *args: str, stdin: str | None = None) -> Result:
    url, home = cluster
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_REDIS_URL=url, SWARM_HOME=str(home))
    return CliRunner().invoke(main, list(args), env=env, input=stdin, catch_exceptions=False)


def submit(api: TestClient, task: str, headers: dict[str, str] = AUTH) -> str:
    got = api.post("/v1/jobs", headers=headers, json={"task": task, "approve": "all"})
    assert got.status_code == 201, got.text
    return str(got.json()["id"])


def job_of(api: TestClient, job: str, headers: dict[str, str] = AUTH) -> dict[str, Any]:
    return dict(api.get(f"/v1/jobs/{job}", headers=headers).json())


def settled(api: TestClient, job: str) -> dict[str, Any]:
    return wait_until(lambda: (lambda j: j if j["state"] in ("done", "failed") else None)(
        job_of(api, job)), f"job {job} to settle", timeout=60)


def child_of(client: redis_lib.Redis, job: str) -> str:
    return wait_until(lambda: next((a.id for a in Ledger(client).agents(job)
                                    if a.kind == "child"), None), "its child", timeout=60)


def state_of(client: redis_lib.Redis, agent_id: str) -> str:
    return str(client.hget(keys.agent(agent_id), "state") or "")


def requests_of(model: ScriptedModelServer, marker: str) -> list[dict[str, Any]]:
    return [r for r in model.requests
            if any(marker in message_text(m) for m in r["messages"] if m.get("role") == "user")]


@pytest.mark.slow
def test_a_message_to_a_running_child_reaches_its_next_model_call_and_changes_its_answer(
        cluster: tuple[str, Path], model: ScriptedModelServer, api: TestClient,
        client: redis_lib.Redis) -> None:
    sent = threading.Event()
    model.responder = ByTask({
        "SAYJOB": [Reply(tool_calls=[ToolCall("agent", {"message": "SAYKID look"}, id="k")]),
                   lambda r: Reply(content="root: " + json.loads(tool_results(r)[0])["answer"])],
        # Its first model call is held while the message is sent: it is heard after the
        # command that call asks for, before the next call.
        "SAYKID": [held(sent, Reply(tool_calls=[ToolCall("run_cli", {"command": "echo ok"})])),
                   heard("kid heard")],
    })
    job = submit(api, "SAYJOB go")
    kid = child_of(client, job)
    wait_until(lambda: requests_of(model, "SAYKID"), "the child's first model call")
    said = cli(cluster, "say", kid, "the", "word", "is", "-", stdin="PINEAPPLE\n")
    sent.set()
    assert said.exit_code == 0, said.output
    assert f"told {kid}" in said.stderr
    done = settled(api, job)
    text = FROM_A_PERSON.format(text="the word is\n\nPINEAPPLE")
    assert done["answer"] == f"root: kid heard: {text}"
    first, second = requests_of(model, "SAYKID")
    assert PERSON not in json.dumps(first["messages"])  # in flight when it was sent
    roles = [m["role"] for m in second["messages"]]
    assert roles[-3:] == ["assistant", "tool", "user"]  # after the command's result
    assert message_text(second["messages"][-1]) == text
    # It is in the agent's log and the swarm's events; its mailbox is empty again.
    logs = cli(cluster, "logs", kid)
    assert logs.exit_code == 0 and "PINEAPPLE" in logs.stdout
    events = [f for _, f in Ledger(client).events_since(job, "0-0")]
    (told,) = [e for e in events if e["kind"] == "message"]
    assert told["agent"] == kid and "PINEAPPLE" in told["text"]
    assert describe(told) == f"[{kid}] told: the word is"  # the line views print
    assert client.xlen(keys.mailbox(kid)) == 0


@pytest.mark.slow
def test_a_parked_parent_hears_a_message_after_its_childrens_results(
        model: ScriptedModelServer, api: TestClient, client: redis_lib.Redis) -> None:
    sent = threading.Event()
    model.responder = ByTask({
        "SAYPARK": [Reply(tool_calls=[ToolCall("agent", {"message": "SAYPKID a"}, id="k")]),
                    heard("root heard")],
        "SAYPKID": [held(sent, Reply(content="kid done"))],
    })
    job = submit(api, "SAYPARK go")
    wait_until(lambda: state_of(client, job) == "parked", "the root to park", timeout=60)
    got = api.post(f"/v1/jobs/{job}/agents/{job}/messages", headers=AUTH,
                   json={"text": "summarise in one word"})
    sent.set()
    assert got.status_code == 202, got.text
    assert got.json()["agent"] == job
    done = settled(api, job)
    assert done["answer"] == "root heard: " + FROM_A_PERSON.format(text="summarise in one word")
    last = requests_of(model, "SAYPARK")[-1]["messages"]
    assert [m["role"] for m in last[-3:]] == ["assistant", "tool", "user"]
    assert "kid done" in message_text(last[-2])


@pytest.mark.slow
def test_a_settled_agent_refuses_a_message_in_the_cli_and_the_api(
        cluster: tuple[str, Path], model: ScriptedModelServer, api: TestClient,
        client: redis_lib.Redis) -> None:
    model.responder = ByTask({"SAYDONE": [Reply(content="all done")]})
    job = submit(api, "SAYDONE now")
    assert settled(api, job)["state"] == "done"
    wait_until(lambda: state_of(client, job) == "done", "the root to settle")
    said = cli(cluster, "say", job, "one more thing")
    assert said.exit_code == 1
    assert f"agent {job} has settled (done): it reads no more messages" in said.output
    got = api.post(f"/v1/jobs/{job}/agents/{job}/messages", headers=AUTH,
                   json={"text": "one more thing"})
    assert got.status_code == 409 and "has settled" in got.json()["detail"]
    assert client.exists(keys.mailbox(job)) == 0
    unknown = cli(cluster, "say", "nosuchagent", "hello")
    assert unknown.exit_code == 1 and "no agent 'nosuchagent'" in unknown.output


@pytest.mark.slow
def test_a_user_token_cannot_message_the_agents_of_another_users_job(
        cluster: tuple[str, Path], model: ScriptedModelServer, api: TestClient,
        client: redis_lib.Redis) -> None:
    tokens = TokenStore(client)
    alice, _ = tokens.create("alice-say")
    bob, _ = tokens.create("bob-say")
    sent = threading.Event()
    model.responder = ByTask({"SAYMINE": [held(sent, Reply(tool_calls=[
        ToolCall("run_cli", {"command": "echo ok"})])), heard("heard")]})
    as_alice, as_bob = ({"Authorization": f"Bearer {t}"} for t in (alice, bob))
    job = submit(api, "SAYMINE go", as_alice)
    wait_until(lambda: requests_of(model, "SAYMINE"), "the job's first model call", timeout=60)
    refused = api.post(f"/v1/jobs/{job}/agents/{job}/messages", headers=as_bob,
                       json={"text": "from bob"})
    assert refused.status_code == 404 and refused.json()["detail"] == f"no job {job!r}"
    allowed = api.post(f"/v1/jobs/{job}/agents/{job}/messages", headers=as_alice,
                       json={"text": "from alice"})
    sent.set()
    assert allowed.status_code == 202, allowed.text
    done = settled(api, job)
    assert done["answer"] == "heard: " + FROM_A_PERSON.format(text="from alice")
    assert "from bob" not in json.dumps(model.requests)


@pytest.mark.slow
def test_a_root_in_a_terminal_hears_a_message_sent_to_its_swarm_id(
        cluster: tuple[str, Path], model: ScriptedModelServer, client: redis_lib.Redis,
        tmp_path: Path) -> None:
    sent = threading.Event()
    model.responder = ByTask({
        "SAYROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "SAYRKID a"}, id="k")]),
                    heard("root heard")],
        "SAYRKID": [held(sent, Reply(content="kid done"))],
    })
    url, home = cluster
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_REDIS_URL=url, SWARM_HOME=str(home), SWARM_BASE_URL=model.base_url,
               SWARM_MODEL=model.models[0], PYTHONPATH=str(Path(__file__).parent.parent))
    root = subprocess.Popen([sys.executable, "-m", "swarm", "run", "--yes", "--workers", "0",
                             "-C", str(tmp_path), "SAYROOT go"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        swarm_id = wait_until(lambda: next(
            (s for s in [Ledger(client).latest_swarm()] if s and state_of(client, s) == "parked"
             and "SAYROOT" in Ledger(client).swarm(s).get("task", "")), None),
            "the root to park", timeout=60)
        said = cli(cluster, "say", swarm_id, "answer in French")
        sent.set()
        assert said.exit_code == 0, said.output
        out, err = root.communicate(timeout=60)
    finally:
        sent.set()
        if root.poll() is None:
            root.kill()
            root.wait()
    assert root.returncode == 0, err
    assert out.strip() == "root heard: " + FROM_A_PERSON.format(text="answer in French")
