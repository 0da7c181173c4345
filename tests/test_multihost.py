"""Workspaces across machines: workers on "hosts" with their own disks.

Each host is a real ``swarm worker`` started inside ``unshare --mount --uts``: its own
hostname, a private folder bound over ``SWARM_HOME`` and an empty tmpfs over the
laptop's folder (the root's repository and home), so it cannot see the parent's disk.
They share the network (Redis, the scripted model on 127.0.0.1), as machines would.
Skipped, with the reason, where mount namespaces are not allowed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result

from bench.hosts import HostSpec, host_argv, namespaces_reason
from swarm.broker.app import configure, host_queue
from swarm.cli import main
from swarm.runtime.local import alive
from swarm.store import keys
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.server import EmbeddedServer
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until

GIT = "git -c user.name=r -c user.email=r@r"


REASON = namespaces_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(REASON), reason=REASON)]


class Hosts:
    """Worker hosts on one Redis: ``start(name)``, ``stop(name)`` (SIGTERM, graceful)."""

    def __init__(self, base: Path, url: str, model: ScriptedModelServer) -> None:
        self.base, self.url, self.model = base, url, model
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.suffix = f"{os.getpid()}"
        self.home = base / "home"  # every host's SWARM_HOME, each on its own disk
        self.home.mkdir()
        self.env: dict[str, str] = {}
        """Settings of the workers started from now on."""

    def name(self, short: str) -> str:
        return f"{short}-ws{self.suffix}"

    def start(self, short: str) -> str:
        name = self.name(short)
        disk = self.base / f"disk-{short}"
        disk.mkdir(exist_ok=True)
        spec = HostSpec(name, disk=disk, home=self.home, hide=(self.base / "laptop",))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
        env.update(SWARM_REDIS_URL=self.url, SWARM_HOME=str(self.home),
                   SWARM_BASE_URL=self.model.base_url, SWARM_API_KEY="k", SWARM_RETRIES="3",
                   **self.env)
        log = open(self.base / f"{short}.log", "ab")  # noqa: SIM115
        self.procs[short] = subprocess.Popen(
            host_argv(spec, [sys.executable, "-m", "swarm", "worker", "--concurrency", "3",
                             "--hostname", f"w@{name}"]),
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        log.close()
        client = connect(self.url)
        deadline = time.monotonic() + 60
        while f"w@{name}" not in alive(client, "worker"):
            assert self.procs[short].poll() is None, (self.base / f"{short}.log").read_text()
            assert time.monotonic() < deadline, "worker host did not start"
            time.sleep(0.1)
        return name

    def stop(self, short: str) -> None:
        proc = self.procs.pop(short)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def close(self) -> None:
        for short in list(self.procs):
            self.stop(short)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Hosts, str, Path]]:
    """A Redis, a coordinator, the scripted model, and the laptop's folder (empty)."""
    server = EmbeddedServer(tmp_path / "redis-home")
    url = server.ensure()
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env.update(SWARM_REDIS_URL=url, SWARM_HOME=str(tmp_path / "coordinator-home"))
    log = open(tmp_path / "coordinator.log", "ab")  # noqa: SIM115
    coordinator = subprocess.Popen([sys.executable, "-m", "swarm", "coordinator", "--name",
                                    f"mh-{os.getpid()}"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    with ScriptedModelServer() as model:
        hosts = Hosts(tmp_path, url, model)
        try:
            yield hosts, url, laptop
        finally:
            hosts.close()
            os.killpg(coordinator.pid, signal.SIGTERM)
            coordinator.wait(timeout=30)
            server.stop()


def swarm_run(hosts: Hosts, workspace: Path, task: str) -> Result:
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(SWARM_BASE_URL=hosts.model.base_url, SWARM_REDIS_URL=hosts.url,
                SWARM_HOME=str(workspace.parent / "root-home"), SWARM_API_KEY="k",
                SWARM_RETRIES="1")
    return CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C", str(workspace),
                                     task], env=base, catch_exceptions=False)


def git_repo(path: Path) -> Path:
    path.mkdir()
    subprocess.run(f"git init -q && echo base > README && git add -A && {GIT} commit -qm base",
                   shell=True, cwd=path, check=True)
    return path


def cli(command: str, call_id: str = "sh") -> Reply:
    return Reply(tool_calls=[ToolCall("run_cli", {"command": command}, id=call_id)])


def last_result(request: dict[str, Any]) -> Reply:
    return Reply(content=tool_results(request)[-1])


