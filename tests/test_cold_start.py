"""`swarm run` imports what it needs and no more: nothing of Celery (or kombu, FastAPI) in
its own process, neither before its first model request nor while its children work (the
local coordinator and worker import Celery in theirs). Checked with ``python -X importtime``,
whose lines reach stderr as each import finishes: the scripted model reads them when the
first request arrives, so the snapshot holds exactly what was imported before it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarm.testing.server import Item, ScriptedModelServer, default_responder

pytestmark = pytest.mark.slow

#: Top-level packages the process of `swarm run` must never import.
FORBIDDEN = ("celery", "kombu", "billiard", "amqp", "vine", "fastapi", "starlette", "uvicorn")


def imported(text: str) -> set[str]:
    """Module names in ``-X importtime`` output (``import time: self | cumulative | name``)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names


def forbidden(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in FORBIDDEN}


def test_swarm_run_imports_no_celery_before_its_first_model_request_nor_after(
        model_server: ScriptedModelServer, tmp_path: Path) -> None:
    home, work, err_path = tmp_path / "home", tmp_path / "work", tmp_path / "stderr"
    work.mkdir()
    at_first_request: list[str] = []

    def respond(request: dict[str, Any]) -> Item:
        if not at_first_request:  # the root's first request: the CLI waits for this answer
            at_first_request.append(err_path.read_text())
        return default_responder(request)

    model_server.responder = respond
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model_server.base_url, SWARM_HOME=str(home), SWARM_RETRIES="1")
    with open(err_path, "w") as err:
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "swarm", "run", "--yes", "--new",
             "fan out 1: `echo hi`"], env=env, cwd=work, stdout=subprocess.PIPE, stderr=err,
            stdin=subprocess.DEVNULL, text=True, timeout=90)
    stderr = err_path.read_text()
    assert done.returncode == 0, stderr[-3000:]
    assert done.stdout.startswith("1 child: 1 done."), done.stdout  # it fanned out
    before, whole = imported(at_first_request[0]), imported(stderr)
    # The snapshot holds what the CLI imported up to its request (modules imported by
    # importlib.import_module, as the subcommands are, are not listed; theirs are).
    assert {"click", "swarm.cli.render", "swarm.llm.client", "httpx", "redis"} <= before
    assert not forbidden(before), sorted(forbidden(before))
    assert not forbidden(whole), sorted(forbidden(whole))
