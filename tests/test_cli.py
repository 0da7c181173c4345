"""The CLI end to end: `swarm run` against the scripted model over HTTP, state in real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from click.testing import CliRunner

from swarm.cli import main
from swarm.cli.runtime import ROOT_NOTE
from swarm.runtime.local import alive
from swarm.store import keys
from swarm.store.locks import RedisLock
from swarm.testing.server import Fault, Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until


@pytest.fixture
def cli_env(model_server: ScriptedModelServer, redis_server: str, redis: redis_lib.Redis,
            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    for var in list(os.environ):
        if var.startswith(("SWARM_", "OPENAI_", "EVA_")):
            monkeypatch.delenv(var)
    env = {
        "SWARM_BASE_URL": model_server.base_url,
        "SWARM_MODEL": model_server.models[0],
        "SWARM_REDIS_URL": redis_server,
        "SWARM_HOME": str(tmp_path / "home"),
        "SWARM_RETRIES": "2",
        "SWARM_BACKOFF_MAX": "0.01",
    }
    yield env


def invoke(env: dict[str, str], *args: str, input: str | None = "") -> object:
    return CliRunner().invoke(main, list(args), env=env, input=input, catch_exceptions=False)


def test_run_prints_the_answer_alone_on_stdout(model_server: ScriptedModelServer,
                                               cli_env: dict[str, str], tmp_path: Path) -> None:
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "echo hi > made.txt && echo wrote"})]),
        Reply(content="I made made.txt."),
    )
    result = invoke(cli_env, "run", "--yes", "-C", str(tmp_path), "make", "a", "file")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "I made made.txt.\n"
    assert "$ echo hi > made.txt && echo wrote" in result.stderr
    assert "wrote" in result.stderr
    assert (tmp_path / "made.txt").read_text() == "hi\n"
    assert model_server.requests[0]["messages"][-1]["content"] == "make a file"


def test_run_resumes_the_folder_session_and_new_starts_over(
        model_server: ScriptedModelServer, cli_env: dict[str, str], tmp_path: Path) -> None:
    model_server.script(Reply(content="first"), Reply(content="second"), Reply(content="third"))
    assert invoke(cli_env, "run", "-y", "-C", str(tmp_path), "one").stdout == "first\n"
    assert invoke(cli_env, "run", "-y", "-C", str(tmp_path), "two").stdout == "second\n"
    contents = [m["content"] for m in model_server.requests[1]["messages"]]
    assert contents[1:] == ["one", "first", "two"]
    assert invoke(cli_env, "run", "-y", "--new", "-C", str(tmp_path), "three").exit_code == 0
    assert [m["content"] for m in model_server.requests[2]["messages"]][1:] == ["three"]


def test_closed_stdin_denies(model_server: ScriptedModelServer, cli_env: dict[str, str],
                             tmp_path: Path) -> None:
    model_server.script(
        Reply(tool_calls=[ToolCall("run_cli", {"command": "touch nope"})]),
        Reply(content="denied, stopping"),
    )
    result = invoke(cli_env, "run", "-C", str(tmp_path), "touch it", input=None)
    assert result.exit_code == 0
    assert not (tmp_path / "nope").exists()
    assert "denied" in result.stderr
    assert len(model_server.review_requests) == 1


def test_model_errors_exit_non_zero_with_a_hint(model_server: ScriptedModelServer,
                                                cli_env: dict[str, str], tmp_path: Path) -> None:
    model_server.script(Fault(status=401))
    result = invoke(cli_env, "run", "-y", "-C", str(tmp_path), "hi")
    assert result.exit_code == 1
    assert "SWARM_API_KEY" in result.stderr
    assert result.stdout == ""


def test_max_turns_exit_code(model_server: ScriptedModelServer, cli_env: dict[str, str],
                             tmp_path: Path) -> None:
    model_server.script(*[Reply(tool_calls=[ToolCall("run_cli", {"command": "true"})])] * 2)
    result = invoke(cli_env, "run", "-y", "--max-turns", "1", "-C", str(tmp_path), "go")
    assert result.exit_code == 3
    assert "--max-turns 1" in result.stderr


def test_locked_session_is_refused(cli_env: dict[str, str], tmp_path: Path,
                                   redis: redis_lib.Redis) -> None:
    sid = keys.session_id_for(str(tmp_path.resolve()))
    with RedisLock(redis, f"session:{sid}", ttl=30, owner_info={"pid": 4242, "host": "elsewhere"}):
        result = invoke(cli_env, "run", "-y", "-C", str(tmp_path), "hi")
    assert result.exit_code == 1
    assert "4242" in result.stderr


def test_sessions_list_and_clear(model_server: ScriptedModelServer, cli_env: dict[str, str],
                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_server.script(Reply(content="a"), Reply(content="b"))
    other = tmp_path / "other"
    other.mkdir()
    invoke(cli_env, "run", "-y", "-C", str(tmp_path), "x")
    invoke(cli_env, "run", "-y", "-C", str(other), "y")
    monkeypatch.chdir(tmp_path)
    listing = invoke(cli_env, "sessions").stdout.splitlines()
    assert len(listing) == 2
    assert listing[0].startswith(f"  {other}")
    assert listing[1].startswith(f"* {tmp_path}")
    assert "deleted 1" in invoke(cli_env, "sessions", "clear", "--here", "--yes").stderr
    assert "deleted 1" in invoke(cli_env, "sessions", "clear", "--yes").stderr
    assert "no sessions" in invoke(cli_env, "sessions").stderr


def test_help_works_with_dash_h(cli_env: dict[str, str]) -> None:
    for args in (["-h"], ["run", "-h"], ["chat", "-h"], ["sessions", "-h"]):
        result = invoke(cli_env, *args)
        assert result.exit_code == 0 and "Usage:" in result.stdout


def test_bad_setting_is_a_clear_error(cli_env: dict[str, str], tmp_path: Path) -> None:
    result = invoke({**cli_env, "SWARM_APPROVAL": "run_cli=sometimes"}, "run", "-C",
                    str(tmp_path), "x")
    assert result.exit_code == 1
    assert "always, never, once, review" in result.stderr


def test_run_says_so_when_no_worker_answers(model_server: ScriptedModelServer,
                                            cli_env: dict[str, str], tmp_path: Path) -> None:
    """An external Redis with no coordinator or worker: a clear error, not a silent wait."""
    model_server.script(Reply(tool_calls=[ToolCall("agent", {"message": "help me"})]))
    result = invoke(cli_env, "run", "-y", "-C", str(tmp_path), "split this")
    assert result.exit_code == 1
    assert "no coordinator and no worker answered" in result.stderr
    assert "--workers N" in result.stderr


def test_no_model_configured_points_to_the_demo(cli_env: dict[str, str], tmp_path: Path) -> None:
    env = {**cli_env, "SWARM_BASE_URL": "", "SWARM_MODEL": ""}
    result = invoke(env, "run", "-C", str(tmp_path), "hi")
    assert result.exit_code == 1
    assert "SWARM_BASE_URL" in result.stderr and "swarm demo" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the note is for a worker run as root")
def test_a_root_worker_says_swarms_note_not_celerys_uid_advice(
        cli_env: dict[str, str], redis: redis_lib.Redis, tmp_path: Path) -> None:
    """Celery's warning told a root worker to pass --uid, which swarm worker does not have."""
    name = f"rootnote-{os.getpid()}@test"
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm", "worker", "-c", "1", "-Q", "rootnote", "-n", name],
            env={**os.environ, **cli_env}, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            return name in alive(redis, "worker")

        wait_until(ready, "the worker's heartbeat")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "--uid" not in text and "SecurityWarning" not in text, text
    assert ROOT_NOTE in text, text
