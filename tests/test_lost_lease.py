"""A worker that lost its run's lease writes nothing more of it: neither its session nor
its settlement. A real worker's runner and agent, on the real server, with the scripted
model over HTTP."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import redis as redis_py

from swarm.config import Settings
from swarm.store import keys
from swarm.store.ledger import AgentRecord, Ledger, NewRun, RunRecord
from swarm.testing.replies import Reply
from swarm.testing.server import ScriptedModelServer
from swarm.workers.child import ChildRunner

HOST = socket.gethostname()


def a_child(redis: redis_py.Redis, workspace: Path) -> RunRecord:
    """Swarm s1 with one queued child run r1 (agent a1) whose workspace is here."""
    workspace.mkdir()
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aroot", str(workspace), "task", {}, HOST, "aroot")
    root = AgentRecord(id="aroot", swarm="s1", workspace=str(workspace), host=HOST,
                       kind="root")
    run = RunRecord(id="r1", agent="a1", request="q1", call_id="c1", message="say done",
                    state="queued")
    ledger.spawn("s1", root, [NewRun(run, depth=1, label="say done")], 10, 10)
    ledger.place("a1", str(workspace), HOST)
    got = ledger.run("r1")
    assert got is not None
    return got


def runner_for(server: ScriptedModelServer, redis: redis_py.Redis, home: Path) -> ChildRunner:
    settings = Settings(home=home, base_url=server.base_url, model=server.models[0],
                        retries=1).with_(sandbox="none")
    return ChildRunner(settings, redis)


def test_a_worker_whose_run_was_taken_over_does_not_settle_it(
        model_server: ScriptedModelServer, redis: redis_py.Redis, tmp_path: Path) -> None:
    """Another worker takes the run over (the lease token in the ledger changes) after this
    one's last step, before it settles: its settlement, fenced by its token, writes
    nothing; the run stays its successor's."""
    run = a_child(redis, tmp_path / "ws")
    model_server.script(Reply("done"))
    runner = runner_for(model_server, redis, tmp_path / "home")

    def taken_over() -> None:  # the flush just before the settlement, in the worker's thread
        if threading.current_thread() is threading.main_thread():
            redis.hset(keys.run(run.id), "lease", "tok-successor")

    runner.supervisor.flush_hooks.append(taken_over)
    assert runner.run(run.id)["state"] == "done"  # it worked to its end
    assert model_server.pending == 0  # it did answer
    got = Ledger(redis).run(run.id)
    assert got is not None and got.state == "running" and got.result.get("answer") is None, got
    assert redis.hget(keys.run(run.id), "lease") == "tok-successor"
    assert not [f for _, f in redis.xrange(keys.events("s1")) if f["kind"] == "settled"]
