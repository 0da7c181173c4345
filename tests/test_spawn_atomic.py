"""A spawn's transitions are atomic: what the parent admits is written as it parks, a
replay never moves a run that settled meanwhile, a cancel takes a held run out of the
waiting list and settles it in one step. Another client's write (or a crash) is put
between two of a client's commands, on the real server."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import redis as redis_py
from celery import Celery
from kombu.exceptions import OperationalError

from swarm.broker.app import configure
from swarm.config import Settings
from swarm.coordinator.service import Coordinator
from swarm.domain.spawn import SpawnCall
from swarm.runtime.spawner import RedisSpawner
from swarm.store import keys
from swarm.store.ledger import Ledger, derive_id
from tests.helpers import child_run, spawn_children


class Between(redis_py.Redis):
    """A real client that runs ``then`` once, right after the first command ``when``
    picks (given what was sent and what came back)."""

    when: Callable[[tuple[Any, ...], Any], bool]
    then: Callable[[], None] | None

    def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = super().execute_command(*args, **options)
        if self.then is not None and self.when(args, reply):
            then, self.then = self.then, None
            then()
        return reply


def between(url: str, when: Callable[[tuple[Any, ...], Any], bool],
            then: Callable[[], None]) -> Between:
    client = Between.from_url(url, decode_responses=True)
    client.when, client.then = when, then
    return client


class DownBroker(Celery):
    """A coordinator's broker that fails every send (the coordinator dies sending)."""

    def send_task(self, *args: Any, **kwargs: Any) -> Any:
        raise OperationalError("the broker went away")


def parked_on_one_call(ledger: Ledger, message: str = "do 1") -> str:
    """A root parked on one ``agent`` call; returns its request id."""
    ledger.create_swarm("s1", "aparent", "/w", "task", {}, "host-a", "aparent")
    spawner = RedisSpawner(ledger, "aparent", "s1")
    calls = [SpawnCall("c1", message)]
    request_id = spawner.request_id(1, calls)
    spawner.submit(request_id, 1, calls, {})
    return request_id


def test_a_replay_never_puts_back_in_flight_a_run_that_settled_meanwhile(
        redis_server: str, redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    request_id = parked_on_one_call(ledger)
    run_id = derive_id("r", "aparent", 1, "c1")
    dead = DownBroker("down")
    dead.config_from_object(configure(redis_server).conf)
    with contextlib.suppress(OperationalError):
        Coordinator(redis, dead, Settings()).spawn(request_id)  # dies sending
    assert redis.sismember(keys.swarm_inflight("s1"), run_id)

    def settle() -> None:  # its task went out after all, and its worker finished it
        run = ledger.run(run_id)
        assert run is not None and ledger.settle(run, "s1", "done", {"answer": "ok"}, {})

    # Another coordinator replays the request; the run settles right after the replay
    # first reads it.
    replay = between(redis_server, lambda sent, got: run_id in repr(sent) + repr(got), settle)
    Coordinator(replay, configure(redis_server), Settings()).spawn(request_id)
    run = ledger.run(run_id)
    assert run is not None and run.state == "done"
    assert not redis.sismember(keys.swarm_inflight("s1"), run_id)  # its slot stays free


def test_cancel_takes_a_held_run_out_and_settles_it_in_one_step(
        redis_server: str, redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/w", "task", {"max_parallel": 1}, "host-a",
                        "aparent")
    r2 = child_run("aparent", "a2")
    spawn_children(ledger, "s1", "aparent", "a1", "a2")
    assert redis.lrange(keys.swarm_waiting("s1"), 0, -1) == [r2]  # held

    def crash() -> None:
        raise redis_py.ConnectionError("the process died here")

    # The cancelling process dies right after any command that takes r2 off the list.
    dying = Ledger(between(redis_server, lambda sent, got: sent[0] == "LREM", crash))
    with contextlib.suppress(redis_py.ConnectionError):
        dying.cancel("a2")
    run = ledger.run(r2)
    assert run is not None
    waiting = redis.lrange(keys.swarm_waiting("s1"), 0, -1)
    assert (run.state, waiting) in (("cancelled", []), ("queued", [r2])), \
        "the run left the waiting list without settling: nothing would ever run or end it"
    ledger.cancel("a2")
    assert ledger.run(r2).state == "cancelled"  # type: ignore[union-attr]


def test_a_call_the_parent_refuses_is_settled_as_it_parks(redis: redis_py.Redis) -> None:
    """No coordinator runs: the park itself wrote the refused run and counted it."""
    ledger = Ledger(redis)
    request_id = parked_on_one_call(ledger, "x" * (256 * 1024 + 1))
    run = ledger.run(derive_id("r", "aparent", 1, "c1"))
    assert run is not None and run.state == "refused" and run.agent == ""
    assert "KiB" in run.result["error"]
    assert redis.hget(keys.request(request_id), "settled") == "1"
    assert ledger.counters("s1")["refused"] == 1
