"""``swarm demo``: its scripted model's counting, a real run on a local swarm, and its
refusal to run on a deployment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner

from swarm.cli import main
from swarm.store.connection import mask_url
from swarm.testing.scripts import DEMO_CHILD, DemoTally, demo_responder, demo_task
from swarm.testing.server import Reply, ScriptedModelServer

FILES = {"a.txt": "one two\nthree\n", "b.txt": "x\n", "c.txt": "a b c d\ne f\ng\n"}
"""2 lines 3 words, 1 line 1 word, 3 lines 7 words: 6 lines, 11 words in all."""


def answer_of(reply: Any) -> str:
    assert isinstance(reply, Reply)
    return reply.content or ""


def child_request(output: str) -> dict[str, Any]:
    task = f"{DEMO_CHILD}: count the lines and words of the file /f with wc and answer"
    return {"messages": [{"role": "user", "content": task},
                         {"role": "assistant", "content": None, "tool_calls": [{}]},
                         {"role": "tool", "content": output}]}


def test_a_child_reports_a_count_only_from_a_clean_wc() -> None:
    model = demo_responder()
    assert answer_of(model(child_request("      2       5\n[exit code: 0]"))) == "lines=2 words=5"
    failed = answer_of(model(child_request(
        "sh: 1: cannot open /f: Permission denied\n[exit code: 2]")))
    assert failed == "could not count: sh: 1: cannot open /f: Permission denied [exit code: 2]"


def test_the_root_never_calls_a_done_child_failed() -> None:
    paths = ["/f/a", "/f/b", "/f/c"]
    results = [{"agent_id": "a1", "state": "done", "answer": "lines=2 words=5"},
               {"agent_id": "a2", "state": "done", "answer": "could not count: no such file"},
               {"agent_id": "a3", "state": "failed", "error": "ModelError: gave up"}]
    request = {"messages": [{"role": "user", "content": demo_task(paths)},
                            {"role": "assistant", "content": None, "tool_calls": [{}] * 3},
                            *({"role": "tool", "content": json.dumps(r)} for r in results)]}
    tally = DemoTally()
    assert answer_of(demo_responder(tally)(request)).splitlines() == [
        "3 files, 1 counted: 2 lines, 5 words; 1 child done without a count; 1 child failed:",
        "  /f/a: 2 lines, 5 words (agent a1)",
        "  /f/b: done, but its answer is not a count: 'could not count: no such file' "
        "(agent a2)",
        "  /f/c: failed: ModelError: gave up (agent a3)",
    ]
    assert (tally.files, tally.counted, tally.uncounted, tally.unfinished) == (
        3, 1, 1, {"failed": 1})


def test_demo_refuses_a_deployment(redis_server: str, redis: redis_lib.Redis,
                                   tmp_path: Path) -> None:
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_REDIS_URL=redis_server, SWARM_HOME=str(tmp_path / "home"))
    result = CliRunner().invoke(main, ["demo", "-C", str(tmp_path), "--latency", "0"],
                                env=env, catch_exceptions=False)
    assert result.exit_code == 1
    assert f"SWARM_REDIS_URL is set\n({mask_url(redis_server)})" in result.stderr
    assert "redis://:***@" in result.stderr  # the server's password is never shown
    assert "env -u SWARM_REDIS_URL swarm demo" in result.stderr
    assert "This is a demo" not in result.stderr  # no banner about a server it does not use
    assert redis.dbsize() == 0  # nothing was sent to the deployment


def run_demo(home: Path, folder: Path, decoy: ScriptedModelServer,
             **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    # The user has a real model configured: the demo's children must not use it.
    env.update(SWARM_HOME=str(home), SWARM_BASE_URL=decoy.base_url, SWARM_MODEL="real-model",
               SWARM_API_KEY="sk-real-key", **extra)
    return subprocess.run([sys.executable, "-m", "swarm", "demo", "-C", str(folder),
                           "--latency", "0"], env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    folder = tmp_path / "files"
    folder.mkdir()
    for name, text in FILES.items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.slow
def test_demo_counts_on_a_local_swarm_with_its_own_model(
        model_server: ScriptedModelServer, folder: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    done = run_demo(home, folder, model_server)
    assert done.returncode == 0, done.stderr
    head, *rows = done.stdout.strip().splitlines()
    assert head == "3 files, 6 lines, 11 words in all:"
    # Named as in the folder: each child counts its own copy of its file.
    counts = ["a.txt: 2 lines, 3 words", "b.txt: 1 line, 1 word", "c.txt: 3 lines, 7 words"]
    for row, count in zip(rows, counts, strict=True):
        assert re.fullmatch(rf"  {re.escape(count)} \(agent a[0-9a-f]{{15}}\)", row), row
    assert "SCRIPTED" in done.stderr and f"SWARM_HOME ({home})" in done.stderr
    assert "1 worker process" in done.stderr
    # Neither the root nor the children went to the model configured in the environment.
    assert model_server.requests == [] and model_server.review_requests == []
    assert model_server.models_requests == 0


@pytest.mark.slow
def test_demo_exits_non_zero_when_a_child_does_not_finish(
        model_server: ScriptedModelServer, folder: Path, tmp_path: Path) -> None:
    done = run_demo(tmp_path / "home", folder, model_server, SWARM_MAX_CHILDREN="2")
    assert done.returncode == 1, done.stderr
    head, *rows = done.stdout.strip().splitlines()
    assert re.fullmatch(r"3 files, 2 counted: \d+ lines, \d+ words; 1 child refused:", head)
    refused = [r for r in rows if ": refused: " in r]
    assert len(refused) == 1 and "children limit reached" in refused[0]
    assert "1 child of 3 did not finish (1 refused); `swarm status` shows why" in done.stderr
