"""The HTTP API of ``swarm serve``: auth, bad input, a job end to end over SSE, cancel,
approvals, and schemathesis against the app's own OpenAPI document.

The app runs in-process (Starlette's TestClient, or uvicorn in a thread where the event
stream must really stream) on the real Redis test server; jobs that must run use a
module-scoped swarm (embedded server, coordinator and worker processes) and the scripted
model over HTTP.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis as redis_lib
import uvicorn
from celery import Celery
from click.testing import CliRunner
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings

from swarm.agent import sandbox
from swarm.broker.app import QUEUE
from swarm.cli import main
from swarm.config import Settings
from swarm.domain.approval import ApprovalRequest
from swarm.runtime.local import LocalCluster, wait_for
from swarm.serve.app import create_app
from swarm.serve.auth import Authenticator, TokenStore, hash_token
from swarm.serve.models import MAX_TASK
from swarm.serve.service import Service
from swarm.store import keys
from swarm.store.approvals import ApprovalQueue
from swarm.store.connection import connect
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until

with warnings.catch_warnings():  # Starlette's TestClient warns about httpx on import
    warnings.simplefilter("ignore", DeprecationWarning)
    import schemathesis
    from fastapi.testclient import TestClient

TOKEN = "test-token-0d9e2f"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def celery_for(url: str) -> Celery:
    """A Celery app of its own per Redis: the process-wide app caches its broker pool."""
    app = Celery("swarm-serve-test", set_as_current=False)
    app.conf.update(broker_url=url, result_backend=url, task_default_queue=QUEUE,
                    task_serializer="json", accept_content=["json"],
                    broker_connection_retry_on_startup=True)
    return app


def make_app(client: redis_lib.Redis, url: str, root: Path, **env: str) -> FastAPI:
    settings = Settings.from_env(env={"SWARM_HOME": str(root.parent), **env})
    return create_app(Service(client, celery_for(url), settings, root,
                              Authenticator(client, TOKEN)))


@pytest.fixture
def app(redis: redis_lib.Redis, redis_server: str, tmp_path: Path) -> FastAPI:
    return make_app(redis, redis_server, tmp_path / "jobs")


@pytest.fixture
def api(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as client:
        yield client


def nothing_queued(client: redis_lib.Redis) -> bool:
    return (client.zcard(keys.swarms_index()) == 0 and client.llen(QUEUE) == 0
            and not list(client.scan_iter(match=keys.swarm("*"))))


# -- auth ---------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
    {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer "},
    {"Authorization": "Bearer " + "x" * 5000}])
def test_no_valid_token_gets_401_and_queues_nothing(api: TestClient, redis: redis_lib.Redis,
                                                    headers: dict[str, str]) -> None:
    for method, path in [("POST", "/v1/jobs"), ("GET", "/v1/jobs/s123"),
                         ("GET", "/v1/jobs/s123/events"), ("POST", "/v1/jobs/s123/cancel"),
                         ("GET", "/v1/approvals"), ("POST", "/v1/approvals/p1"),
                         ("GET", "/openapi.json")]:
        body = {"task": "hello", "approve": "all"} if path == "/v1/jobs" else {
            "decision": "approve"}
        response = api.request(method, path, headers=headers,
                               json=body if method == "POST" else None)
        assert response.status_code == 401, (method, path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert "Bearer" in response.json()["detail"]
        assert TOKEN not in response.text
    assert nothing_queued(redis)


def test_tokens_are_stored_hashed_listed_and_revoked(api: TestClient, redis: redis_lib.Redis,
                                                     redis_server: str) -> None:
    env = {"SWARM_REDIS_URL": redis_server}
    made = CliRunner().invoke(main, ["token", "create", "--name", "ci"], env=env)
    assert made.exit_code == 0, made.output
    token = made.stdout.strip()
    assert token.startswith("swm_") and len(token) > 40
    stored = redis.hgetall(keys.serve_tokens())
    assert list(stored) == [hash_token(token)]
    assert token not in json.dumps(stored)
    listed = CliRunner().invoke(main, ["token", "list"], env=env)
    assert "ci" in listed.stdout and token not in listed.output
    again = CliRunner().invoke(main, ["token", "create", "--name", "ci"], env=env)
    assert again.exit_code == 1 and "exists" in again.output

    bearer = {"Authorization": f"Bearer {token}"}
    assert api.get("/v1/approvals", headers=bearer).status_code == 200
    assert CliRunner().invoke(main, ["token", "revoke", "ci"], env=env).exit_code == 0
    refused = api.post("/v1/jobs", headers=bearer, json={"task": "x", "approve": "all"})
    assert refused.status_code == 401
    assert nothing_queued(redis)
    assert CliRunner().invoke(main, ["token", "revoke", "ci"], env=env).exit_code == 1


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_token_scopes_are_listed_and_a_token_stored_without_one_is_admin(
        api: TestClient, redis: redis_lib.Redis, redis_server: str) -> None:
    env = {"SWARM_REDIS_URL": redis_server}
    made = {}
    for name, flags in (("ops", ["--admin"]), ("ci", [])):
        result = CliRunner().invoke(main, ["token", "create", "--name", name, *flags], env=env)
        assert result.exit_code == 0, result.output
        made[name] = result.stdout.strip()
        assert f"scope {'admin' if flags else 'user'}" in result.stderr
    # A token stored before tokens had scopes: admin, so deployments keep working.
    old = "swm_made-before-scopes"
    redis.hset(keys.serve_tokens(), hash_token(old), json.dumps({"name": "old", "created": 1}))
    listed = CliRunner().invoke(main, ["token", "list"], env=env)
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[1]: line for line in listed.stdout.splitlines()}
    assert rows["ops"].endswith("  admin") and rows["ci"].endswith("  user")
    assert rows["old"].endswith("  admin (made before scopes)")
    assert not any(token in listed.output for token in made.values())
    # The user token's job: the admins (stored, legacy, SWARM_SERVE_TOKEN) all see it.
    job = api.post("/v1/jobs", headers=bearer(made["ci"]), json={"task": "x"}).json()["id"]
    for token in (made["ops"], old, TOKEN):
        assert api.get(f"/v1/jobs/{job}", headers=bearer(token)).status_code == 200, token
    # A job submitted with SWARM_SERVE_TOKEN is its own (it has an id as stored ones do).
    mine = api.post("/v1/jobs", headers=AUTH, json={"task": "y"}).json()["id"]
    assert api.get(f"/v1/jobs/{mine}", headers=AUTH).json()["owner"] == hash_token(TOKEN)[:12]
    assert api.get(f"/v1/jobs/{mine}", headers=bearer(made["ci"])).status_code == 404


def test_a_user_token_sees_and_acts_on_its_own_jobs_only(api: TestClient,
                                                         redis: redis_lib.Redis) -> None:
    """Bob gets a 404 for everything of Alice's job, worded as for a job that does not
    exist; Alice and an admin see it and its approval; a job records Alice's id only."""
    store = TokenStore(redis)
    alice, alice_info = store.create("alice")
    bob, _ = store.create("bob")
    job = api.post("/v1/jobs", headers=bearer(alice), json={"task": "ALICEJOB"}).json()["id"]
    record = redis.hgetall(keys.swarm(job))
    assert record["owner"] == alice_info.id == hash_token(alice)[:12]
    assert alice not in json.dumps(record) and hash_token(alice) not in json.dumps(record)
    assert api.get(f"/v1/jobs/{job}", headers=bearer(alice)).json()["owner"] == alice_info.id

    thread, got = ask_in_thread(redis, job, timeout=30)
    approval = wait_until(lambda: api.get("/v1/approvals", headers=bearer(alice)).json(),
                          "Alice's approval to be listed")[0]
    assert approval["job"] == job
    assert api.get("/v1/approvals", headers=AUTH).json() == [approval]  # the admin's list

    unknown = api.get("/v1/jobs/snope", headers=bearer(bob)).json()["detail"]
    for method, path in [("GET", f"/v1/jobs/{job}"), ("GET", f"/v1/jobs/{job}/events"),
                         ("POST", f"/v1/jobs/{job}/cancel"), ("GET", f"/v1/approvals?job={job}"),
                         ("GET", f"/v1/jobs/{job}/snapshot"),
                         ("GET", f"/v1/jobs/{job}/agents/{job}"),
                         ("GET", f"/v1/jobs/{job}/agents/{job}/diff"),
                         ("POST", f"/v1/jobs/{job}/agents/{job}/cancel")]:
        response = api.request(method, path, headers=bearer(bob))
        assert response.status_code == 404, (path, response.text)
        assert response.json()["detail"] == unknown.replace("snope", job), path
    assert api.get("/v1/approvals", headers=bearer(bob)).json() == []
    # The list: Alice's job for Alice and the admin, not for Bob; nor through his own job.
    bobs = api.post("/v1/jobs", headers=bearer(bob), json={"task": "BOBJOB"}).json()["id"]
    assert [j["id"] for j in api.get("/v1/jobs", headers=bearer(bob)).json()] == [bobs]
    assert [j["id"] for j in api.get("/v1/jobs", headers=bearer(alice)).json()] == [job]
    assert {j["id"] for j in api.get("/v1/jobs", headers=AUTH).json()} == {job, bobs}
    for method, path in [("GET", f"/v1/jobs/{bobs}/agents/{job}"),
                         ("POST", f"/v1/jobs/{bobs}/agents/{job}/cancel")]:
        response = api.request(method, path, headers=bearer(bob))
        assert response.status_code == 404, (path, response.text)
        assert response.json()["detail"] == f"no agent {job!r} in job {bobs!r}"
    snapshot = api.get(f"/v1/jobs/{job}/snapshot", headers=bearer(alice)).json()
    assert [a["id"] for a in snapshot["agents"]] == [job] and snapshot["last_event"]
    for params in (None, {"job": job}):
        refused = api.post(f"/v1/approvals/{approval['id']}", headers=bearer(bob),
                           params=params, json={"decision": "approve"})
        assert refused.status_code == 404, refused.text
    assert not redis.exists(keys.cancel(job))  # Bob's cancel did nothing
    assert [p.id for p in ApprovalQueue(redis, job).pending()] == [approval["id"]]

    answered = api.post(f"/v1/approvals/{approval['id']}", headers=bearer(alice),
                        json={"decision": "deny"})
    assert answered.status_code == 200, answered.text
    thread.join(timeout=10)
    assert got == [("deny", "answered by a person")]
    # Answered: a 409 for Alice (and the admin), still a 404 for Bob (not how it went).
    for token, status in ((alice, 409), (TOKEN, 409), (bob, 404)):
        again = api.post(f"/v1/approvals/{approval['id']}", headers=bearer(token),
                         json={"decision": "approve"})
        assert again.status_code == status, (token, again.text)
        assert "deny" not in again.text or status == 409
    cancelled = api.post(f"/v1/jobs/{job}/cancel", headers=bearer(alice))
    assert cancelled.status_code == 202 and cancelled.json()["flagged"] == [job]


