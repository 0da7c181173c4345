"""Secrets and access: a planted API key shows up nowhere (Redis, Celery results, logs, the
CLI, what the model is told), and a Redis with a password or an ACL user works for every
part of the swarm, while a wrong password fails clearly without being printed."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result

from swarm.cli import main
from swarm.testing.scripts import ByTask
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall

from .conftest import (
    MARKER_NAME,
    MARKER_VALUE,
    SECRET,
    Swarm,
    agent_call,
    answer_with_results,
    clean_env,
    echo_result,
    requests_of,
    start_cluster,
    swarm_run,
)

pytestmark = pytest.mark.slow

PEEK = ("env; echo ---; cat /proc/self/environ | tr '\\0' '\\n'; echo ---; "
        "printenv SWARM_API_KEY; echo ---; set; echo ---; cat /proc/$$/environ | tr '\\0' '\\n'")


# -- the planted key ---------------------------------------------------------------------------

def dump_redis(url: str) -> str:
    """Every key of every database with its whole value, whatever its type, as text."""
    with redis_lib.Redis.from_url(url) as first:
        databases = [int(db[2:]) for db in first.info("keyspace")]
    assert databases, "the Redis is empty"
    out: list[str] = []
    for db in databases:
        # bytes, not decoded: Celery's and kombu's values too
        with redis_lib.Redis.from_url(f"{url.rsplit('/', 1)[0]}/{db}") as client:
            for key in client.scan_iter(count=1000):
                raw = client.type(key)
                kind = raw.decode() if isinstance(raw, bytes) else str(raw)
                value: object
                if kind == "string":
                    value = client.get(key)
                elif kind == "hash":
                    value = client.hgetall(key)
                elif kind == "list":
                    value = client.lrange(key, 0, -1)
                elif kind == "set":
                    value = client.smembers(key)
                elif kind == "zset":
                    value = client.zrange(key, 0, -1, withscores=True)
                elif kind == "stream":
                    value = client.xrange(key)
                else:
                    raise AssertionError(f"key {key!r} of unknown type {kind}")
                out.append(f"db{db} {kind} {key!r}: {value!r}")
    return "\n".join(out)


def files_text(root: Path) -> dict[Path, str]:
    return {p: p.read_bytes().decode("utf-8", "replace") for p in root.rglob("*") if p.is_file()}


def run_peek(swarm: Swarm, model: ScriptedModelServer, workspace: Path, root_task: str,
             child: str) -> Result:
    model.responder = ByTask({
        root_task: [Reply(tool_calls=[ToolCall("run_cli", {"command": PEEK}, id="root-peek"),
                                      agent_call(child, "p1")]), answer_with_results],
        child.split()[0]: [Reply(tool_calls=[ToolCall("run_cli", {"command": PEEK})]),
                           echo_result],
    })
    return swarm_run(swarm, model, workspace, root_task, "-vv", **{MARKER_NAME: MARKER_VALUE})


def test_planted_api_key_appears_nowhere(swarm: Swarm, model: ScriptedModelServer,
                                         tmp_path: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    caplog.set_level(logging.DEBUG)
    child = "PEEKENV child: show me your environment"
    result = run_peek(swarm, model, tmp_path, "SECRETS root", child)
    assert result.exit_code == 0, result.output
    (root_peek, child_result) = json.loads(result.stdout)
    # The child ran: the model server requires the planted key, so its worker sent it.
    assert child_result["state"] == "done", child_result

    # What the model was told: both environments were dumped, the marker is there, not the key.
    told = json.dumps([model.requests, model.review_requests])
    assert told.count(f"{MARKER_NAME}={MARKER_VALUE}") >= 4  # env + environ, root and child
    assert "/proc/self/environ" in told and "SWARM_API_KEY" in told
    assert SECRET not in told

    # Redis: every key of every type (agent tasks store no Celery result: the ledger has it).
    dump = dump_redis(swarm.url)
    assert "celery-task-meta-" not in dump
    for seen in ("PEEKENV child", "swarm:session:", "swarm:events:",
                 f"{MARKER_NAME}={MARKER_VALUE}"):
        assert seen in dump, seen
    assert SECRET not in dump

    # Files under SWARM_HOME: the coordinator's and worker's logs, the server's data and log.
    files = files_text(swarm.home)
    logs = {p.name: t for p, t in files.items() if p.parent == swarm.home / "logs"}
    assert {"coordinator.log", "worker-0.log"} <= set(logs)
    assert f"agent {child_result['agent_id']} depth 1: PEEKENV" in logs["worker-0.log"]
    assert "coordinator local-" in logs["coordinator.log"]
    assert any("appendonly" in str(p) for p in files)  # the server's data was read too
    leaked = [str(p) for p, t in files.items() if SECRET in t]
    assert leaked == []

    # The CLI: the answer, what it showed of the commands, and its own (debug) logs.
    assert "printenv SWARM_API_KEY" in result.stderr  # it shows the commands it ran
    assert SECRET not in result.stdout and SECRET not in result.stderr
    assert caplog.records and SECRET not in caplog.text
    assert f"{MARKER_NAME}={MARKER_VALUE}" in root_peek and SECRET not in root_peek


def test_a_child_cannot_read_the_key_from_its_worker(swarm: Swarm, model: ScriptedModelServer,
                                                     tmp_path: Path) -> None:
    model.responder = ByTask({
        "PPIDROOT": [Reply(tool_calls=[agent_call("PPIDKID child", "k1")]),
                     answer_with_results],
        "PPIDKID": [Reply(tool_calls=[ToolCall("run_cli", {
            "command": "for p in $PPID 1; do cat /proc/$p/environ; echo; done | tr '\\0' '\\n'"})]),
            echo_result],
    })
    result = swarm_run(swarm, model, tmp_path, "PPIDROOT root")
    assert result.exit_code == 0, result.output
    told = json.dumps(requests_of(model, "PPIDKID"))
    # The box's runner (its parent) refuses to be read; the box's init shows the
    # environment the worker gave the box: the marker, never the key.
    assert "/proc/2/environ: Permission denied" in told
    assert f"{MARKER_NAME}={MARKER_VALUE}" in told  # it did read what the worker passed
    assert SECRET not in told


# -- Redis with a password and with an ACL user -----------------------------------------------

PASSWORD = "pw-Default-7q2x"
ALICE_PASSWORD = "pw-Alice-k81m"
WRONG = "pw-Wrong-0zz9"


@dataclass
class AuthRedis:
    port: int

    def url(self, userinfo: str) -> str:
        return f"redis://{userinfo}@127.0.0.1:{self.port}/0"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthRedis]:
    from swarm.store.server import server_binary

    data = tmp_path_factory.mktemp("auth-redis")
    for _attempt in range(5):  # the free port may be taken between the check and the bind
        port = free_port()
        conf = data / "valkey.conf"
        conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {data}\nsave \"\"\n"
                        f"appendonly no\nrequirepass {PASSWORD}\n"
                        f"user alice on >{ALICE_PASSWORD} ~* &* +@all\n")
        log = open(data / "valkey.log", "ab")  # noqa: SIM115  (closed below)
        proc = subprocess.Popen([str(server_binary()), str(conf)], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        client = redis_lib.Redis(port=port, password=PASSWORD)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis_lib.ConnectionError:
                time.sleep(0.05)
        client.close()
        if proc.poll() is None and time.monotonic() < deadline:
            break
        proc.kill()
        proc.wait()
        log.close()
    else:
        pytest.fail(f"valkey-server did not start: {(data / 'valkey.log').read_text()[-2000:]}")
    try:
        yield AuthRedis(port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def cli(url: str, home: Path, *args: str) -> Result:
    return CliRunner().invoke(main, list(args),
                              env=clean_env(SWARM_REDIS_URL=url, SWARM_HOME=str(home)))


@pytest.mark.parametrize("userinfo", [f":{PASSWORD}", f"alice:{ALICE_PASSWORD}"],
                         ids=["requirepass", "acl-user"])
def test_swarm_runs_on_a_redis_with_credentials(auth_redis: AuthRedis,
                                                model: ScriptedModelServer, tmp_path: Path,
                                                userinfo: str) -> None:
    url = auth_redis.url(userinfo)
    password = userinfo.split(":", 1)[1]
    admin = redis_lib.Redis(port=auth_redis.port, password=PASSWORD)
    admin.flushall()  # no heartbeat of the other case's processes: these must answer
    admin.close()
    home = tmp_path / "home"
    home.mkdir()
    cluster = start_cluster(url, home)
    try:
        swarm = Swarm(url, home, cluster)
        model.responder = ByTask({
            "AUTHROOT": [Reply(tool_calls=[agent_call("AUTHKID one", "a1"),
                                           agent_call("AUTHKID two", "a2")]),
                         answer_with_results],
            "AUTHKID": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo kid"})]),
                        Reply(content="kid done")],
        })
        work = tmp_path / "work"
        work.mkdir()
        result = swarm_run(swarm, model, work, "AUTHROOT root")
        assert result.exit_code == 0, result.output
        assert [(r["state"], r["answer"]) for r in json.loads(result.stdout)] == [
            ("done", "kid done"), ("done", "kid done")]
        status = cli(url, home, "status", "--json")
        assert status.exit_code == 0, status.output
        agents = json.loads(status.stdout)["agents"]
        assert [a["state"] for a in agents] == ["done", "done", "done"], agents
        plain = cli(url, home, "status")
        assert plain.exit_code == 0 and plain.stdout.count("AUTHKID") == 2, plain.output
        # The coordinator and the worker are connected as that user.
        admin = redis_lib.Redis(port=auth_redis.port, password=PASSWORD, decode_responses=True)
        users = [c["user"] for c in admin.client_list() if c["id"] != str(admin.client_id())]
        admin.close()
        assert len(users) >= 2 and set(users) == {userinfo.split(":")[0] or "default"}, users
    finally:
        cluster.stop()
    shown = [result.output, result.stderr, status.output, plain.output,
             *files_text(home / "logs").values()]
    assert sum(len(s) for s in shown[4:]) > 0
    assert not [s[:300] for s in shown if password in s]


@pytest.mark.parametrize("userinfo", [f":{WRONG}", f"alice:{WRONG}", ""],
                         ids=["wrong-password", "wrong-acl-password", "no-password"])
def test_wrong_credentials_fail_clearly_and_masked(auth_redis: AuthRedis, tmp_path: Path,
                                                   userinfo: str) -> None:
    url = auth_redis.url(userinfo) if userinfo else f"redis://127.0.0.1:{auth_redis.port}/0"
    masked = url.replace(WRONG, "***")
    env = clean_env(SWARM_REDIS_URL=url, SWARM_HOME=str(tmp_path),
                    SWARM_BASE_URL="http://127.0.0.1:9/v1", SWARM_MODEL="m")
    # The long-running processes refuse to start, side by side (each takes a second to import).
    procs = [subprocess.Popen([sys.executable, "-m", "swarm", command], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in (("worker", "coordinator") if userinfo else ())]
    outputs = []
    for args in (["status"], ["run", "--yes", "hello"]) if userinfo else (["status"],):
        result = CliRunner().invoke(main, args, env=env)
        assert result.exit_code == 1, (args, result.output)
        outputs.append(result.output)
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0, (proc.args, err[-2000:])
        outputs.append(out + err)
    refused = "the credentials" if userinfo else "a login (no password given)"
    for output in outputs:
        assert f"Redis at {masked} refused {refused}" in output, output[-2000:]
        assert "check the user and password in SWARM_REDIS_URL" in output
        assert "Traceback" not in output
        assert WRONG not in output
