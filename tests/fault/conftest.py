"""Shared pieces of the fault tests: one real swarm per module (embedded Valkey, a coordinator
and a worker process), the scripted model over HTTP, and `swarm run` driven through click."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from swarm.cli import main
from swarm.runtime.local import LocalCluster, wait_for
from swarm.store.connection import connect
from swarm.store.server import EmbeddedServer
from swarm.testing.scripts import task_of, tool_results
from swarm.testing.server import Item, Reply, ScriptedModelServer, ToolCall

#: A planted API key: the root and the workers have it; it must never show up anywhere.
SECRET = "sk-planted-fault-9c41e7d2b8"
#: A harmless variable planted next to it in the workers: it must show up where the key not.
MARKER_NAME, MARKER_VALUE = "FAULT_MARKER_VISIBLE", "planted-marker-55"

#: The workers' environment on top of os.environ.
WORKER_ENV = {
    "SWARM_API_KEY": SECRET,
    MARKER_NAME: MARKER_VALUE,
    "SWARM_SANDBOX_ENV": MARKER_NAME,  # sandboxed commands get it, as an operator would allow
    "SWARM_RETRIES": "2",  # one quick retry after a bad answer of the model
    "SWARM_BACKOFF_MAX": "0.05",
}


@dataclass
class Swarm:
    url: str
    home: Path
    cluster: LocalCluster


def start_cluster(url: str, home: Path, env: Mapping[str, str] = WORKER_ENV) -> LocalCluster:
    """A coordinator and one worker process on ``url``, started with ``env`` planted."""
    cluster = LocalCluster(url, home, workers=1, concurrency=16, env=dict(env)).start()
    try:
        wait_for(connect(url), 30, cluster.procs)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    home = tmp_path_factory.mktemp("fault-home")
    server = EmbeddedServer(home)
    url = server.ensure()
    try:
        cluster = start_cluster(url, home)
        try:
            yield Swarm(url, home, cluster)
        finally:
            cluster.stop()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def model(swarm: Swarm) -> Iterator[ScriptedModelServer]:
    # The key is required: a worker that did not send the planted key gets 401s.
    with ScriptedModelServer(require_key=SECRET) as server:
        yield server


def clean_env(**env: str) -> dict[str, str]:
    """Blank every SWARM_/OPENAI_/EVA_ variable of this process, then set ``env``."""
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(env)
    return base


def swarm_run(swarm: Swarm, model: ScriptedModelServer, workspace: Path, task: str,
              *flags: str, **env: str) -> Result:
    """``swarm [flags] run --yes --workers 0 -C workspace task`` on the module's swarm."""
    base = clean_env(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=swarm.url,
                     SWARM_HOME=str(swarm.home), SWARM_API_KEY=SECRET, SWARM_RETRIES="2",
                     SWARM_BACKOFF_MAX="0.05", **env)
    return CliRunner().invoke(main, [*flags, "run", "--yes", "--workers", "0", "-C",
                                     str(workspace), task], env=base, catch_exceptions=False)


class Once:
    """A ByTask step: ``first`` (a fault, say) the first time it is asked, then ``then``."""

    def __init__(self, first: Item, then: Reply | Callable[[dict[str, Any]], Reply]) -> None:
        self.first, self.then = first, then
        self.lock = threading.Lock()
        self.calls = 0

    def __call__(self, request: dict[str, Any]) -> Any:
        with self.lock:
            self.calls += 1
            if self.calls == 1:
                return self.first
        return self.then(request) if callable(self.then) else self.then


def parsed(text: str) -> Any:
    """A tool result as JSON when it is (an agent result), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def answer_with_results(request: dict[str, Any]) -> Reply:
    """A parent's last step: answer with the list of its tool results (parsed), as JSON."""
    return Reply(content=json.dumps([parsed(t) for t in tool_results(request)]))


def echo_result(request: dict[str, Any]) -> Reply:
    """A child's last step: answer with the tool result it was given."""
    return Reply(content="got: " + " || ".join(tool_results(request)))


def requests_of(model: ScriptedModelServer, key: str) -> list[dict[str, Any]]:
    """The chat requests of the conversations whose task contains ``key``, oldest first."""
    return [r for r in model.requests if key in task_of(r)]


def agent_call(message: str, call_id: str, **extra: Any) -> ToolCall:
    return ToolCall("agent", {"message": message, **extra}, id=call_id)