def test_serve_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    env = {"SWARM_HOME": str(tmp_path), "SWARM_REDIS_URL": "", "SWARM_SERVE_TOKEN": ""}
    result = CliRunner().invoke(main, ["serve", "--port", "1"], env=env)
    assert result.exit_code == 1
    assert "no API token yet" in result.output and "swarm token create" in result.output


# -- bad input ----------------------------------------------------------------------------

BAD_BODIES: list[tuple[str, Any, str]] = [
    ("unknown field", {"task": "x", "priority": 1}, "extra_forbidden"),
    ("unknown limit", {"task": "x", "limits": {"max_depth": 2, "cpus": 4}}, "extra_forbidden"),
    ("task not a string", {"task": 42}, "string_type"),
    ("task missing", {"approve": "all"}, "missing"),
    ("blank task", {"task": " \n\t "}, "string_pattern_mismatch"),
    ("workspace with NUL", {"task": "x", "workspace": "a\x00b"}, "string_pattern_mismatch"),
    ("workspace name too long", {"task": "x", "workspace": "a" * 64}, "string_pattern_mismatch"),
    ("approve unknown", {"task": "x", "approve": "maybe"}, "literal_error"),
    ("limit as string", {"task": "x", "limits": {"max_depth": "3"}}, "not str"),
    ("limit as bool", {"task": "x", "limits": {"max_turns": True}}, "not bool"),
    ("limit a fraction", {"task": "x", "limits": {"max_turns": 2.5}}, "int_from_float"),
    ("limit too big", {"task": "x", "limits": {"max_depth": 99}}, "less_than_equal"),
    ("negative budget", {"task": "x", "limits": {"token_budget": -1}}, "greater_than_equal"),
    ("workspace not a string", {"task": "x", "workspace": ["a"]}, "string_type"),
    ("body a list", ["task"], "model_attributes_type"),
    ("task over the limit", {"task": "x" * (MAX_TASK + 1)}, "string_too_long"),
]


