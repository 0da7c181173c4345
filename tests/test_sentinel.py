"""Redis Sentinel for every component: a primary, a replica and three sentinels on
127.0.0.1 (:mod:`tests.sentinels`, the real valkey-server). The store follows a failover;
a swarm run whose primary is SIGKILLed mid-run completes (Celery's broker and results go
through the sentinels too); and a settlement the primary acknowledged but never
replicated, lost at the failover, is redone by a new attempt and never counted twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py
from click.testing import CliRunner

from swarm.cli import main
from swarm.config import Settings
from swarm.errors import ConfigError
from swarm.runtime.local import wait_for
from swarm.store import keys
from swarm.store.connection import connect, mask_url
from swarm.store.ledger import Ledger
from swarm.store.sentinel import Sentinels
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import child_run, spawn_children, wait_until
from tests.sentinels import MASTER, SentinelGroup


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    with SentinelGroup(tmp_path / "sentinels") as started:
        yield started


def retried(fn: Any, what: str, timeout: float = 30.0) -> Any:
    """``fn()`` once Redis answers it (a failover makes calls fail for a few seconds)."""
    def attempt() -> Any:
        try:
            return (fn(),)
        except (redis_py.ConnectionError, redis_py.TimeoutError, redis_py.ReadOnlyError):
            return None
    return wait_until(attempt, what, timeout=timeout, every=0.05)[0]


# -- settings -------------------------------------------------------------------------------


def test_a_sentinel_url_is_read_as_kombu_writes_it() -> None:
    url = "sentinel://:s3cret@h1:26380/2;sentinel://h2;sentinel://user:pw@h3:1"
    got = Sentinels.parse(url)
    assert got.hosts == (("h1", 26380), ("h2", 26379), ("h3", 1))
    assert (got.db, got.username, got.password) == (2, None, "s3cret")  # the first entry's
    assert mask_url(url) == "sentinel://:***@h1:26380/2;sentinel://h2;sentinel://user:***@h3:1"
    for bad in ("sentinel://", "sentinel://h1;redis://h2", "sentinel://h1/x"):
        with pytest.raises(ConfigError) as caught:
            Sentinels.parse(bad)
        assert "s3cret" not in str(caught.value)
    with pytest.raises(ConfigError, match="SWARM_REDIS_MASTER"):
        Settings.from_env({"SWARM_REDIS_URL": "sentinel://h1:26379"})
    settings = Settings.from_env({"SWARM_REDIS_URL": url, "SWARM_REDIS_MASTER": "prod"})
    assert settings.redis_master == "prod"


def test_the_store_follows_a_failover(group: SentinelGroup) -> None:
    client = connect(group.url, master=MASTER)
    client.set("before", "kept")
    assert client.wait(1, 5000) == 1  # on the replica too
    group.kill_primary()
    took = group.wait_failover()
    assert retried(lambda: client.get("before"), "the new master to answer") == "kept"
    client.set("after", "written")  # a write, so it is the master, not a replica
    assert client.get("after") == "written"
    print(f"\nfailover: the replica was master {took:.1f} s after the primary was SIGKILLed")


def test_schedules_go_through_the_sentinels(group: SentinelGroup) -> None:
    """celery-redbeat's entries (``swarm schedule``) reach the master the sentinels name."""
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_REDIS_URL=group.url, SWARM_REDIS_MASTER=MASTER)
    added = CliRunner().invoke(main, ["schedule", "add", "0 3 * * *", "tidy", "--name", "tidy"],
                               env=env)
    assert added.exit_code == 0, added.output
    primary = group.client(group.primary_port)
    assert primary.zscore(f"{keys.REDBEAT_PREFIX}:schedule", f"{keys.REDBEAT_PREFIX}tidy")
    listed = CliRunner().invoke(main, ["schedule", "list"], env=env)
    assert listed.exit_code == 0 and "tidy  [0 3 * * *]" in listed.stdout, listed.output


# -- the ledger when the last acknowledged write is lost ------------------------------------