def test_six_children_on_two_hosts_each_land_their_work_in_the_roots_folder(
        world: tuple[Hosts, str, Path]) -> None:
    hosts, url, laptop = world
    names = {hosts.start("hosta"), hosts.start("hostb")}
    repo = git_repo(laptop / "repo")
    (repo / "seed.txt").write_text("SEED-42\n")  # untracked: the children see it anyway
    seen: list[list[dict[str, Any]]] = []

    def look(request: dict[str, Any]) -> Reply:
        seen.append([json.loads(t) for t in tool_results(request)])
        return cli("cat out-*.txt && git status --porcelain")

    hosts.model.responder = ByTask({
        "MH-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": f"MH-CHILD-{i} copy"},
                                               id=f"c{i}") for i in range(6)]),
                    look, last_result],
        **{f"MH-CHILD-{i}": [cli(f"cat seed.txt > out-{i}.txt && sleep 1 && hostname"),
                             last_result] for i in range(6)},
    })
    result = swarm_run(hosts, repo, "MH-ROOT fan out")
    assert result.exit_code == 0, result.stderr
    (results,) = seen
    assert [r["state"] for r in results] == ["done"] * 6, results
    assert {r["answer"].split()[0] for r in results} == names  # both hosts worked
    assert all(r["landing"] == "landed" and r["kept"].endswith(f"/{r['agent_id']}")
               and "git_branch" not in r for r in results), results
    # All landed in the root's folder before it went on, uncommitted.
    assert result.stdout.strip().splitlines()[:13] == \
        ["SEED-42"] * 6 + [f"?? out-{i}.txt" for i in range(6)] + ["?? seed.txt"], \
        result.stdout
    for i in range(6):
        assert (repo / f"out-{i}.txt").read_text() == "SEED-42\n"
    branches = subprocess.run(["git", "branch", "--list"], cwd=repo, capture_output=True,
                              text=True, check=True).stdout
    assert "swarm/" not in branches and not (repo / ".git" / "worktrees").exists()
    # Each host fetched the root's snapshot once.
    client = connect(url)
    snapshots = [k for k in client.scan_iter(keys.snapshot("*")) if k.endswith(":hosts")]
    fetches = [client.hgetall(k) for k in snapshots]
    root_snapshot = next(f for f in fetches if len(f) == 3)
    assert {h for h, n in root_snapshot.items() if int(n) > 0} == names


#: What the parent P leaves uncommitted before it parks: staged, unstaged, both, untracked.
WORK_IN_PROGRESS = ("echo parent-file > p.txt && echo staged > s.txt && git add s.txt && "
                    "echo more >> README && echo part > t.txt && git add t.txt && "
                    "echo later >> t.txt")


def _chain(hosts: Hosts, laptop: Path, lose: bool) -> tuple[Result, redis_lib.Redis, str]:
    """Root -> parent P -> child C, then grandchild G. P leaves work in progress and C's
    work lands in it on host A; then it parks for G on A; A is stopped (SIGTERM) while G
    runs there; P resumes on host B, where G's work lands in it. With ``lose``, P's
    snapshot is deleted first."""
    first = hosts.start("hosta")
    repo = git_repo(laptop / "repo")
    g_asked, g_go = threading.Event(), threading.Event()

    def grandchild(request: dict[str, Any]) -> Reply:
        g_asked.set()
        g_go.wait(60)
        return cli("echo from-g > g.txt")

    def landed(request: dict[str, Any]) -> str:
        return str(json.loads(tool_results(request)[0]).get("landing", "none"))

    def then_g(request: dict[str, Any]) -> Reply:
        assert landed(request) == "landed"  # C's
        return Reply(tool_calls=[ToolCall("agent", {"message": "MH-G go"}, id="g")])

    hosts.model.responder = ByTask({
        "MH-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "MH-P work"}, id="p")]),
                    lambda r: Reply(content=tool_results(r)[0])],
        "MH-P": [cli(WORK_IN_PROGRESS),
                 Reply(tool_calls=[ToolCall("agent", {"message": "MH-C first"}, id="c")]),
                 then_g,
                 lambda r: cli(f"echo {landed(r)} && cat p.txt c.txt g.txt && "
                               "git status --porcelain && hostname"),
                 last_result],
        "MH-C": [cli("echo from-c > c.txt"), Reply(content="c done")],
        "MH-G": [grandchild, Reply(content="g done")],
    })
    out: list[Result] = []
    runner = threading.Thread(target=lambda: out.append(swarm_run(hosts, repo, "MH-ROOT go")))
    runner.start()
    assert g_asked.wait(60), "the grandchild never started"
    client = connect(hosts.url)
    ledger = Ledger(client)
    swarm_id = ledger.latest_swarm() or ""
    parent = next(a for a in ledger.agents(swarm_id) if a.depth == 1)
    assert parent.state == "parked" and parent.ws_host == first and parent.ws_state
    if lose:
        for key in list(client.scan_iter(keys.snapshot(parent.ws_state) + "*")):
            client.delete(key)
    # Scaling A down: it stops taking tasks first (so P's resume, queued when G settles,
    # waits for another host), then exits gracefully once G is done.
    app = configure(hosts.url)
    replies = app.control.cancel_consumer("swarm", destination=[f"w@{first}"], reply=True,
                                          timeout=10)
    assert replies, "host A did not stop taking tasks"
    stopping = threading.Thread(target=hosts.stop, args=("hosta",))
    stopping.start()  # graceful: A finishes G, then exits
    log = hosts.base / "hosta.log"
    wait_until(lambda: "Warm shutdown" in log.read_text(errors="replace"),
               "host A's warm shutdown")
    g_go.set()  # A takes no new task now; G's answer may go out, and P's resume after it
    stopping.join(90)
    assert not stopping.is_alive()
    hosts.start("hostb")
    runner.join(120)
    assert not runner.is_alive() and out
    return out[0], client, parent.id