@pytest.mark.parametrize(("why", "body", "expected"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_get_422_saying_what_is_wrong(api: TestClient, redis: redis_lib.Redis,
                                                 why: str, body: Any, expected: str) -> None:
    response = api.post("/v1/jobs", headers=AUTH, json=body)
    assert response.status_code == 422, response.text
    assert expected in response.text
    assert len(response.content) < 2000  # the input is not echoed back
    assert nothing_queued(redis)


def test_a_10_mb_task_and_broken_json_are_refused(api: TestClient, redis: redis_lib.Redis
                                                  ) -> None:
    huge = api.post("/v1/jobs", headers=AUTH, json={"task": "x" * (10 * 1024 * 1024)})
    assert huge.status_code == 413
    assert "request body is over" in huge.json()["detail"]
    broken = api.post("/v1/jobs", headers={**AUTH, "Content-Type": "application/json"},
                      content=b'{"task": ')
    assert broken.status_code == 422 and "json_invalid" in broken.text

    def chunks() -> Iterable[bytes]:  # no Content-Length: counted while read
        yield b'{"task": "'
        for _ in range(40):
            yield b"y" * 100_000
        yield b'"}'

    streamed = api.post("/v1/jobs", headers={**AUTH, "Content-Type": "application/json"},
                        content=chunks())
    assert streamed.status_code == 413
    assert nothing_queued(redis)


def test_a_task_too_large_for_the_model_gets_413_before_anything_starts(
        redis: redis_lib.Redis, redis_server: str, tmp_path: Path,
        model_server: ScriptedModelServer) -> None:
    """The service asks the model's endpoint for its context (32,768 tokens here) once, and
    refuses a task that alone would take most of it: no folder, no job, no model call."""
    root = tmp_path / "jobs"
    app = make_app(redis, redis_server, root, SWARM_BASE_URL=model_server.base_url,
                   SWARM_MODEL=model_server.models[0])
    with TestClient(app) as api:
        for source in ("api", "mcp"):
            if source == "api":
                response = api.post("/v1/jobs", headers=AUTH,
                                    json={"task": "y" * 200_000, "approve": "all"})
                assert response.status_code == 413, response.text
                detail = response.json()["detail"]
            else:
                detail = mcp_error(api, {"task": "y" * 200_000})
            assert "about 50,000 tokens (200,000 characters" in detail
            assert "at most 24,576 of the 32,768 tokens" in detail
            assert "file in the workspace" in detail
        assert nothing_queued(redis) and not any(root.iterdir())
        assert model_server.requests == [] and model_server.models_requests == 1
        fits = api.post("/v1/jobs", headers=AUTH, json={"task": "y" * 40_000})
        assert fits.status_code == 201, fits.text
    assert model_server.models_requests == 1  # the context is remembered


def mcp_error(api: TestClient, arguments: dict[str, Any]) -> str:
    """The error text of a ``submit_job`` call over /mcp (stateless: no session needed)."""
    response = api.post("/mcp", headers={**AUTH, "Accept": "application/json, text/event-stream"},
                        json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                              "params": {"name": "submit_job", "arguments": arguments}})
    assert response.status_code == 200, response.text
    (data,) = [json.loads(line[5:]) for line in response.text.splitlines()
               if line.startswith("data:")]
    assert data["result"]["isError"] is True, data
    return str(data["result"]["content"][0]["text"])


def test_workspaces_outside_the_root_are_refused(api: TestClient, redis: redis_lib.Redis,
                                                 tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "team").mkdir(parents=True)
    (root / "team" / "escape").symlink_to(outside)
    (root / "afile").write_text("x")
    for workspace in ["/etc", "../outside", "team/../../outside", "team/escape",
                      "team/escape/deeper", str(outside), ".", str(root), "afile"]:
        response = api.post("/v1/jobs", headers=AUTH,
                            json={"task": "x", "workspace": workspace})
        expected = 409 if workspace == "afile" else 403
        assert response.status_code == expected, (workspace, response.text)
        detail = response.json()["detail"]
        assert ("cannot be created" if expected == 409 else "outside the allowed root") in detail
    assert nothing_queued(redis)
    assert not (outside / "deeper").exists()


def test_a_job_gets_its_workspace_settings_and_limits(api: TestClient, redis: redis_lib.Redis,
                                                      tmp_path: Path) -> None:
    root = (tmp_path / "jobs").resolve()
    inside = api.post("/v1/jobs", headers=AUTH, json={
        "task": "first", "approve": "all", "workspace": "team/a",
        "limits": {"max_depth": 1, "max_turns": 5, "child_timeout": 60}})
    assert inside.status_code == 201, inside.text
    job = inside.json()["id"]
    swarm = redis.hgetall(keys.swarm(job))
    assert swarm["workspace"] == str(root / "team" / "a") and (root / "team" / "a").is_dir()
    assert swarm["source"] == "api"
    assert json.loads(swarm["settings"]) == {"yes": True, "max_depth": 1, "max_turns": 5,
                                             "child_timeout": 60}
    # Limits only tighten the service's own (here its defaults: 3 deep, 200 turns, no
    # token cap): 0, no cap, is not tighter than 200.
    loose = api.post("/v1/jobs", headers=AUTH, json={
        "task": "third", "limits": {"max_depth": 9, "token_budget": 500, "max_turns": 0,
                                    "child_max_turns": 20}})
    assert json.loads(redis.hget(keys.swarm(loose.json()["id"]), "settings") or "") == {
        "yes": False, "max_depth": 3, "token_budget": 500, "max_turns": 200,
        "child_max_turns": 20}
    asked = api.post("/v1/jobs", headers=AUTH, json={"task": "second"}).json()["id"]
    fresh = Path(redis.hget(keys.swarm(asked), "workspace") or "")
    assert fresh.parent == root and fresh.is_dir() and not any(fresh.iterdir())
    assert json.loads(redis.hget(keys.swarm(asked), "settings") or "") == {"yes": False}
    assert redis.llen(QUEUE) == 3  # every root was sent to the workers
    got = api.get(f"/v1/jobs/{asked}", headers=AUTH).json()
    assert got["state"] == "queued" and got["answer"] is None
    assert got["agents"][0]["id"] == asked and got["task"] == "second"


def test_unknown_ids_get_404(api: TestClient) -> None:
    for method, path in [("GET", "/v1/jobs/snope"), ("GET", "/v1/jobs/snope/events"),
                         ("POST", "/v1/jobs/snope/cancel"), ("GET", "/v1/approvals?job=snope")]:
        response = api.request(method, path, headers=AUTH)
        assert response.status_code == 404, (path, response.text)
        assert "snope" in response.json()["detail"]
    answer = api.post("/v1/approvals/pnope", headers=AUTH, json={"decision": "approve"})
    assert answer.status_code == 404 and "GET /v1/approvals" in answer.json()["detail"]
    assert api.get("/v1/jobs/..%2F..", headers=AUTH).status_code in (404, 422)
    assert api.get("/v1/approvals", headers=AUTH).json() == []


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded",
                                          "text/plain", "application/jsonx"])
