"""`swarm run` on a machine without bubblewrap, end to end: real `swarm` processes, the
embedded server, real local workers, the scripted model over HTTP. A root that runs its
own commands unconfined (no SWARM_SANDBOX given) has its local workers run its children
unconfined too, saying so once; a root that asked for a sandbox, a job, and workers on a
deployment keep refusing children there."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.broker.app import configure
from swarm.runtime.jobs import job_state, submit_job
from swarm.runtime.local import LocalCluster, wait_for
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.server import EmbeddedServer
from swarm.testing.server import ScriptedModelServer
from tests.helpers import wait_until

pytestmark = pytest.mark.slow
NOTICE = "no sandbox on this machine, so the root and its local children run commands unconfined"


@pytest.fixture(scope="module")
def no_bwrap(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PATH with every program of this one but bubblewrap, as on a fresh machine."""
    folder = tmp_path_factory.mktemp("bin")
    for entry in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(entry):
            continue
        for program in Path(entry).iterdir():
            link = folder / program.name
            if program.name != "bwrap" and not os.path.lexists(link) \
                    and os.access(program, os.X_OK):
                link.symlink_to(program)
    return str(folder)


def swarm(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)


def env_for(model: ScriptedModelServer, home: Path, path: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model.base_url, SWARM_HOME=str(home), SWARM_RETRIES="1",
               PATH=path, **extra)
    return env


def test_a_run_fans_out_unconfined_on_a_machine_without_bubblewrap_saying_so_once(
        model_server: ScriptedModelServer, no_bwrap: str, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    done = swarm("run", "--yes", "fan out 2: `id -u`", cwd=work,
                 env=env_for(model_server, home, no_bwrap))
    assert done.returncode == 0, done.stderr
    head, *rows = done.stdout.strip().splitlines()
    assert head == "2 children: 2 done.", done.stdout
    # Unconfined, as the root's own commands: as this user, not the box's 65534.
    assert all(row.endswith(f" done: Done. Output: {os.getuid()} [exit code: 0]")
               for row in rows), rows
    assert done.stderr.count(NOTICE) == 1, done.stderr
    assert "bubblewrap is not installed" in done.stderr.split(NOTICE)[1].splitlines()[0]
    assert "cannot sandbox" not in done.stderr
    wait_until(lambda: not EmbeddedServer(home).status().running, "the server to stop")


def test_a_run_that_asks_for_a_sandbox_keeps_its_children_refused_there(
        model_server: ScriptedModelServer, no_bwrap: str, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    done = swarm("run", "--yes", "fan out 2: `id -u`", cwd=work,
                 env=env_for(model_server, home, no_bwrap, SWARM_SANDBOX="auto"))
    assert done.returncode == 0, done.stderr
    head, *rows = done.stdout.strip().splitlines()
    assert head == "2 children: 2 failed.", done.stdout
    assert all("cannot sandbox commands: bubblewrap is not installed" in row for row in rows)
    assert "commands run unconfined: bubblewrap is not installed" in done.stderr  # the root's
    assert NOTICE not in done.stderr
    wait_until(lambda: not EmbeddedServer(home).status().running, "the server to stop")


def test_local_workers_on_a_deployment_keep_refusing_children_without_bubblewrap(
        model_server: ScriptedModelServer, no_bwrap: str, redis_server: str, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    connect(redis_server).flushdb()
    env = env_for(model_server, tmp_path / "home", no_bwrap, SWARM_REDIS_URL=redis_server)
    done = swarm("run", "--yes", "--workers", "1", "fan out 2: `id -u`", cwd=work, env=env)
    assert done.returncode == 0, done.stderr
    head, *rows = done.stdout.strip().splitlines()
    assert head == "2 children: 2 failed.", done.stdout
    assert all("cannot sandbox commands: bubblewrap is not installed" in row for row in rows)
    assert NOTICE not in done.stderr
    checked = swarm("worker", "--check-sandbox", cwd=work, env=env)
    assert checked.returncode == 1
    assert "this worker would refuse children: bubblewrap is not installed" in checked.stderr


@pytest.fixture
def fallback_cluster(no_bwrap: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A coordinator and a worker as a root in a terminal that runs its commands unconfined
    starts them on its embedded server, on a machine without bubblewrap."""
    home = tmp_path / "home"
    server = EmbeddedServer(home)
    url = server.ensure()
    try:
        cluster = LocalCluster(url, home, concurrency=4, env={"PATH": no_bwrap},
                               fallback=True).start()
        try:
            wait_for(connect(url), 30, cluster.procs)
            yield url, home
        finally:
            cluster.stop()
    finally:
        server.stop()


def test_a_roots_local_workers_run_unconfined_only_the_children_of_unconfined_roots(
        fallback_cluster: tuple[str, Path], model_server: ScriptedModelServer, no_bwrap: str,
        tmp_path: Path) -> None:
    url, home = fallback_cluster
    work = tmp_path / "work"
    work.mkdir()

    def fan_out(**extra: str) -> str:
        env = env_for(model_server, home, no_bwrap, **extra)
        done = swarm("run", "--yes", "--new", "--workers", "0", "fan out 1: `id -u`",
                     cwd=work, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert fan_out().startswith("1 child: 1 done.")
    # Another root on the same server that asked for a sandbox gets none there.
    refused = fan_out(SWARM_SANDBOX="auto")
    assert refused.startswith("1 child: 1 failed.") and "cannot sandbox" in refused
    # Nor does a job (`swarm serve`, schedules): its root runs on the workers.
    ledger = Ledger(connect(url))
    settings = {"base_url": model_server.base_url, "model": model_server.models[0],
                "yes": True}
    swarm_id = submit_job(ledger, configure(url), "`id -u`", work, settings)
    job = wait_until(lambda: (j := job_state(ledger, swarm_id))["state"] not in (
        "queued", "running") and j, "the job to settle")
    assert job["state"] == "failed", job
    assert "cannot sandbox commands: bubblewrap is not installed" in job["error"]
