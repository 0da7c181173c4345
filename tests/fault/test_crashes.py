"""Faults injected for real: SIGKILLed workers, a coordinator dying mid-request, the server
restarting, cancel, approvals from children, wall-time and token limits, 429 storms.

Each test runs real processes (Valkey, coordinators, Celery workers) and the root through
`swarm run`; figures (recovery times) are printed, never asserted tightly.
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
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner, Result

from swarm.cli import main
from swarm.runtime.local import wait_for
from swarm.store import keys
from swarm.store.approvals import EXPIRED, ApprovalQueue, outcome
from swarm.store.connection import connect
from swarm.store.ledger import SETTLED, AgentRecord, Ledger
from swarm.store.locks import RedisLock
from swarm.store.server import EmbeddedServer
from swarm.store.sessions import RedisSessionStore
from swarm.testing.scripts import ByTask, task_of, tool_results, turn_of
from swarm.testing.server import Fault, Item, Reply, ScriptedModelServer, Slow, ToolCall
from tests.helpers import wait_until
from tests.netproxy import TcpProxy

pytestmark = pytest.mark.slow


class Swarm:
    """One embedded server with hand-started coordinators and workers, for one test."""

    def __init__(self, home: Path, model: ScriptedModelServer) -> None:
        self.home = home
        self.model = model
        self.server = EmbeddedServer(home)
        self.url = self.server.ensure()
        self.redis = connect(self.url)
        self.ledger = Ledger(self.redis)
        self.procs: list[subprocess.Popen[bytes]] = []
        (home / "logs").mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
        env.update(SWARM_REDIS_URL=self.url, SWARM_HOME=str(self.home), SWARM_RETRIES="2",
                   SWARM_BACKOFF_MAX="0.2")
        env.update(extra)
        return env

    def start(self, kind: str, name: str, **env: str) -> subprocess.Popen[bytes]:
        args = (["coordinator", "--name", name] if kind == "coordinator" else
                ["worker", "--concurrency", "8", "--hostname", f"{name}@test"])
        log = open(self.home / "logs" / f"{name}.log", "ab")  # noqa: SIM115
        # The tests watch children's commands from here (their pids, files they write in
        # the root's folder): commands run unconfined. The sandbox: tests/test_sandbox*.
        env = {"SWARM_SANDBOX": "none", **env}
        proc = subprocess.Popen([sys.executable, "-m", "swarm", *args], env=self.env(**env),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def ready(self, timeout: float = 30) -> None:
        wait_for(self.redis, timeout, [p for p in self.procs if p.poll() is None])

    def run(self, task: str, workspace: Path, **env: str) -> Result:
        base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
        base.update(self.env(SWARM_BASE_URL=self.model.base_url, **env))
        return CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C",
                                         str(workspace), task], env=base)

    def run_in_thread(self, task: str, workspace: Path, **env: str
                      ) -> tuple[threading.Thread, list[Result]]:
        out: list[Result] = []
        thread = threading.Thread(target=lambda: out.append(self.run(task, workspace, **env)))
        thread.start()
        return thread, out

    def agents(self) -> list[AgentRecord]:
        swarm_id = self.ledger.latest_swarm()
        assert swarm_id
        return self.ledger.agents(swarm_id)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        self.server.stop()


@pytest.fixture
def model() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture
def swarm(tmp_path: Path, model: ScriptedModelServer) -> Iterator[Swarm]:
    s = Swarm(tmp_path / "home", model)
    try:
        yield s
    finally:
        s.close()


def agent_calls(*messages: str) -> Reply:
    return Reply(tool_calls=[ToolCall("agent", {"message": m}, id=f"c{i}")
                             for i, m in enumerate(messages)])


def report(request: dict[str, Any]) -> Reply:
    results = [json.loads(t) for t in tool_results(request)]
    return Reply(content=" | ".join(f"{r['state']}:{r.get('answer', r.get('error', ''))}"
                                    for r in results))


def kill_group_of(pidfile: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.killpg(int(pidfile.read_text().split()[0]), signal.SIGKILL)


def test_worker_sigkilled_mid_child_is_taken_over_and_settles_once(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    model.responder = ByTask({
        "ROOT": [agent_calls("VICTIM work", "BYSTANDER work"), report],
        "VICTIM": [Reply(tool_calls=[ToolCall("run_cli", {
                       "command": f"echo $$ >> {marker}; sleep 30"})]),
                   Reply(content="victim recovered")],
        "BYSTANDER": [Reply(content="bystander fine")],
    })
    swarm.start("coordinator", "coord")
    doomed = swarm.start("worker", "doomed", SWARM_LEASE="2")
    swarm.ready()
    thread, out = swarm.run_in_thread("ROOT go", tmp_path)
    try:
        wait_until(lambda: marker.exists() and marker.read_text().strip(), "command start")
        os.kill(doomed.pid, signal.SIGKILL)  # the whole worker, threads and all
        killed = time.monotonic()
        swarm.start("worker", "rescuer", SWARM_LEASE="2")
        thread.join(timeout=60)
        assert not thread.is_alive(), "the root never got its answer"
    finally:
        kill_group_of(marker)
    recovery = time.monotonic() - killed
    (result,) = out
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "done:victim recovered | done:bystander fine"
    victim = next(a for a in swarm.agents() if "VICTIM" in a.label)
    run = swarm.ledger.run(victim.run)
    assert run is not None and run.attempts == 2 and run.state == "done"
    # Exactly one result reached the parent, and the command did not run again.
    root_last = [r for r in model.requests if task_of(r) == "ROOT go"][-1]
    assert len(tool_results(root_last)) == 2
    assert len(marker.read_text().split()) == 1
    resumed = [r for r in model.requests if task_of(r) == "VICTIM work"][-1]
    text = json.dumps(resumed["messages"])
    assert "interrupted" in text and "previous worker stopped" in text
    print(f"\nworker SIGKILL: child taken over, parent answered {recovery:.1f} s after the kill")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_sigkilled_workers_running_command_dies_with_it(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """A worker process killed outright (SIGKILL: the OOM killer, a crash) cannot stop its
    children's commands, and its lease runs out: the command it was running must not go on
    (it would write after the run was taken over, a zombie execution the chaos campaign
    found). Its shell and what it started die with it."""
    pids, late = tmp_path / "pids", tmp_path / "late"
    model.responder = ByTask({
        "ROOT": [agent_calls("VICTIM work"), report],
        "VICTIM": [Reply(tool_calls=[ToolCall("run_cli", {
                       "command": f"echo $$ >> {pids}; (sleep 60; echo late >> {late}) & "
                                  f"echo $! >> {pids}; sleep 60; echo late >> {late}"})]),
                   Reply(content="victim recovered")],
    })
    swarm.start("coordinator", "coord")
    doomed = swarm.start("worker", "doomed", SWARM_LEASE="2")
    swarm.ready()
    thread, out = swarm.run_in_thread("ROOT go", tmp_path)
    started: list[str] = []
    try:
        started = wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 2
                             and pids.read_text().split(), "the command and its subshell")
        os.kill(doomed.pid, signal.SIGKILL)  # the worker process only, not its group
        doomed.wait(timeout=10)
        wait_until(lambda: not any(alive(int(p)) for p in started),
                   "the command and its subshell to die with their worker", timeout=10)
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        swarm.start("worker", "rescuer", SWARM_LEASE="2")  # so the root gets its answer
        thread.join(timeout=60)
    assert not late.exists()
    (result,) = out
    assert result.stdout.strip() == "done:victim recovered", result.output


def test_a_worker_cut_off_from_redis_stops_its_command_before_its_lease_runs_out(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """A partition: the worker can reach the model but not Redis, so it cannot renew the
    child's lease. It kills the child's command while the lease is still its own on the
    server (before any other worker could take the run over), and another worker then
    carries the child on, without running the command again."""
    pidfile = tmp_path / "pids"
    model.responder = ByTask({
        "ROOT": [agent_calls("VICTIM work"), report],
        "VICTIM": [Reply(tool_calls=[ToolCall("run_cli", {
                       "command": f"echo $$ >> {pidfile}; exec sleep 60"})]),
                   Reply(content="victim recovered")],
    })
    swarm.start("coordinator", "coord")
    parts = urlsplit(swarm.url)  # redis://:PASSWORD@HOST:PORT/0
    host, port = str(parts.hostname), str(parts.port)
    with TcpProxy(host, int(port)) as link:
        swarm.start("worker", "cut", SWARM_LEASE="4",
                    SWARM_REDIS_URL=swarm.url.replace(f":{port}", f":{link.port}", 1))
        swarm.ready()
        thread, out = swarm.run_in_thread("ROOT go", tmp_path)
        try:
            pid = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().split(),
                                 "the command to start")[0])
            victim = next(a for a in swarm.agents() if "VICTIM" in a.label)
            link.cut()
            wait_until(lambda: not alive(pid), "the cut-off worker to kill the command",
                       timeout=10)
            killed_by = swarm.redis.time()
            lease_until = float(swarm.redis.hget(keys.run(victim.run), "lease_until") or 0)
            # killed (and seen dead) before the lease ran out on the server's clock
            assert killed_by[0] + killed_by[1] / 1e6 < lease_until
            swarm.start("worker", "rescuer", SWARM_LEASE="4")
            thread.join(timeout=60)
            assert not thread.is_alive(), "the root never got its answer"
        finally:
            kill_group_of(pidfile)
    (result,) = out
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "done:victim recovered"
    run = swarm.ledger.run(victim.run)
    assert run is not None and run.attempts == 2 and run.state == "done"
    assert len(pidfile.read_text().split()) == 1  # the command ran once, on one host


def test_coordinator_killed_mid_request_loses_nothing_and_runs_nothing_twice(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    model.responder = ByTask({
        "ROOT": [agent_calls("KID a", "KID b", "KID c"), report],
        "KID": [Reply(content="kid ok")],
    })
    doomed = swarm.start("coordinator", "doomed", SWARM_FAULT="coordinator-after-first-dispatch")
    swarm.start("worker", "w1")
    swarm.ready()
    thread, out = swarm.run_in_thread("ROOT split", tmp_path)
    assert doomed.wait(timeout=30) == 137  # died after dispatching the first call only
    died = time.monotonic()
    swarm.start("coordinator", "heir", SWARM_RECLAIM_IDLE="1")
    thread.join(timeout=60)
    assert not thread.is_alive()
    (result,) = out
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "done:kid ok | done:kid ok | done:kid ok"
    kids = [a for a in swarm.agents() if a.kind == "child"]
    assert len(kids) == 3
    runs = [swarm.ledger.run(k.run) for k in kids]
    assert all(r is not None and r.attempts == 1 for r in runs), runs
    assert len([r for r in model.requests if task_of(r).startswith("KID")]) == 3
    print(f"\ncoordinator killed: request finished {time.monotonic() - died:.1f} s after")


def test_a_parents_resume_task_lost_with_its_worker_is_sent_again(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """A worker dies holding a parked parent's resume task before it claims it (the task
    stays unacknowledged with the dead worker): the coordinator sends the resume again
    once its grace is over, and the parent carries on (before, it stayed parked forever)."""
    model.responder = ByTask({
        "ROOT": [agent_calls("PARENT part"), report],
        "PARENT": [agent_calls("KID piece"), report],
        "KID": [Reply(content="kid ok")],
    })
    swarm.start("coordinator", "coord", SWARM_TAKEOVER_GRACE="2")
    doomed = swarm.start("worker", "doomed", SWARM_FAULT="worker-before-resume-claim")
    swarm.ready()
    thread, out = swarm.run_in_thread("ROOT resume", tmp_path)
    assert doomed.wait(timeout=60) == 137  # died holding the parent's resume task
    died = time.monotonic()
    swarm.start("worker", "rescuer")
    thread.join(timeout=60)
    assert not thread.is_alive(), "the parent was never resumed"
    (result,) = out
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "done:done:kid ok"
    parent = next(a for a in swarm.agents() if "PARENT" in a.label)
    assert parent.state == "done"
    assert len([r for r in model.requests if task_of(r).startswith("KID")]) == 1
    print(f"\nresume lost: the parent resumed and answered {time.monotonic() - died:.1f} s "
          "after its worker died")


def test_embedded_server_restart_mid_swarm(swarm: Swarm, model: ScriptedModelServer,
                                           tmp_path: Path) -> None:
    started = tmp_path / "started"
    model.responder = ByTask({
        "ROOT": [agent_calls("SLOW child"), report],
        "SLOW": [Reply(tool_calls=[ToolCall("run_cli", {"command": f"touch {started}; sleep 3"})]),
                 Reply(content="slow done")],
    })
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    swarm.redis.set(keys.hints(), "a hint that must survive")
    thread, out = swarm.run_in_thread("ROOT restart", tmp_path)
    wait_until(started.exists, "the child's command")
    port = swarm.server.status().port
    swarm.server.stop()
    assert swarm.server.ensure().endswith(f"@127.0.0.1:{port}/0")  # back on the same port
    thread.join(timeout=60)
    assert not thread.is_alive()
    (result,) = out
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "done:slow done"
    assert swarm.redis.get(keys.hints()) == "a hint that must survive"
    assert {a.state for a in swarm.agents()} == {"done"}


def waiting_child(model: ScriptedModelServer, started: Path, release: Path) -> None:
    """The root calls one child whose command writes its pid to ``started`` and works until
    ``release`` exists (its first run only: a run after a lost lease does not wait)."""
    model.responder = ByTask({
        "ROOT": [agent_calls("SLOW child"), report],
        "SLOW": [Reply(tool_calls=[ToolCall("run_cli", {
                     "command": f"[ -e {started} ] || {{ echo $$ > {started}; "
                                f"while [ ! -e {release} ]; do sleep 0.05; done; }}"})]),
                 Reply(content="slow done")],
    })


def root_process(swarm: Swarm, model: ScriptedModelServer, workspace: Path, stderr: Path,
                 task: str, **env: str) -> subprocess.Popen[bytes]:
    """The real ``swarm run`` of ``task`` in ``workspace`` (made), its stderr in a file."""
    workspace.mkdir(exist_ok=True)
    with stderr.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "swarm", "run", "--yes", "--workers", "0", "-C",
             str(workspace), task], env=swarm.env(SWARM_BASE_URL=model.base_url, **env),
            stdout=subprocess.PIPE, stderr=err)


def test_redis_killed_mid_swarm_is_ridden_out_by_the_root(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """Redis SIGKILLed while the root waits for its child, and restarted from its
    append-only file only once the root said it waits for it: the root collects the answer
    (before, it exited 1 at once with a raw ConnectionError), and the worker survives the
    lost broker connection."""
    pidfile, stderr, release = tmp_path / "pid", tmp_path / "root.err", tmp_path / "release"
    waiting_child(model, pidfile, release)  # it works until Redis is back
    swarm.start("coordinator", "coord")
    worker = swarm.start("worker", "w1", SWARM_LEASE="2")
    swarm.ready()
    root = root_process(swarm, model, tmp_path / "ws", stderr, "ROOT outage")
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(),
                   "the child's command")
        status = swarm.server.status()
        assert status.pid is not None
        os.kill(status.pid, signal.SIGKILL)
        wait_until(lambda: b"stopped answering" in stderr.read_bytes(),
                   "the root to say Redis stopped answering")
        assert root.poll() is None, stderr.read_text()
        assert swarm.server.ensure().endswith(f"@127.0.0.1:{status.port}/0")
        release.touch()
        answer, _ = root.communicate(timeout=90)
    finally:
        kill_group_of(pidfile)
        if root.poll() is None:
            root.kill()
    assert root.returncode == 0, stderr.read_text()
    assert answer.decode().strip() == "done:slow done"
    assert "is back after" in stderr.read_text()
    assert worker.poll() is None  # the lost broker connection did not kill the worker
    assert {a.state for a in swarm.agents()} == {"done"}


def test_a_root_stopped_past_its_lock_ttl_takes_its_lock_back_and_answers(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """A root in a terminal stopped (SIGSTOP, as a laptop asleep) for longer than its
    session lock's ttl while its child works, and the child done meanwhile: nobody took
    the lock, so the root takes it back and answers (before, it exited 1, "Run again")."""
    started, release, stderr = tmp_path / "started", tmp_path / "release", tmp_path / "err"
    waiting_child(model, started, release)
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    workspace = tmp_path / "ws"
    root = root_process(swarm, model, workspace, stderr, "ROOT asleep", SWARM_LOCK_TTL="1")
    lock = keys.lock(keys.session_lock(keys.session_id_for(str(workspace.resolve()))))
    try:
        wait_until(started.exists, "the child's command")
        assert swarm.redis.exists(lock)  # the root's, under the name the test watches
        root.send_signal(signal.SIGSTOP)
        wait_until(lambda: not swarm.redis.exists(lock), "the stopped root's lock to expire")
        release.touch()
        wait_until(lambda: {a.state for a in swarm.agents() if "SLOW" in a.label} == {"done"},
                   "the child to finish while the root is stopped")
        root.send_signal(signal.SIGCONT)
        answer, _ = root.communicate(timeout=60)
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
    assert root.returncode == 0, stderr.read_text()
    assert answer.decode().strip() == "done:slow done"
    assert not swarm.redis.exists(lock)  # released as it exited


class Restart:
    """SIGKILLs the swarm's Redis at a moment of a root's run, and starts it again from its
    append-only file, on the same port, once the root said it waits for it."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.port: int | None = None

    def kill(self) -> None:
        status = self.swarm.server.status()
        assert status.pid is not None and status.port is not None
        self.port = status.port
        os.kill(status.pid, signal.SIGKILL)

    def after_notice(self, root: subprocess.Popen[bytes], stderr: Path) -> None:
        """Restart Redis once the root says it waits for it (not before: the root must
        have met the outage); fails at once if the root exited instead."""
        wait_until(lambda: root.poll() is not None or b"waiting up to" in stderr.read_bytes(),
                   "the root to say it waits for Redis")
        assert root.poll() is None, stderr.read_text()
        assert self.swarm.server.ensure().endswith(f"@127.0.0.1:{self.port}/0")