def test_a_body_not_sent_as_json_gets_415_saying_what_to_send(
        api: TestClient, redis: redis_lib.Redis, content_type: str | None) -> None:
    """``curl -d`` without ``-H 'Content-Type: application/json'``: a 415 that says so."""
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    for path, body in [("/v1/jobs", {"task": "hello", "approve": "all"}),
                       ("/v1/approvals/p1", {"decision": "approve"})]:
        response = api.post(path, headers=headers, content=json.dumps(body).encode())
        assert response.status_code == 415, (path, response.text)
        detail = response.json()["detail"]
        assert "Content-Type: application/json" in detail
        assert (content_type or "no Content-Type") in detail
    # The token is checked first; JSON with a charset or a +json type is JSON.
    no_token = api.post("/v1/jobs", content=b'{"task": "x"}')
    assert no_token.status_code == 401
    assert nothing_queued(redis)
    for json_type in ("application/json; charset=utf-8", "application/vnd.swarm+json"):
        sent = api.post("/v1/jobs", headers={**AUTH, "Content-Type": json_type},
                        content=b'{"task": "hello"}')
        assert sent.status_code == 201, (json_type, sent.text)
    assert "415" in api.get("/openapi.json", headers=AUTH).json()["paths"]["/v1/jobs"]["post"][
        "responses"]


