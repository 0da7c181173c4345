"""The sandbox on workers, end to end: real worker processes started as ``swarm run`` starts
them, the scripted model over HTTP. A default worker runs children's commands in the box,
where the model key is nowhere to be found; a worker that cannot sandbox says so at start,
in ``swarm status`` and in its Celery stats (Flower's worker page), and refuses children
unless ``SWARM_SANDBOX=none`` is set."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import CliRunner, Result

from swarm.agent import sandbox
from swarm.broker.app import configure
from swarm.cli import main
from swarm.runtime.local import LocalCluster, wait_for
from swarm.runtime.malloc import WORKER_MALLOC, glibc
from swarm.store.connection import connect
from swarm.store.server import EmbeddedServer
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until

pytestmark = pytest.mark.slow
SECRET = "sk-sandbox-workers-4b1d9e"
#: Makes the cluster's PATH find a bubblewrap that fails as in a container without user
#: namespaces.
NO_USERNS = {"FAILING_BWRAP": "1"}


#: An operator's key file, only root may read it (as /etc/swarm/worker.env would be).
#: In /etc, which the box shows (read-only): the file is there, and refused.
KEY_FILE = Path(f"/etc/swarm-sandbox-workers-{os.getpid()}/worker.env")


def hunt(home: Path) -> str:
    """A child's command looking for the key everywhere it might be."""
    return ("id -u; env; grep -a -l -r sk-sandbox /proc/*/environ 2>/dev/null; "
            f"grep -r -l sk-sandbox {home} 2>/dev/null; cat {KEY_FILE} 2>&1; echo hunted")


@pytest.fixture(autouse=True)
def key_file() -> Iterator[Path]:
    KEY_FILE.parent.mkdir(mode=0o755)
    KEY_FILE.write_text(f"SWARM_API_KEY={SECRET}\n")
    KEY_FILE.chmod(0o600)
    try:
        yield KEY_FILE
    finally:
        shutil.rmtree(KEY_FILE.parent, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest
            ) -> Iterator[tuple[str, Path, LocalCluster]]:
    """A coordinator and a worker as `swarm run` starts them, the key in their
    environment; ``request.param`` is set in it on top (default: nothing)."""
    home = tmp_path / "home"
    env = {"SWARM_API_KEY": SECRET, **getattr(request, "param", {})}
    if env.pop("FAILING_BWRAP", ""):
        # Where a root worker's box user (65534) may run it, as it runs the real one.
        fake = KEY_FILE.parent / "bin" / "bwrap"
        fake.parent.mkdir(mode=0o755)
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, "
                        "likely because the kernel does not allow non-privileged user "
                        "namespaces.' >&2\nexit 1\n")
        fake.chmod(0o755)
        env["PATH"] = f"{fake.parent}:{os.environ['PATH']}"
    server = EmbeddedServer(home)
    url = server.ensure()
    try:
        local = LocalCluster(url, home, workers=1, concurrency=4, env=env).start()
        try:
            wait_for(connect(url), 30, local.procs)
            yield url, home, local
        finally:
            local.stop()
    finally:
        server.stop()


def swarm_run(url: str, home: Path, model: ScriptedModelServer, workspace: Path,
              *args: str) -> Result:
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
               SWARM_API_KEY=SECRET, SWARM_RETRIES="1")
    return CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C", str(workspace),
                                     *args], env=env, catch_exceptions=False)


def hunting_model(home: Path) -> ScriptedModelServer:
    def answer(request: dict[str, Any]) -> Reply:
        return Reply(content=json.dumps([json.loads(r) for r in tool_results(request)]))

    return ScriptedModelServer(responder=ByTask({
        "ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "HUNT for the key"})]),
                 answer],
        "HUNT": [Reply(tool_calls=[ToolCall("run_cli", {"command": hunt(home)})]),
                 lambda r: Reply(content=tool_results(r)[0])],
    }))


def hunt_as_child(url: str, home: Path, tmp_path: Path) -> dict[str, Any]:
    """A root whose one child hunts for the model key; the child's result."""
    work = tmp_path / "work"
    work.mkdir()
    with hunting_model(home) as model:
        result = swarm_run(url, home, model, work, "ROOT")
    assert result.exit_code == 0, result.output
    (child,) = json.loads(result.stdout)
    return cast("dict[str, Any]", child)


@pytest.mark.skipif(not sandbox.probe().ok, reason="no sandbox here")
def test_a_default_workers_child_cannot_find_the_model_key(
        cluster: tuple[str, Path, LocalCluster], tmp_path: Path) -> None:
    url, home, local = cluster
    child = hunt_as_child(url, home, tmp_path)
    assert child["state"] == "done", child
    output = child["answer"]
    assert output.startswith("65534\n") and "hunted" in output, output  # ran in the box
    assert SECRET not in output
    assert f"cat: {KEY_FILE}: Permission denied" in output, output
    # The local worker and coordinator took the key by a pipe: not in their /proc either.
    for proc in local.procs:
        assert SECRET.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
    stats = configure(url).control.inspect(timeout=5).stats() or {}
    assert [s["swarm_sandbox"] for s in stats.values()] == [
        "bwrap (uid 65534, no capabilities, seccomp, network: user-mode, host and Redis "
        "unreachable, cgroup: 2048 MiB, 1024 pids, cpu weight 100)"]


@pytest.mark.parametrize("cluster", [NO_USERNS], indirect=True)
def test_a_worker_that_cannot_sandbox_says_so_and_refuses_children(
        cluster: tuple[str, Path, LocalCluster], tmp_path: Path) -> None:
    url, home, _ = cluster
    child = hunt_as_child(url, home, tmp_path)
    assert child["state"] == "failed"
    assert "cannot sandbox commands" in child["error"]
    assert "No permissions to creating new namespace" in child["error"]
    assert "SWARM_SANDBOX=none" in child["error"]
    log = wait_until(lambda: "children refused" in (t := (home / "logs" / "worker-0.log")
                                                      .read_text()) and t, "the worker's line")
    assert "sandbox: unavailable, children refused" in log
    status = CliRunner().invoke(main, ["status"], env={"SWARM_REDIS_URL": url,
                                                       "SWARM_HOME": str(home)})
    assert "unavailable, children refused" in status.output, status.output
    stats = configure(url).control.inspect(timeout=5).stats() or {}
    assert all("children refused" in s["swarm_sandbox"] for s in stats.values()), stats
    assert stats


@pytest.mark.parametrize("cluster", [{**NO_USERNS, "SWARM_SANDBOX": "none"}], indirect=True)
def test_sandbox_none_runs_children_unconfined_on_such_a_worker(
        cluster: tuple[str, Path, LocalCluster], tmp_path: Path) -> None:
    url, home, local = cluster
    child = hunt_as_child(url, home, tmp_path)
    assert child["state"] == "done", child
    assert child["answer"].startswith(f"{os.getuid()}\n")
    # The worker runs with its allocator's settings; its commands do not inherit them.
    assert "GLIBC_TUNABLES" not in child["answer"], child["answer"]
    if glibc():
        (worker,) = [p for p in local.procs if "worker" in p.args]
        assert f"GLIBC_TUNABLES={WORKER_MALLOC}".split(":")[0].encode() in Path(
            f"/proc/{worker.pid}/environ").read_bytes().split(b"\0")
    status = CliRunner().invoke(main, ["status"], env={"SWARM_REDIS_URL": url,
                                                       "SWARM_HOME": str(home)})
    assert "none (commands run unconfined)" in status.output, status.output