def test_a_settlement_lost_at_failover_is_redone_and_never_doubled(
        group: SentinelGroup) -> None:
    """The primary acknowledges a settlement and dies before its replica got it: the
    promoted replica holds the ledger as it was before (the run still running under the
    dead attempt's lease), so the run is taken over and settled again, once; a replay of
    the lost settlement by its old attempt is fenced."""
    client = connect(group.url, master=MASTER)
    ledger = Ledger(client)
    ledger.create_swarm("s1", "aparent", "/work/parent", "task", {}, "host-a", "aparent")
    r1 = child_run("aparent", "a1")
    spawn_children(ledger, "s1", "aparent", "a1")
    run = ledger.run(r1)
    assert run is not None
    first = ledger.start(run.id, "tok-a", 1.0, "host-a")
    assert first is not None and first.claimed
    assert client.wait(1, 5000) == 1  # the claim is on the replica
    group.link.cut()  # from here on the replica gets nothing
    assert ledger.settle(run, "s1", "done", {"answer": "first"}, {}, token="tok-a")
    assert client.wait(1, 300) == 0  # acknowledged by the primary alone
    group.kill_primary()
    group.wait_failover()
    group.link.close()  # what it held is lost with the primary
    # The ledger rolled back to before the settlement, consistently: the run runs under the
    # dead attempt's lease, and nothing announced its settlement.
    lost = retried(lambda: ledger.run(r1), "the new master")
    assert lost.state == "running" and lost.attempts == 1
    assert client.xlen(keys.settle_stream()) == 0
    # Its lease runs out (on the server's clock): the coordinator's reap sends it again.
    reaped = wait_until(lambda: ledger.reap(60.0), "the run to be reaped", timeout=15)
    assert [r.run.id for r in reaped] == [r1]
    again = ledger.start(run.id, "tok-b", 30.0, "host-b")
    assert again is not None and again.claimed
    # The lost settlement, replayed by the attempt that made it, is fenced; the new attempt
    # settles once.
    assert not ledger.settle(run, "s1", "done", {"answer": "first"}, {}, token="tok-a")
    assert ledger.settle(run, "s1", "done", {"answer": "redone"}, {}, token="tok-b")
    assert not ledger.settle(run, "s1", "done", {"answer": "twice"}, {}, token="tok-b")
    final = ledger.run(r1)
    assert final is not None and final.state == "done" and final.attempts == 2
    assert final.result["answer"] == "redone"
    announced = [fields["run"] for _, fields in client.xrange(keys.settle_stream())]
    assert announced == [r1]
    assert client.hget(keys.request("q1"), "settled") == "1"


# -- a swarm run through the failover -------------------------------------------------------


class Deployment:
    """A coordinator and a worker on the sentinels, and a root ``swarm run``."""

    def __init__(self, group: SentinelGroup, home: Path, model: ScriptedModelServer) -> None:
        self.group, self.home, self.model = group, home, model
        self.procs: list[subprocess.Popen[bytes]] = []
        (home / "logs").mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
        env.update(SWARM_REDIS_URL=self.group.url, SWARM_REDIS_MASTER=MASTER,
                   SWARM_HOME=str(self.home), SWARM_BASE_URL=self.model.base_url,
                   SWARM_RETRIES="2", SWARM_BACKOFF_MAX="0.2", SWARM_SANDBOX="none", **extra)
        return env

    def start(self, *args: str, name: str) -> subprocess.Popen[bytes]:
        log = open(self.home / "logs" / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "swarm", *args], env=self.env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def report(request: dict[str, Any]) -> Reply:
    results = [json.loads(t) for t in tool_results(request)]
    return Reply(content=" | ".join(f"{r['state']}:{r.get('answer', r.get('error', ''))}"
                                    for r in results))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_swarm_run_completes_when_its_primary_is_killed_mid_run(
        group: SentinelGroup, model_server: ScriptedModelServer, tmp_path: Path) -> None:
    journal, started = tmp_path / "journal", tmp_path / "started"
    model_server.responder = ByTask({
        "ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "SLOW child"}, id="c0")]),
                 report],
        "SLOW": [Reply(tool_calls=[ToolCall("run_cli", {
                     "command": f"touch {started}; sleep 8; echo ran >> {journal}"})]),
                 Reply(content="slow done")],
    })
    swarm = Deployment(group, tmp_path / "home", model_server)
    try:
        swarm.start("coordinator", "--name", "coord", name="coordinator")
        swarm.start("worker", "--concurrency", "4", "--hostname", "w1@test", name="worker")
        wait_for(connect(group.url, master=MASTER), 60, swarm.procs)
        workspace = tmp_path / "ws"
        workspace.mkdir()
        with (tmp_path / "root.err").open("wb") as err:
            root = subprocess.Popen(
                [sys.executable, "-m", "swarm", "run", "--yes", "--workers", "0", "-C",
                 str(workspace), "ROOT failover"], env=swarm.env(),
                stdout=subprocess.PIPE, stderr=err)
        swarm.procs.append(root)
        wait_until(started.exists, "the child's command", timeout=60)
        group.kill_primary()
        killed = time.monotonic()
        took = group.wait_failover()
        answer, _ = root.communicate(timeout=120)
        finished = time.monotonic() - killed
    finally:
        swarm.close()
    errors = (tmp_path / "root.err").read_text()
    assert root.returncode == 0, errors
    assert answer.decode().strip() == "done:slow done", errors
    assert journal.read_text().split() == ["ran"]  # the child's command ran once
    ledger = Ledger(connect(group.url, master=MASTER))
    swarm_id = ledger.latest_swarm()
    assert swarm_id is not None
    assert {a.state for a in ledger.agents(swarm_id)} == {"done"}
    print(f"\nprimary SIGKILLed mid-run: replica promoted after {took:.1f} s, the root "
          f"answered {finished:.1f} s after the kill")