def ask_in_thread(redis: redis_lib.Redis, swarm_id: str, timeout: float,
                  cancelled: Any = lambda: False) -> tuple[threading.Thread, list[Any]]:
    """A child asking for approval (as a worker's does), in a thread; its result is put in
    the returned list."""
    got: list[Any] = []
    request = ApprovalRequest("run_cli", {"command": "rm -r build"}, "rm -r build",
                              agent_id="a1")
    thread = threading.Thread(target=lambda: got.append(
        ApprovalQueue(redis, swarm_id).ask(request, timeout, cancelled)), daemon=True)
    thread.start()
    return thread, got


def wait_pending(api: TestClient) -> dict[str, Any]:
    pending = wait_until(lambda: api.get("/v1/approvals", headers=AUTH).json(),
                         "the approval request to show", timeout=10)
    (approval,) = pending
    return cast("dict[str, Any]", approval)


def test_an_answered_approval_leaves_the_list_before_its_child_reads_the_answer(
        api: TestClient, redis: redis_lib.Redis) -> None:
    """Pending means unanswered: a client that lists again right after answering (an MCP
    client waiting for the job, say) must not see its answered request as waiting."""
    holding, release = threading.Event(), threading.Event()

    def child_busy() -> bool:  # the child is held before it looks for the answer
        holding.set()
        release.wait(10)
        return False

    thread, got = ask_in_thread(redis, "s-answered", timeout=30, cancelled=child_busy)
    approval = wait_pending(api)
    assert holding.wait(10)
    answer = api.post(f"/v1/approvals/{approval['id']}", headers=AUTH,
                      json={"decision": "approve"})
    assert answer.status_code == 200, answer.text
    assert api.get("/v1/approvals", headers=AUTH).json() == []
    assert ApprovalQueue(redis, "s-answered").pending() == []
    release.set()
    thread.join(timeout=10)
    assert got == [("approve", "answered by a person")]


def test_a_second_answer_gets_409_and_an_unknown_id_404(api: TestClient,
                                                        redis: redis_lib.Redis) -> None:
    thread, got = ask_in_thread(redis, "s409", timeout=30)
    approval = wait_pending(api)
    first = api.post(f"/v1/approvals/{approval['id']}", headers=AUTH,
                     json={"decision": "approve"})
    assert first.status_code == 200, first.text
    thread.join(timeout=10)
    assert got == [("approve", "answered by a person")]
    for job in (None, "s409"):  # whether the request was found by its job or not
        again = api.post(f"/v1/approvals/{approval['id']}", headers=AUTH,
                         params={"job": job} if job else None, json={"decision": "deny"})
        assert again.status_code == 409, again.text
        assert "answered already (approve)" in again.json()["detail"]
    unknown = api.post("/v1/approvals/p000000000000", headers=AUTH, json={"decision": "deny"})
    assert unknown.status_code == 404 and "GET /v1/approvals" in unknown.json()["detail"]