def test_a_parked_parent_whose_host_is_shut_down_resumes_on_another_host_with_its_files(
        world: tuple[Hosts, str, Path]) -> None:
    hosts, _, laptop = world
    result, client, parent_id = _chain(hosts, laptop, lose=False)
    assert result.exit_code == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["state"] == "done", body
    lines = body["answer"].splitlines()
    # G's work landed in it on host B, over its files as it left them on host A (C's
    # landing included), all uncommitted over its seed (its index does not travel).
    assert lines[:11] == ["landed", "parent-file", "from-c", "from-g", " M README",
                          "?? c.txt", "?? g.txt", "?? p.txt", "?? s.txt", "?? t.txt",
                          hosts.name("hostb")], lines
    record = Ledger(client).agent(parent_id)
    assert record is not None and record.ws_host == hosts.name("hostb")
    # P's work (its own files and both children's) landed in the user's folder.
    assert body["landing"] == "landed", body
    repo = laptop / "repo"
    assert {n: (repo / n).read_text() for n in ("p.txt", "c.txt", "g.txt", "s.txt", "t.txt")} \
        == {"p.txt": "parent-file\n", "c.txt": "from-c\n", "g.txt": "from-g\n",
            "s.txt": "staged\n", "t.txt": "part\nlater\n"}
    assert (repo / "README").read_text() == "base\nmore\n"


def test_a_parked_parent_whose_workspace_cannot_be_restored_fails_loudly(
        world: tuple[Hosts, str, Path]) -> None:
    hosts, _, laptop = world
    result, client, parent_id = _chain(hosts, laptop, lose=True)
    assert result.exit_code == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["state"] == "failed"
    assert body["error"].startswith("workspace lost:"), body
    record = Ledger(client).agent(parent_id)
    assert record is not None and record.state == "failed"



def test_a_child_whose_worker_was_killed_is_carried_on_by_its_own_host_not_failed(
        world: tuple[Hosts, str, Path]) -> None:
    """A worker process SIGKILLed mid-child on host A, another host B alive: B must not
    take the child over into an empty folder (it failed with 'workspace lost', found by the
    chaos campaign). The run is sent to A's own queue (before, any worker took it and B
    handed it back, over and over: 2,170 hand-backs in a long campaign), and A's restarted
    worker carries it on there, with its files."""
    hosts, url, laptop = world
    repo = git_repo(laptop / "repo")
    started = hosts.base / "started"  # outside the laptop folder: every host sees it
    hosts.model.responder = ByTask({
        "MH-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "MH-K work",
                                                         "seed": False}, id="k")]),
                    last_result],
        "MH-K": [cli(f"echo mine > mine.txt && echo $$ > {started} && exec sleep 60"),
                 cli("cat mine.txt && hostname"), last_result],
    })
    hosts.env = {"SWARM_LEASE": "2", "SWARM_SANDBOX": "none"}
    first = hosts.start("hosta")
    out: list[Result] = []
    runner = threading.Thread(target=lambda: out.append(swarm_run(hosts, repo, "MH-ROOT go")))
    runner.start()
    wait_until(lambda: started.exists() and started.read_text().strip(),
               "the child's command to start", timeout=60)
    second = hosts.start("hostb")
    os.kill(hosts.procs["hosta"].pid, signal.SIGKILL)  # the worker process only
    hosts.procs.pop("hosta").wait(timeout=10)
    client = connect(url)
    ledger = Ledger(client)
    child = next(a for a in ledger.agents(ledger.latest_swarm() or "") if a.kind == "child")
    # Its lease ran out while A is down: it waits in A's queue, not B's.
    wait_until(lambda: client.llen(host_queue(first)), "the run to be sent to host A's queue")
    hosts.start("hosta")
    runner.join(120)
    assert not runner.is_alive() and out
    body = json.loads(out[0].stdout)
    assert body["state"] == "done", body
    assert body["answer"].split()[:2] == ["mine", first], body
    run = ledger.run(child.run)
    assert run is not None and run.state == "done"
    assert run.attempts == 2  # A's first worker, then its restarted one: B never claimed it
    assert "handed back" not in (hosts.base / "hostb.log").read_text(errors="replace")
    assert second != first
