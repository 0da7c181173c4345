"""A worker that lost its run's lease writes nothing more of it: neither its session nor
its settlement. A real worker's runner and agent, on the real server, with the scripted
model over HTTP."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import redis as redis_py

from swarm.config import Settings
from swarm.domain.session import Session
from swarm.store import keys
from swarm.store.ledger import Ledger, RunRecord
from swarm.store.sessions import RedisSessionStore
from swarm.testing.replies import Item, Reply, Slow
from swarm.testing.server import ScriptedModelServer
from swarm.workers.child import ChildRunner
from tests.helpers import child_run, spawn_children

HOST = socket.gethostname()


def a_child(redis: redis_py.Redis, workspace: Path) -> RunRecord:
    """Swarm s1 with one queued child run (agent a1) whose workspace is here."""
    workspace.mkdir()
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aroot", str(workspace), "task", {}, HOST, "aroot")
    spawn_children(ledger, "s1", "aroot", "a1")
    ledger.place("a1", str(workspace), HOST)
    got = ledger.run(child_run("aroot", "a1"))
    assert got is not None
    return got


def runner_for(server: ScriptedModelServer, redis: redis_py.Redis, home: Path,
               **overrides: Any) -> ChildRunner:
    settings = Settings(home=home, base_url=server.base_url, model=server.models[0],
                        retries=1, **overrides).with_(sandbox="none")
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


def test_a_worker_that_loses_its_lease_during_a_model_call_saves_nothing(
        model_server: ScriptedModelServer, redis: redis_py.Redis, tmp_path: Path) -> None:
    """Another worker takes the run over while this one waits on the model: the lost lease
    aborts the call, and the save the agent makes after an aborted call is stopped by the
    lease check (the guard) before it writes: the stored session stays as it was, byte for
    byte, for the successor to resume."""
    run = a_child(redis, tmp_path / "ws")
    # What an earlier attempt saved (this attempt carries it on): the successor's to resume.
    RedisSessionStore(redis).save(Session(
        id=run.agent, workspace=str(tmp_path / "ws"), usage={}, created=1.0, updated=1.0,
        messages=[{"role": "user", "content": "say done"},
                  {"role": "assistant", "content": "thinking it over"}]))
    stored: list[dict[str, str]] = []

    def take_over_during_the_call(request: dict[str, Any]) -> Item:
        stored.append(redis.hgetall(keys.session(run.agent)))
        redis.hset(keys.run(run.id), "lease", "tok-successor")
        return Slow(30.0, Reply("too late"))

    model_server.responder = take_over_during_the_call
    runner = runner_for(model_server, redis, tmp_path / "home", lease=3)
    assert runner.run(run.id)["state"] == "lease lost"
    assert len(stored) == 1 and stored[0]
    assert redis.hgetall(keys.session(run.agent)) == stored[0]
    got = Ledger(redis).run(run.id)
    assert got is not None and got.state == "running", got