def test_an_answer_from_swarm_approve_or_after_the_timeout_gets_409(
        api: TestClient, redis: redis_lib.Redis, redis_server: str) -> None:
    thread, got = ask_in_thread(redis, "s409cli", timeout=30)
    approval = wait_pending(api)
    cli = CliRunner().invoke(main, ["approve", approval["id"], "--swarm", "s409cli", "--deny"],
                             env={"SWARM_REDIS_URL": redis_server})
    assert cli.exit_code == 0, cli.output
    thread.join(timeout=10)
    assert got == [("deny", "answered by a person")]
    late = api.post(f"/v1/approvals/{approval['id']}", headers=AUTH, json={"decision": "approve"})
    assert late.status_code == 409 and "answered already (deny)" in late.json()["detail"]

    # No answer in time: the child gives up. Its request's id is noted while it waits (the
    # child asks `cancelled` as it does), so a slow machine cannot let it expire unseen.
    seen: list[str] = []

    def note_pending() -> bool:
        if not seen:
            seen.extend(p.id for p in ApprovalQueue(redis, "s409late").pending())
        return False

    thread, got = ask_in_thread(redis, "s409late", timeout=0.3, cancelled=note_pending)
    thread.join(timeout=10)
    assert got and got[0][0] == "deny" and "no one answered" in got[0][1]
    (approval_id,) = seen
    late = api.post(f"/v1/approvals/{approval_id}", headers=AUTH, json={"decision": "approve"})
    assert late.status_code == 409 and "no one answered in time" in late.json()["detail"]


def test_an_answer_just_before_the_child_gives_up_wins(redis: redis_lib.Redis) -> None:
    """The person who answered gets their 200 and the child their answer, not a denial."""
    queue = ApprovalQueue(redis, "s409race")

    def answer_then_give_up() -> bool:  # the answer lands as the child stops waiting
        (pending,) = queue.pending()
        assert queue.answer(pending.id, "always")
        return True

    thread, got = ask_in_thread(redis, "s409race", timeout=30, cancelled=answer_then_give_up)
    thread.join(timeout=10)
    assert got == [("always", "answered by a person")]


# -- jobs that run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("serve-home")
    with local_swarm(home, concurrency=8) as url:
        yield url, home


@pytest.fixture(scope="module")
def model(cluster: tuple[str, Path]) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


def running_app(cluster: tuple[str, Path], model: ScriptedModelServer, **env: str) -> FastAPI:
    url, home = cluster
    return make_app(connect(url), url, home / "jobs", SWARM_BASE_URL=model.base_url,
                    SWARM_MODEL=model.models[0], **env)


