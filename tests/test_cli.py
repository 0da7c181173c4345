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


# -- the task from a file or stdin, and its size ------------------------------------------


def sent_task(server: ScriptedModelServer) -> str:
    """The task the model received: the user message of the first chat request."""
    return str(server.requests[0]["messages"][-1]["content"])


def test_run_reads_the_task_from_a_file(model_server: ScriptedModelServer,
                                        cli_env: dict[str, str], tmp_path: Path) -> None:
    task = tmp_path / "task.md"
    task.write_text("Résumé the notes ✓\n\n  - keep the indent\n", encoding="utf-8")
    model_server.script(Reply(content="one"), Reply(content="two"))
    result = invoke(cli_env, "run", "-y", "--new", "-C", str(tmp_path), "-f", str(task))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "one\n"
    assert sent_task(model_server) == "Résumé the notes ✓\n\n  - keep the indent"
    # Words first, then the file's text after a blank line.
    result = invoke(cli_env, "run", "-y", "--new", "-C", str(tmp_path), "follow",
                    "these:", "--task-file", str(task))
    assert result.exit_code == 0, result.stderr
    assert model_server.requests[1]["messages"][-1]["content"] == \
        "follow these:\n\nRésumé the notes ✓\n\n  - keep the indent"


def test_run_reads_the_task_from_stdin_with_a_dash(model_server: ScriptedModelServer,
                                                   cli_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    model_server.script(Reply(content="one"), Reply(content="two"))
    result = invoke(cli_env, "run", "-y", "--new", "-C", str(tmp_path), "-",
                    input="the whole task\nfrom a pipe\n")
    assert result.exit_code == 0, result.stderr
    assert sent_task(model_server) == "the whole task\nfrom a pipe"
    result = invoke(cli_env, "run", "-y", "--new", "-C", str(tmp_path), "review", "this:",
                    "-", input="diff --git a/x b/x\n")
    assert result.exit_code == 0, result.stderr
    assert model_server.requests[1]["messages"][-1]["content"] == \
        "review this:\n\ndiff --git a/x b/x"


TASK_ERRORS: list[tuple[str, list[str], str | bytes, str]] = [
    ("missing", ["-f", "{tmp}/nope.md"], "", "no file"),
    ("a folder", ["-f", "{tmp}"], "", "is a folder"),
    ("not UTF-8", ["-f", "{tmp}/latin1.txt"], "", "is not UTF-8 text (byte 0xe9 at offset 2)"),
    ("stdin not UTF-8", ["-"], b"ok\xff", "stdin is not UTF-8 text"),
    ("both", ["-f", "{tmp}/latin1.txt", "-"], "", "not both"),
    ("empty file", ["-f", "{tmp}/empty.txt"], "", "the task is empty"),
    ("empty stdin", ["-"], " \n\n", "the task is empty"),
    ("no task", [], "", "the task is empty"),
]


@pytest.mark.parametrize(("why", "args", "stdin", "expected"), TASK_ERRORS,
                         ids=[e[0] for e in TASK_ERRORS])
def test_task_file_errors_are_usage_errors_before_anything_runs(
        model_server: ScriptedModelServer, cli_env: dict[str, str], tmp_path: Path,
        why: str, args: list[str], stdin: str | bytes, expected: str) -> None:
    (tmp_path / "latin1.txt").write_bytes(b"ca\xe9f")
    (tmp_path / "empty.txt").write_text("\n")
    given = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = CliRunner().invoke(main, ["run", "-y", "-C", str(tmp_path), *given],
                                env=cli_env, input=stdin, catch_exceptions=False)
    assert result.exit_code == 2, (why, result.output)
    assert expected in result.stderr, (why, result.stderr)
    assert model_server.requests == [] and model_server.models_requests == 0


def test_an_oversized_task_is_refused_before_any_model_call(
        model_server: ScriptedModelServer, cli_env: dict[str, str], tmp_path: Path) -> None:
    """600 KB of task for a 32k-token model: refused with its size, the context and what to
    do; nothing reaches the model and nothing is kept in the session."""
    big = tmp_path / "dump.txt"
    big.write_text("0123456789 abcdefghij\n" * 27_273)  # 600,006 characters
    result = invoke(cli_env, "run", "-y", "-C", str(tmp_path), "summarize:", "-f", str(big))
    assert result.exit_code == 1, result.stderr
    assert "TaskTooLarge" in result.stderr
    assert "about 150,004 tokens (600,017 characters" in result.stderr
    assert "32,768 tokens" in result.stderr and "75%" in result.stderr
    assert "file in the workspace" in result.stderr
    assert model_server.requests == [] and model_server.review_requests == []
    model_server.script(Reply(content="small is fine"))
    result = invoke(cli_env, "run", "-y", "-C", str(tmp_path), "hi")
    assert result.stdout == "small is fine\n"
    assert [m["role"] for m in model_server.requests[0]["messages"]] == ["system", "user"]


def test_a_task_over_half_the_context_runs_with_a_warning(
        model_server: ScriptedModelServer, cli_env: dict[str, str], tmp_path: Path) -> None:
    model_server.script(Reply(content="read it"))
    result = invoke(cli_env, "run", "-y", "-C", str(tmp_path), "-",
                    input="word " * 15_000)  # ~18,750 tokens of 32,768
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "read it\n"
    assert "the task takes about 18,7" in result.stderr
    assert "57% of the model's 32,768-token context" in result.stderr
    assert len(model_server.requests) == 1


def test_chat_refuses_a_message_too_large_and_goes_on(
        model_server: ScriptedModelServer, cli_env: dict[str, str], tmp_path: Path) -> None:
    model_server.script(Reply(content="pong"))
    lines = "x" * 200_000 + "\nping\n"
    result = invoke(cli_env, "chat", "-y", "-C", str(tmp_path), input=lines)
    assert result.exit_code == 0, result.stderr
    assert "TaskTooLarge" in result.stderr and "32,768 tokens" in result.stderr
    assert "pong" in result.stdout + result.stderr
    assert [sent_task(model_server)] == ["ping"] and len(model_server.requests) == 1

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


def test_a_worker_raises_its_open_files_to_the_hard_limit_and_warns_when_it_is_low() -> None:
    """A worker's children hold descriptors (boxes, pipes, connections): the usual soft limit
    of 1,024 ran out at a few hundred; it is raised to the hard limit, with a warning where
    even that is too low for --concurrency."""
    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (512, int(sys.argv[1])))\n"
              "from swarm.cli.runtime import more_open_files\n"
              "more_open_files(256)\n"
              "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    for hard, warned in ((8000, False), (600, True)):
        done = subprocess.run([sys.executable, "-c", script, str(hard)], capture_output=True,
                              text=True, timeout=60, check=True)
        assert done.stdout.strip() == str(hard)
        assert ("warning: this worker may open 600 files" in done.stderr) is warned, done.stderr
