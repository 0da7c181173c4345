"""A model call in flight is cut short when its agent is stopped (cancel, a deadline, a lost
lease): the scripted model over real HTTP takes 30 s to answer, the call returns in about
the time it takes to notice the stop. Figures are printed, bounds are loose (an answer
that was not aborted would take 30 s)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis as redis_py

from swarm.domain.messages import StreamEvent
from swarm.domain.stop import StopEvent
from swarm.errors import ModelCallAborted
from swarm.llm.client import LLMClient
from swarm.store.connection import connect
from swarm.testing.server import Fault, Reply, ScriptedModelServer, Slow
from swarm.workers.supervisor import Supervisor, Watched
from tests.helpers import wait_until
from tests.netproxy import TcpProxy

USER = [{"role": "user", "content": "hi"}]
#: How long the model takes: far longer than any bound below.
SLOW = 30.0


def client(server: ScriptedModelServer, **kw: Any) -> LLMClient:
    options: dict[str, Any] = {"model": "scripted-model", "retries": 3, "backoff_max": 0.01,
                               "stream": False}
    options.update(kw)
    return LLMClient(server.base_url, **options)


def call_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a thread; its result or exception lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def stopped_within(thread: threading.Thread, out: list[Any], since: float,
                   timeout: float = 10.0) -> float:
    """Wait for the call to end, check it was aborted; the seconds since ``since``."""
    thread.join(timeout=timeout)
    assert not thread.is_alive(), f"the model call was not aborted within {timeout:g} s"
    took = time.monotonic() - since
    (result,) = out
    assert isinstance(result, ModelCallAborted), result
    return took


def test_a_stop_aborts_a_whole_answer_being_waited_for(
        model_server: ScriptedModelServer) -> None:
    model_server.script(Slow(SLOW, Reply("too late")), Reply("next call"))
    stop = StopEvent()
    with client(model_server) as c:
        c.stop = stop
        thread, out = call_in_thread(lambda: c.chat(USER))
        wait_until(lambda: model_server.requests, "the request to reach the model")
        started = time.monotonic()
        stop.set()
        took = stopped_within(thread, out, started)
        # The client (and its pool) works on: a new call gets its answer.
        c.stop = StopEvent()
        assert c.chat(USER).content == "next call"
    assert "cut short" in str(out[0])
    print(f"\nwhole answer: aborted {took * 1000:.0f} ms after the stop")


def test_a_stop_aborts_a_stream_between_its_chunks(model_server: ScriptedModelServer) -> None:
    model_server.script(Slow(SLOW, Reply("too late", reasoning="thinking hard"),
                             after_thinking=True))
    seen: list[StreamEvent] = []
    stop = StopEvent()
    with client(model_server, stream=True) as c:
        c.stop = stop
        thread, out = call_in_thread(lambda: c.chat(USER, on_event=seen.append))
        wait_until(lambda: "".join(e.text for e in seen) == "thinking hard", "the thinking")
        started = time.monotonic()
        stop.set()
        took = stopped_within(thread, out, started)
    assert not any(e.kind == "content" for e in seen)
    print(f"\nstream: aborted {took * 1000:.0f} ms after the stop")


def test_a_stop_ends_the_wait_between_tries(model_server: ScriptedModelServer) -> None:
    model_server.script(Fault(503, retry_after=SLOW), Reply("never asked"))
    stop = StopEvent()
    # A long wait before the next try, on the stop event: the stop ends it, and no second
    # try goes out.
    with client(model_server, backoff_max=SLOW) as c:
        c.stop = stop
        thread, out = call_in_thread(lambda: c.chat(USER))
        wait_until(lambda: model_server.requests, "the first try")
        started = time.monotonic()
        stop.set()
        stopped_within(thread, out, started)
    assert len(model_server.requests) == 1
    assert model_server.pending == 1


def test_a_stopped_client_sends_nothing(model_server: ScriptedModelServer) -> None:
    stop = StopEvent()
    stop.set()
    with client(model_server) as c:
        c.stop = stop
        with pytest.raises(ModelCallAborted):
            c.chat(USER)
    assert model_server.requests == []


@pytest.fixture
def cut_redis(redis_server: str) -> Iterator[tuple[TcpProxy, redis_py.Redis]]:
    """A client of the test server through a link that can be cut."""
    parts = urlsplit(redis_server)  # redis://:PASSWORD@HOST:PORT/0
    host, port = str(parts.hostname), str(parts.port)
    with TcpProxy(host, int(port)) as link:
        client_ = connect(redis_server.replace(f":{port}", f":{link.port}", 1), retries=0,
                          socket_timeout=0.5, connect_timeout=0.5)
        try:
            yield link, client_
        finally:
            client_.close()


def test_the_lease_watchdog_aborts_the_model_call_of_a_worker_cut_off_from_redis(
        model_server: ScriptedModelServer, cut_redis: tuple[TcpProxy, redis_py.Redis]) -> None:
    """The worker cannot renew the lease (Redis is cut off): its watchdog stops the child a
    margin before the lease can run out on the server, and that aborts the model call the
    child waits on, so nothing the child does outlives its lease."""
    link, redis_ = cut_redis
    lease = 3.0
    supervisor = Supervisor(redis_, lease)
    model_server.script(Slow(SLOW, Reply("too late")))
    with client(model_server) as c:
        link.cut()
        claimed = time.monotonic()
        watched = supervisor.watch(Watched("r-cut", "a-cut", "token", limit=3600.0), claimed)
        c.stop = watched.event
        try:
            thread, out = call_in_thread(lambda: c.chat(USER))
            took = stopped_within(thread, out, claimed, timeout=lease + 5)
        finally:
            supervisor.forget(watched)
            link.heal()
    assert watched.lease_lost and not watched.timed_out
    assert took < lease  # aborted before the lease could have run out on the server
    print(f"\nlease watchdog: model call aborted {took:.2f} s into a {lease:g} s lease")