@pytest.fixture
def live_url(cluster: tuple[str, Path], model: ScriptedModelServer) -> Iterator[str]:
    """The app served by uvicorn in a thread, so the event stream really streams."""
    config = uvicorn.Config(running_app(cluster, model), host="127.0.0.1", port=0,
                            log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start", timeout=10)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def sse(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """Events of a text/event-stream (comments skipped)."""
    event: dict[str, str] = {}
    for line in lines:
        if not line:
            if event:
                yield event
            event = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            event[name] = value.removeprefix(" ")


def follow(base: str, job: str, last_id: str | None = None) -> list[dict[str, str]]:
    headers = {**AUTH, **({"Last-Event-ID": last_id} if last_id else {})}
    out = []
    with httpx.stream("GET", f"{base}/v1/jobs/{job}/events", headers=headers,
                      timeout=httpx.Timeout(5.0, read=30.0)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for event in sse(response.iter_lines()):
            out.append(event)
            if event.get("event") == "end":
                break
    return out


def wait_state(get: Any, job: str, states: tuple[str, ...], timeout: float = 30) -> dict[str, Any]:
    def body() -> dict[str, Any] | None:
        got: dict[str, Any] = get(f"/v1/jobs/{job}", headers=AUTH).json()
        return got if got["state"] in states else None

    return wait_until(body, f"job {job} to be {' or '.join(states)}", timeout=timeout,
                      every=0.1)


@pytest.mark.slow
def test_a_job_end_to_end_over_sse(live_url: str, model: ScriptedModelServer) -> None:
    model.responder = ByTask({
        "SSEJOB": [Reply(tool_calls=[ToolCall("agent", {"message": "SSEKID count"}, id="k")]),
                   lambda r: Reply(content="total: " + json.loads(tool_results(r)[0])["answer"])],
        "SSEKID": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo 7"})]),
                   lambda r: Reply(content=tool_results(r)[0].split()[0])],
    })
    created = httpx.post(f"{live_url}/v1/jobs", headers=AUTH,
                         json={"task": "SSEJOB add it up", "approve": "all"})
    assert created.status_code == 201, created.text
    job = created.json()["id"]
    events = follow(live_url, job)
    assert events[-1]["event"] == "end"
    assert json.loads(events[-1]["data"]) == {"id": job, "state": "done", "reason": "settled"}
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and "tool" in kinds and "settled" in kinds
    ids = [e["id"] for e in events[:-1]]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert all(json.loads(e["data"])["kind"] == e["event"] for e in events[:-1])
    got = httpx.get(f"{live_url}/v1/jobs/{job}", headers=AUTH).json()
    assert got["state"] == "done" and got["answer"] == "total: 7"
    assert [a["depth"] for a in got["agents"]] == [0, 1]
    assert got["usage"]["total_tokens"] > 0
    # Resuming after an event id gives only what came after it, then the end.
    again = follow(live_url, job, last_id=ids[1])
    assert [e.get("id") for e in again[:-1]] == ids[2:] and again[-1]["event"] == "end"


@pytest.mark.slow
def test_cancel_a_running_job(cluster: tuple[str, Path], model: ScriptedModelServer) -> None:
    model.responder = ByTask({"SLOWJOB": [
        Reply(tool_calls=[ToolCall("run_cli", {"command": "sleep 30"})]),
        Reply(content="should not get here")]})
    with TestClient(running_app(cluster, model)) as api:
        job = api.post("/v1/jobs", headers=AUTH,
                       json={"task": "SLOWJOB", "approve": "all"}).json()["id"]
        events = connect(cluster[0])
        wait_until(lambda: "sleep 30" in json.dumps(events.xrange(keys.events(job))),
                   "the job's command to start", timeout=20, every=0.1)
        started = time.monotonic()
        response = api.post(f"/v1/jobs/{job}/cancel", headers=AUTH)
        assert response.status_code == 202
        assert response.json()["flagged"] == [job]
        final = wait_state(api.get, job, ("cancelled", "failed", "done"), timeout=15)
        assert final["state"] == "cancelled", final
        assert time.monotonic() - started < 10
        assert api.post(f"/v1/jobs/{job}/cancel", headers=AUTH).json()["flagged"] == []


@pytest.mark.slow
def test_approvals_are_listed_and_answered(cluster: tuple[str, Path],
                                           model: ScriptedModelServer) -> None:
    model.responder = ByTask({"ASKJOB": [
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo approved-run"})]),
        lambda r: Reply(content="saw: " + tool_results(r)[0].split("\n")[0])]})
    with TestClient(running_app(cluster, model, SWARM_APPROVAL="run_cli=always")) as api:
        job = api.post("/v1/jobs", headers=AUTH,
                       json={"task": "ASKJOB", "approve": "ask"}).json()["id"]
        pending = wait_until(lambda: api.get(f"/v1/approvals?job={job}", headers=AUTH).json(),
                             "the job's approval request", timeout=20, every=0.1)
        (approval,) = pending
        assert approval["job"] == job and approval["tool"] == "run_cli"
        assert "echo approved-run" in approval["summary"]
        assert approval in api.get("/v1/approvals", headers=AUTH).json()
        bad = api.post(f"/v1/approvals/{approval['id']}", headers=AUTH, json={"decision": "ok"})
        assert bad.status_code == 422
        answer = api.post(f"/v1/approvals/{approval['id']}", headers=AUTH,
                          json={"decision": "approve"})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"id": approval["id"], "job": job, "decision": "approve"}
        twice = api.post(f"/v1/approvals/{approval['id']}", headers=AUTH,
                         json={"decision": "deny"})
        assert twice.status_code == 409, twice.text
        assert "answered already" in twice.json()["detail"]
        final = wait_state(api.get, job, ("done", "failed", "cancelled"))
        assert final["state"] == "done" and final["answer"] == "saw: approved-run", final


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not sandbox.probe().ok,
                    reason="a root worker's sandbox (ACL grants to its uid) needs root and bwrap")
def test_a_workspace_swapped_for_a_link_before_the_worker_starts_fails_the_job(
        redis: redis_lib.Redis, redis_server: str, model_server: ScriptedModelServer) -> None:
    """The API checks a job's workspace lies in its root; the folder is then replaced by a
    link to a root-only folder before a worker takes the job. The worker opens the
    workspace from the root following no link: the job fails saying why, nothing runs, and
    the root-only folder gets no ACL entry for the box's uid."""
    base = Path(tempfile.mkdtemp(prefix="swarm-swap-", dir="/var/tmp"))
    try:
        root, private = base / "jobs", base / "private"
        private.mkdir(mode=0o700)
        secret = private / "secret"
        secret.write_text("ROOT-ONLY-7f3a\n")
        secret.chmod(0o600)
        model_server.responder = ByTask({"SWAPJOB": [
            Reply(tool_calls=[ToolCall("run_cli", {"command": "cat secret; echo x > written"})]),
            lambda r: Reply(content="saw: " + tool_results(r)[0])]})
        app = make_app(redis, redis_server, root, SWARM_BASE_URL=model_server.base_url,
                       SWARM_MODEL=model_server.models[0])
        with TestClient(app) as api:
            created = api.post("/v1/jobs", headers=AUTH, json={
                "task": "SWAPJOB", "approve": "all", "workspace": "team/ws"})
            assert created.status_code == 201, created.text
            job = created.json()["id"]
            workspace = root / "team" / "ws"
            workspace.rmdir()  # checked and made by the API; now swapped, before a worker
            workspace.symlink_to(private)
            cluster = LocalCluster(redis_server, base / "home", workers=1, concurrency=2)
            try:
                wait_for(redis, 30, cluster.start().procs)
                final = wait_state(api.get, job, ("done", "failed", "cancelled"))
            finally:
                cluster.stop()
        assert final["state"] == "failed", final
        assert f"{workspace} is a symbolic link" in final["error"], final
        assert "SWARM_SERVE_ROOT" in final["error"] and final["answer"] is None
        assert not model_server.requests  # nothing ran: no model call, no command
        for path in (private, secret):
            for name in ("system.posix_acl_access", "system.posix_acl_default"):
                with pytest.raises(OSError) as no_acl:
                    os.getxattr(path, name)
                assert no_acl.value.errno == errno.ENODATA, (path, name)
        assert sorted(p.name for p in private.iterdir()) == ["secret"]
        assert "ROOT-ONLY" not in json.dumps(redis.xrange(keys.events(job)))
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- the OpenAPI document, fuzzed ---------------------------------------------------------


#: The token for the bearer scheme of the document, and 413 as a fine answer to a body
#: that is too large (schemathesis sends tasks over the length limit).
FUZZ_CONFIG = {
    "auth": {"openapi": {"HTTPBearer": {"bearer": TOKEN}}},
    "checks": {"negative_data_rejection": {"expected-statuses": [
        400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]}},
}


def test_the_api_conforms_to_its_openapi_document(app: FastAPI) -> None:
    """Every operation, fuzzed from the document, answers as the document says; the fuzzing
    gets past the token (a job is created, approvals are listed), so it tested the API
    itself and not only the 401s."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH,
                                            config=schemathesis.Config.from_dict(FUZZ_CONFIG))
    seen: set[tuple[str, int]] = set()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/jobs", "GET /v1/approvals"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=int(os.environ.get("SWARM_FUZZ_EXAMPLES", "25")), deadline=None,
                  suppress_health_check=list(HealthCheck), database=None)
        def conforms(case: Any) -> None:
            seen.add((case.operation.label, case.call_and_validate().status_code))

        conforms()
    assert ("POST /v1/jobs", 201) in seen and ("GET /v1/approvals", 200) in seen, seen


# -- the page -----------------------------------------------------------------------------


def test_the_page_is_served_without_a_token_under_a_strict_csp(api: TestClient) -> None:
    """A browser cannot send a header when it opens a page: the page's three files need
    no token, hold nothing of a job or a token, and go with a CSP that runs only this
    origin's script file, never inline script; the script sets text, never markup."""
    for path, media in (("/", "text/html"), ("/static/page.js", "text/javascript"),
                        ("/static/page.css", "text/css")):
        got = api.get(path)
        assert got.status_code == 200, path
        assert got.headers["content-type"].startswith(media)
        csp = got.headers["content-security-policy"]
        assert "script-src 'self';" in csp and "default-src 'none'" in csp
        assert "unsafe" not in csp and "connect-src 'self'" in csp
        assert got.headers["x-content-type-options"] == "nosniff"
        assert TOKEN not in got.text
    html = api.get("/").text
    assert '<script src="/static/page.js" defer></script>' in html
    assert html.count("<script") == 1  # no inline script
    script = api.get("/static/page.js").text
    for markup in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert markup not in script, markup
    assert "sessionStorage" in script and "localStorage" not in script
    assert "document.cookie" not in script
    assert api.get("/v1/jobs").status_code == 401  # the data still needs the token


def test_an_agents_conversation_pairs_calls_with_outputs_and_caps_its_texts() -> None:
    from swarm.report.conversation import entries

    call = {"id": "c1", "type": "function",
            "function": {"name": "run_cli", "arguments": json.dumps({"command": "seq 100000"})}}
    messages = [{"role": "system", "content": "the prompt"},
                {"role": "user", "content": "count"},
                {"role": "assistant", "content": "on it", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "\n".join(
                    map(str, range(100000)))},
                {"role": "assistant", "content": "done <b>counting</b>"}]
    shown, earlier = entries(messages, tail=10, text_cap=1000)
    assert earlier == 0
    assert [e["kind"] for e in shown] == ["user", "said", "call", "answer"]
    assert shown[2]["text"] == "$ seq 100000" and shown[2]["tool"] == "run_cli"
    output = shown[2]["output"]
    assert output.startswith("0\n1\n") and output.endswith("99999") and len(output) < 1100
    assert "characters cut" in output
    assert shown[3]["text"] == "done <b>counting</b>"
    tail, earlier = entries(messages, tail=2, text_cap=1000)
    assert earlier == 2 and [e["kind"] for e in tail] == ["call", "answer"]