def a_kid(_: dict[str, Any] | None = None) -> Reply:
    return Reply(content="kid done")


def records_intact(swarm: Swarm, workspace: Path, answer: str) -> None:
    """The root's session ends with its answer, saved whole; its swarm and every agent
    are done, the root's record keeps its answer; its session lock is released."""
    session_id = keys.session_id_for(str(workspace.resolve()))
    session = RedisSessionStore(swarm.redis).load(session_id)
    assert session is not None and not session.repairs and not session.parked
    assert session.messages[-1]["role"] == "assistant"
    assert session.messages[-1]["content"] == answer
    swarm_id = swarm.ledger.latest_swarm()
    assert swarm_id and swarm.ledger.swarm(swarm_id)["state"] == "done"
    assert {a.state for a in swarm.agents()} == {"done"}
    root = swarm.ledger.agent(swarm_id)
    assert root is not None and root.kept and root.answer == answer
    assert not swarm.redis.exists(keys.lock(keys.session_lock(session_id)))


def answered(root: subprocess.Popen[bytes], stderr: Path) -> str:
    try:
        answer, _ = root.communicate(timeout=90)
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
    assert root.returncode == 0, stderr.read_text()
    assert "is back after" in stderr.read_text()
    return answer.decode().strip()


def test_redis_restarted_as_the_root_saves_its_answer_is_ridden_out(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """Redis SIGKILLed as the model gives the root its answer: the root's final save meets
    the outage, waits, and the answer is saved and printed once Redis is back (before, it
    exited 1: "Redis stopped answering while saving session")."""
    restart = Restart(swarm)

    def answer(request: dict[str, Any]) -> Reply:
        restart.kill()  # the root's next write is the save of this answer
        return report(request)

    model.responder = ByTask({"ROOT": [agent_calls("KID one"), answer], "KID": [a_kid()]})
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    stderr, workspace = tmp_path / "root.err", tmp_path / "ws"
    root = root_process(swarm, model, workspace, stderr, "ROOT final save")
    restart.after_notice(root, stderr)
    assert answered(root, stderr) == "done:kid done"
    records_intact(swarm, workspace, "done:kid done")


def test_redis_restarted_as_the_root_finishes_its_swarm_is_ridden_out(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """Redis SIGKILLed after the root saved its answer, before it marked its swarm done:
    the root waits for Redis, finishes its swarm and prints its answer (before, it exited
    1 with a raw ConnectionError and printed nothing)."""
    model.responder = ByTask({"ROOT": [agent_calls("KID one"), report], "KID": [a_kid()]})
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    stderr, workspace, paused = tmp_path / "root.err", tmp_path / "ws", tmp_path / "paused"
    root = root_process(swarm, model, workspace, stderr, "ROOT finish",
                        SWARM_FAULT=f"root-before-finish:{paused}")
    restart = Restart(swarm)
    wait_until(paused.exists, "the root to save its answer", timeout=60)
    restart.kill()
    paused.unlink()
    restart.after_notice(root, stderr)
    assert answered(root, stderr) == "done:kid done"
    records_intact(swarm, workspace, "done:kid done")


def renewal_outage(swarm: Swarm, model: ScriptedModelServer, tmp_path: Path,
                   thief: RedisLock | None = None) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """A root whose session lock (ttl 1 s) expires while its renewal thread is held at
    its renewal and the root waits for its answer; Redis is SIGKILLed, the renewal goes on
    (and fails), the answer comes: the root's save meets the outage. A ``thief`` (a lock
    of the same name) takes the expired lock just before. Returns the root, once Redis is
    back, its stderr and workspace."""
    asked, go = threading.Event(), threading.Event()

    def answer(request: dict[str, Any]) -> Reply:
        asked.set()
        go.wait(timeout=60)
        return report(request)

    model.responder = ByTask({"ROOT": [agent_calls("KID one"), answer], "KID": [a_kid()]})
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    stderr, workspace, paused = tmp_path / "root.err", tmp_path / "ws", tmp_path / "paused"
    root = root_process(swarm, model, workspace, stderr, "ROOT renewal", SWARM_LOCK_TTL="1",
                        SWARM_FAULT=f"lock-renewal:{paused}")
    name = keys.session_lock(keys.session_id_for(str(workspace.resolve())))
    restart = Restart(swarm)
    try:
        wait_until(paused.exists, "the root's lock renewal")
        wait_until(asked.is_set, "the root's last model call", timeout=60)
        # Nobody renews it now: it expires on the server, its fence left.
        wait_until(lambda: not swarm.redis.exists(keys.lock(name)), "the lock to expire")
        if thief is not None:
            assert thief.name == name
            thief.acquire()  # as another `swarm run` in that folder would
        restart.kill()
        paused.unlink()  # its renewal fails: Redis is down
    finally:
        go.set()  # the answer comes: the root saves it
    restart.after_notice(root, stderr)
    return root, stderr, workspace


def test_a_lock_renewal_across_a_redis_restart_takes_the_expired_lock_back(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """The root's session lock expired while Redis was down and its renewals failed: once
    Redis is back, the lock's fence (still the root's) gives it back, and the root saves
    its answer (before, it exited 1 at its next save: "Redis stopped answering while
    renewing the lock")."""
    root, stderr, workspace = renewal_outage(swarm, model, tmp_path)
    assert answered(root, stderr) == "done:kid done"
    assert "taken back" in stderr.read_text()
    records_intact(swarm, workspace, "done:kid done")


def test_a_root_whose_lock_was_taken_while_redis_was_down_stops_without_writing(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """As above, but another process took the expired lock: once Redis is back the root
    finds it is not its own and stops (exit 1, saying so) without saving its answer over
    the other process's session."""
    session_id = keys.session_id_for(str((tmp_path / "ws").resolve()))
    thief = RedisLock(swarm.redis, keys.session_lock(session_id), ttl=60)
    try:
        root, stderr, _ = renewal_outage(swarm, model, tmp_path, thief)
        try:
            root.communicate(timeout=90)
        finally:
            if root.poll() is None:
                root.kill()
                root.wait()
        assert root.returncode == 1
        assert "another swarm process took the lock" in stderr.read_text(), stderr.read_text()
        session = RedisSessionStore(swarm.redis).load(session_id)
        assert session is not None
        assert all(m.get("content") != "done:kid done" for m in session.messages)
        assert thief.check()  # still the other process's
    finally:
        thief.release()


def test_redis_restarted_as_the_children_settle_is_ridden_out_and_their_work_lands(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """Redis SIGKILLed just after a fan-out's children settled on a worker, before the root
    resumed (the chaos campaign's moment): the root waits for Redis, lands the children's
    work in its folder and answers (before, it exited 1: "Redis stopped answering while
    loading session")."""
    def write(request: dict[str, Any]) -> Reply:
        name = task_of(request).split()[1]
        return Reply(tool_calls=[ToolCall("run_cli", {"command": f"echo {name} > {name}.txt"})])

    model.responder = ByTask({"ROOT": [agent_calls("KID a", "KID b", "KID c"), report],
                              "KID": [write, a_kid]})
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    stderr, workspace, paused = tmp_path / "root.err", tmp_path / "ws", tmp_path / "paused"
    workspace.mkdir()
    (workspace / "README").write_text("the children start from this\n")  # seeded, not empty
    root = root_process(swarm, model, workspace, stderr, "ROOT fan out",
                        SWARM_FAULT=f"root-children-settled:{paused}")
    restart = Restart(swarm)
    wait_until(paused.exists, "the children to settle", timeout=60)
    restart.kill()
    paused.unlink()
    restart.after_notice(root, stderr)
    assert answered(root, stderr) == "done:kid done | done:kid done | done:kid done"
    records_intact(swarm, workspace, "done:kid done | done:kid done | done:kid done")
    assert {p.name: p.read_text() for p in workspace.glob("*.txt")} == {
        "a.txt": "a\n", "b.txt": "b\n", "c.txt": "c\n"}  # landed in its folder
    assert {a.landing for a in swarm.agents() if a.kind == "child"} == {"landed"}


def test_cancel_a_child_kills_its_command_and_the_parent_gets_cancelled(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    model.responder = ByTask({
        "ROOT": [agent_calls("STUCK forever", "QUICK one"), report],
        "STUCK": [Reply(tool_calls=[ToolCall("run_cli", {"command": f"echo $$ > {pidfile}; "
                                                                   "sleep 600"})])],
        "QUICK": [Reply(content="quick")],
    })
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    thread, out = swarm.run_in_thread("ROOT cancel", tmp_path)
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), "the command")
    stuck = next(a for a in swarm.agents() if "STUCK" in a.label)
    started = time.monotonic()
    cancelled = CliRunner().invoke(main, ["cancel", stuck.id], env=swarm.env())
    assert cancelled.exit_code == 0, cancelled.output
    thread.join(timeout=30)
    took = time.monotonic() - started
    (result,) = out
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().startswith("cancelled:")
    assert result.stdout.strip().endswith("| done:quick")
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)
    print(f"\ncancel: the parent had the cancelled result {took:.1f} s after swarm cancel")


def test_cancel_aborts_a_childs_model_call_in_flight(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """The child waits on a model answer that would take 60 s: ``swarm cancel`` cuts the
    call short (before, it ran to its end), the run settles cancelled within about a second,
    and the child's saved session ends with its last tool result: nothing half-answered."""
    model.responder = ByTask({
        "ROOT": [agent_calls("PONDER slowly", "QUICK one"), report],
        "PONDER": [Reply(tool_calls=[ToolCall("run_cli", {"command": "echo pondering"})]),
                   Slow(60, Reply(content="too late"))],
        "QUICK": [Reply(content="quick")],
    })
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    thread, out = swarm.run_in_thread("ROOT ponder", tmp_path)
    ponders = lambda: [r for r in model.requests if task_of(r) == "PONDER slowly"]  # noqa: E731
    wait_until(lambda: [r for r in ponders() if turn_of(r) == 1], "the child's second model call")
    ponder = next(a for a in swarm.agents() if "PONDER" in a.label)
    started = time.monotonic()
    cancelled = CliRunner().invoke(main, ["cancel", ponder.id], env=swarm.env())
    assert cancelled.exit_code == 0, cancelled.output
    wait_until(lambda: getattr(swarm.ledger.run(ponder.run), "state", "") in SETTLED,
               "the child to settle", timeout=15)
    took = time.monotonic() - started
    run = swarm.ledger.run(ponder.run)
    assert run is not None and run.state == "cancelled", run
    thread.join(timeout=30)
    assert not thread.is_alive()
    (result,) = out
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().startswith("cancelled:cancelled (swarm cancel")
    assert result.stdout.strip().endswith("| done:quick")
    session = RedisSessionStore(swarm.redis).load(ponder.id)
    assert session is not None and not session.repairs
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "tool"]
    assert "pondering" in session.messages[-1]["content"]
    assert len(ponders()) == 2  # the aborted call was not tried again
    print(f"\ncancel of a model call in flight: the run settled {took:.2f} s after swarm cancel")


def _asking_root(swarm: Swarm, model: ScriptedModelServer, folder: Path,
                 timeout: int) -> tuple[threading.Thread, list[Result]]:
    """``swarm run "ROOT ask"`` in a thread, whose run_cli calls always ask a person (who
    has ``timeout`` seconds to answer); its result lands in the list once it ends."""
    env = {"SWARM_APPROVAL": "run_cli=always", "SWARM_APPROVAL_TIMEOUT": str(timeout)}
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(swarm.env(SWARM_BASE_URL=model.base_url, **env))
    out: list[Result] = []
    thread = threading.Thread(target=lambda: out.append(CliRunner().invoke(
        main, ["run", "--workers", "0", "-C", str(folder), "ROOT ask"], env=base)))
    thread.start()
    return thread, out


def _pending(swarm: Swarm) -> list[Any]:
    """The approval requests waiting in the latest swarm."""
    swarm_id = swarm.ledger.latest_swarm()
    return ApprovalQueue(swarm.redis, swarm_id).pending() if swarm_id else []


def test_children_ask_a_person_through_the_queue(swarm: Swarm, model: ScriptedModelServer,
                                                 tmp_path: Path) -> None:
    made = tmp_path / "made"
    model.responder = ByTask({
        "ROOT": [agent_calls("ASKS first", "IGNORED second"), report],
        "ASKS": [Reply(tool_calls=[ToolCall("run_cli", {"command": f"mkdir -p {made}"})]),
                 lambda r: Reply(content="asked: " + tool_results(r)[0][:60])],
        "IGNORED": [Reply(tool_calls=[ToolCall("run_cli", {"command": "touch nope"})]),
                    lambda r: Reply(content="ignored: " + tool_results(r)[0][:80])],
    })
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    thread, out = _asking_root(swarm, model, tmp_path, timeout=3)
    asks = wait_until(lambda: [p for p in _pending(swarm) if "mkdir" in p.summary],
                      "a request")
    listed = CliRunner().invoke(main, ["approve"], env=swarm.env())
    assert asks[0].id in listed.stdout and "mkdir" in listed.stdout
    answered = CliRunner().invoke(main, ["approve", asks[0].id], env=swarm.env())
    assert answered.exit_code == 0, answered.output
    thread.join(timeout=60)
    assert out, f"the root never answered: {swarm.agents()}"
    (result,) = out
    assert result.exit_code == 0, result.output
    asked, ignored = result.stdout.strip().split(" | ")
    assert made.is_dir() and "[exit code: 0]" in asked
    assert "denied" in ignored and "no one answered within 3 s" in ignored
    assert not (tmp_path / "nope").exists()


def test_an_approval_asked_by_a_worker_that_died_expires_and_the_next_attempt_asks_again(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """A child asks a person, then its worker is SIGKILLed. Once the dead attempt's lease
    has run out, its request is no longer listed: it is closed as expired (an answer to it
    is refused, saying why), and the run's next attempt, resumed on another worker, asks
    again; that answer is the one that counts."""
    made = tmp_path / "made"
    ask = Reply(tool_calls=[ToolCall("run_cli", {"command": f"mkdir -p {made}"})])
    model.responder = ByTask({
        "ROOT": [agent_calls("ASKER once"), report],
        "ASKER": [ask, ask, lambda r: Reply(content="ran: " + tool_results(r)[0][:40])],
    })
    swarm.start("coordinator", "coord")
    doomed = swarm.start("worker", "doomed", SWARM_LEASE="2")
    swarm.ready()
    thread, out = _asking_root(swarm, model, tmp_path, timeout=120)

    def pending() -> list[str]:
        return [p.id for p in _pending(swarm)]

    (first,) = wait_until(pending, "the child's request")
    os.kill(doomed.pid, signal.SIGKILL)
    assert doomed.wait(timeout=10) == -signal.SIGKILL
    wait_until(lambda: first not in pending(), "the dead attempt's request to expire",
               timeout=15)
    assert outcome(swarm.redis, first) == EXPIRED
    late = CliRunner().invoke(main, ["approve", first], env=swarm.env())
    assert late.exit_code != 0 and "the agent that asked is gone" in late.output, late.output
    assert not made.exists()
    swarm.start("worker", "rescuer", SWARM_LEASE="2")
    (second,) = wait_until(pending, "the next attempt to ask again")
    assert second != first
    answered = CliRunner().invoke(main, ["approve", second], env=swarm.env())
    assert answered.exit_code == 0, answered.output
    thread.join(timeout=60)
    assert not thread.is_alive(), "the root never got its answer"
    (result,) = out
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "done:ran: [exit code: 0]"
    assert made.is_dir()
    asker = next(a for a in swarm.agents() if "ASKER" in a.label)
    run = swarm.ledger.run(asker.run)
    assert run is not None and run.attempts == 2


def test_wall_time_limit_warns_then_stops(swarm: Swarm, model: ScriptedModelServer,
                                          tmp_path: Path) -> None:
    model.responder = ByTask({
        "ROOT": [agent_calls("ENDLESS loop"), report],
        "ENDLESS": [Reply(tool_calls=[ToolCall("run_cli", {"command": "sleep 0.5"})])],
    })
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    result = swarm.run("ROOT limits", tmp_path, SWARM_CHILD_TIMEOUT="3")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("timed_out:wall-time limit of 3 s reached")
    child = [r for r in model.requests if task_of(r) == "ENDLESS loop"]
    assert any("time limit" in json.dumps(r["messages"][-1]) for r in child)


def test_token_budget_stops_the_children(swarm: Swarm, model: ScriptedModelServer,
                                         tmp_path: Path) -> None:
    usage = {"prompt_tokens": 90, "completion_tokens": 10, "total_tokens": 100}
    model.responder = ByTask({
        "ROOT": [agent_calls("SPENDER a", "SPENDER b"), report],
        "SPENDER": [Reply(tool_calls=[ToolCall("run_cli", {"command": "true"})], usage=usage)],
    })
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    result = swarm.run("ROOT spend", tmp_path, SWARM_TOKEN_BUDGET="350")
    # The root's tokens count too: it stops before its next model call, as its children do.
    assert result.exit_code == 3, result.output
    assert "of its budget of 350 (SWARM_TOKEN_BUDGET)" in result.output
    swarm_id = swarm.ledger.latest_swarm() or ""
    children = [a for a in swarm.ledger.agents(swarm_id) if a.depth == 1]
    runs = [swarm.ledger.run(a.run) for a in children]
    assert len(runs) == 2 and all(
        r is not None and r.state == "failed" and "SWARM_TOKEN_BUDGET" in r.result["error"]
        for r in runs), runs
    spent = int(swarm.redis.hget(keys.swarm_counters(swarm_id), "tokens") or 0)
    assert spent >= 350


def test_429_storm_is_shared_and_a_child_that_gives_up_fails_alone(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    first_429: dict[str, float] = {}
    lock = threading.Lock()

    def throttled(request: dict[str, Any]) -> Item:
        task = task_of(request)
        with lock:
            if task not in first_429:
                first_429[task] = time.monotonic()
                return Fault(status=429, retry_after=1)
        return Reply(content="after the storm")

    model.responder = ByTask({
        "ROOT": [agent_calls(*(f"PATIENT {i}" for i in range(4)), "DOOMED one"), report],
        "PATIENT": [throttled],
        "DOOMED": [Fault(status=500)],
    })
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    result = swarm.run("ROOT storm", tmp_path, SWARM_RETRIES="3")
    assert result.exit_code == 0, result.output
    parts = result.stdout.strip().split(" | ")
    assert parts[:4] == ["done:after the storm"] * 4
    assert parts[4].startswith("failed:ModelHTTPError") and "500" in parts[4]
    # A 429 closed the swarm's shared gate (every child holds its calls until it opens).
    gate = swarm.redis.get(keys.rate_gate(swarm.ledger.latest_swarm() or ""))
    assert gate is not None, "no child closed the swarm's rate gate"
    patient = [r for r in model.requests if task_of(r).startswith("PATIENT")]
    assert len(patient) == 8  # each child: one 429, one retry that succeeded


def test_cancel_settles_children_held_back_by_the_in_flight_limit(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    model.responder = ByTask({
        "ROOT": [agent_calls("HOLDER busy", "HELD one", "HELD two"), report],
        "HOLDER": [Reply(tool_calls=[ToolCall("run_cli", {
            "command": f"echo $$ > {pidfile}; sleep 600"})])],
        "HELD": [Reply(content="should not run")],
    })
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    thread, out = swarm.run_in_thread("ROOT held", tmp_path, SWARM_MAX_PARALLEL="1")
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), "the holder")
    assert [a.state for a in swarm.agents() if "HELD" in a.label] == \
        ["waiting", "waiting"]
    root = swarm.ledger.latest_swarm() or ""
    assert CliRunner().invoke(main, ["cancel", root], env=swarm.env()).exit_code == 0
    thread.join(timeout=30)
    assert not thread.is_alive()
    (result,) = out
    assert result.exit_code == 4, result.output  # the root was cancelled too
    wait_until(lambda: {a.state for a in swarm.agents() if a.kind == "child"}
               == {"cancelled"}, timeout=10, what="every child cancelled")
    assert not [r for r in model.requests if task_of(r).startswith("HELD")]


def test_a_root_gone_between_saving_itself_parked_and_parking_is_attached_and_answers(
        swarm: Swarm, model: ScriptedModelServer, tmp_path: Path) -> None:
    """The root's terminal dies after its session is saved parked and before its request
    is written: `swarm attach` does not wait for a request that never went out (it waited
    for ever); the lost call is answered as interrupted and the root answers again."""
    def after(request: dict[str, Any]) -> Reply:
        return Reply(content="after: " + " | ".join(tool_results(request)))

    model.responder = ByTask({"ROOT": [agent_calls("KID one"), after], "KID": [a_kid()]})
    swarm.start("coordinator", "coord")
    swarm.start("worker", "w1")
    swarm.ready()
    stderr, workspace = tmp_path / "root.err", tmp_path / "ws"
    root = root_process(swarm, model, workspace, stderr, "ROOT park", SWARM_LOCK_TTL="1",
                        SWARM_FAULT="spawner-before-park")
    assert root.wait(timeout=60) == 137, stderr.read_text()
    session_id = keys.session_id_for(str(workspace.resolve()))
    saved = RedisSessionStore(swarm.redis).load(session_id)
    assert saved is not None and saved.parked
    assert swarm.ledger.request(saved.parked) is None
    swarm_id = swarm.ledger.latest_swarm()
    assert swarm_id
    wait_until(lambda: not swarm.redis.exists(keys.lock(keys.session_lock(session_id))),
               "the dead root's lock to expire")
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(swarm.env(SWARM_BASE_URL=model.base_url))
    done: list[Result] = []
    thread = threading.Thread(target=lambda: done.append(
        CliRunner().invoke(main, ["attach", swarm_id], env=base)))
    thread.start()
    thread.join(timeout=60)
    assert done, "swarm attach still waits for a request that was never written"
    assert done[0].exit_code == 0, done[0].output
    assert done[0].stdout.strip().startswith("after: [interrupted:")
    session = RedisSessionStore(swarm.redis).load(session_id)
    assert session is not None and not session.parked
    assert not [a for a in swarm.agents() if a.kind == "child"]  # nothing was sent
