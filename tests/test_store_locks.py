"""RedisLock against a real server, across threads and processes."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis as redis_py

import swarm
from swarm.errors import LockError, StoreUnavailableError
from swarm.store import keys
from swarm.store.connection import Outage, connect
from swarm.store.locks import RedisLock
from tests.helpers import wait_until
from tests.netproxy import TcpProxy

ROOT = Path(swarm.__file__).resolve().parent.parent

HOLDER = """
import sys, time
from swarm.store.connection import connect
from swarm.store.locks import RedisLock
lock = RedisLock(connect(sys.argv[1]), sys.argv[2], ttl=float(sys.argv[3]))
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


# A holder that says, each time it changes, whether it still holds its lock.
WATCHER = """
import sys, time
from swarm.store.connection import connect
from swarm.store.locks import RedisLock
lock = RedisLock(connect(sys.argv[1]), sys.argv[2], ttl=float(sys.argv[3]))
lock.acquire()
said = None
while True:
    held = lock.check()
    if held != said:
        print("held" if held else "lost", flush=True)
        said = held
    time.sleep(0.02)
"""


@pytest.fixture
def stopped_holder(redis_server: str, redis: redis_py.Redis
                   ) -> Iterator[subprocess.Popen[str]]:
    """A process that held the lock ``w`` (ttl 1 s), stopped (SIGSTOP) until its lock
    expired; the test sends SIGCONT."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WATCHER, redis_server, "w", "1"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: not redis.exists(keys.lock("w")), "the stopped holder's lock to expire")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_that_expired_while_its_holder_was_stopped_is_taken_back(
        redis: redis_py.Redis, stopped_holder: subprocess.Popen[str]) -> None:
    stopped_holder.send_signal(signal.SIGCONT)
    wait_until(lambda: redis.exists(keys.lock("w")), "the holder to take its lock back")
    assert RedisLock(redis, "w").holder()["pid"] == stopped_holder.pid  # type: ignore[index]
    with pytest.raises(LockError):
        RedisLock(redis, "w").acquire()
    assert stopped_holder.poll() is None


def test_a_lock_another_process_took_meanwhile_is_lost_to_its_holder(
        redis: redis_py.Redis, stopped_holder: subprocess.Popen[str]) -> None:
    other = RedisLock(redis, "w")
    other.acquire()
    other.release()  # free again, but written by another holder since
    assert not redis.exists(keys.lock("w"))
    stopped_holder.send_signal(signal.SIGCONT)
    assert stopped_holder.stdout is not None
    ready, _, _ = select.select([stopped_holder.stdout], [], [], 10)
    assert ready, "the holder never said it lost its lock"
    assert stopped_holder.stdout.readline().strip() == "lost"
    assert not redis.exists(keys.lock("w"))  # it did not take the lock again
    late = RedisLock(redis, "w")
    late.acquire()  # free for anyone
    late.release()


def test_a_holder_takes_back_a_lock_that_expired_without_a_taker(
        redis: redis_py.Redis) -> None:
    lock = RedisLock(redis, "w", ttl=0.6)
    lock.acquire()
    redis.delete(keys.lock("w"))  # as if it expired during a pause: nobody took it
    wait_until(lambda: redis.exists(keys.lock("w")), "the renewal to take the lock back")
    assert lock.held and lock.check()
    assert redis.pttl(keys.lock("w")) <= 600
    assert lock.release() is True
    assert not redis.exists(keys.lock_fence("w"))  # released: nobody can take it back


@pytest.fixture
def holder(redis_server: str) -> Iterator[subprocess.Popen[str]]:
    """A separate python process holding the lock ``w`` with ttl 1 s (renewing it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, redis_server, "w", "1"],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_contention_between_two_objects(redis: redis_py.Redis) -> None:
    a = RedisLock(redis, "w", owner_info={"workspace": "/w"})
    b = RedisLock(redis, "w")
    a.acquire()
    assert a.held
    with pytest.raises(LockError) as err:
        b.acquire()
    message = str(err.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}, since " in message
    assert "is working in this folder" in message and "expires within 30 s" in message
    info = a.holder()
    assert info is not None and set(info) == {"host", "pid", "started", "workspace"}  # no token
    assert info["workspace"] == "/w" and info["pid"] == os.getpid()
    started = time.monotonic()
    with pytest.raises(LockError):
        b.acquire(blocking_timeout=0.3)
    assert time.monotonic() - started >= 0.3
    assert a.release() is True
    assert a.release() is False
    with b:
        assert b.held and redis.exists(keys.lock("w"))
    assert not b.held and redis.exists(keys.lock("w")) == 0


def test_blocking_acquire_gets_the_lock_when_released(redis: redis_py.Redis) -> None:
    a = RedisLock(redis, "w")
    a.acquire()
    threading.Timer(0.2, a.release).start()
    b = RedisLock(redis, "w", blocking_timeout=5)
    started = time.monotonic()
    b.acquire()
    assert b.held
    assert time.monotonic() - started < 1.0  # it asks again often, not once a second
    b.release()


def test_contention_from_another_process(
    redis: redis_py.Redis, holder: subprocess.Popen[str]
) -> None:
    with pytest.raises(LockError) as err:
        RedisLock(redis, "w").acquire()
    assert f"pid {holder.pid} on host {socket.gethostname()}" in str(err.value)
    assert "expires within 1 s" in str(err.value)
    time.sleep(1.5)  # past the ttl: the holder's renewal thread keeps it
    with pytest.raises(LockError):
        RedisLock(redis, "w").acquire()


def test_sigkilled_holder_lock_expires(
    redis: redis_py.Redis, holder: subprocess.Popen[str]
) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RedisLock(redis, "w")
    with pytest.raises(LockError):
        lock.acquire()  # a crashed holder's lock outlives it until the ttl runs out
    started = time.monotonic()
    lock.acquire(blocking_timeout=3)
    assert time.monotonic() - started < 1.5
    lock.release()


def test_renewal_keeps_lock_past_ttl(redis: redis_py.Redis) -> None:
    lock = RedisLock(redis, "w", ttl=0.5)
    lock.acquire()
    time.sleep(1.3)
    assert not lock.lost and 0 < redis.pttl(keys.lock("w")) <= 500
    with pytest.raises(LockError):
        RedisLock(redis, "w").acquire()
    assert lock.release() is True


def test_release_never_deletes_another_holders_lock(redis: redis_py.Redis) -> None:
    a = RedisLock(redis, "w", ttl=0.6)
    a.acquire()
    redis.delete(keys.lock("w"))  # as if a's lock expired during a long pause
    b = RedisLock(redis, "w")
    b.acquire()
    wait_until(lambda: a.lost, "a's renewal to find its lock taken", timeout=2)
    assert a.lost and not a.held and not a.check()
    assert redis.pttl(keys.lock("w")) > 20_000  # a's renewal did not touch b's lock
    assert a.release() is False
    assert b.holder() is not None and b.held
    assert b.release() is True


# -- what a holder believes after a pause, and without Redis --------------------------------------


class Clock:
    """This process's clocks, moved forward as a stop (SIGSTOP, a debugger) moves both, or
    a machine's sleep moves the wall clock alone; Redis's own clock is untouched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mono = self.wall = 0.0
        monotonic, wall = time.monotonic, time.time
        monkeypatch.setattr(time, "monotonic", lambda: monotonic() + self.mono)
        monkeypatch.setattr(time, "time", lambda: wall() + self.wall)

    def stop(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds

    def sleep(self, seconds: float) -> None:
        self.wall += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


@pytest.fixture
def cut_redis(redis_server: str) -> Iterator[tuple[TcpProxy, redis_py.Redis]]:
    """A client of the test server through a link that can be cut."""
    parts = urlsplit(redis_server)
    port = str(parts.port)
    with TcpProxy(str(parts.hostname), int(port)) as link:
        client = connect(redis_server.replace(f":{port}", f":{link.port}", 1), retries=0,
                         socket_timeout=0.5, connect_timeout=0.5)
        try:
            yield link, client
        finally:
            client.close()


@pytest.mark.parametrize("pause", ["stop", "sleep"])
def test_a_holder_paused_past_a_third_of_its_ttl_asks_redis_before_saying_it_holds(
        redis: redis_py.Redis, clock: Clock, pause: str) -> None:
    """Its renewal thread has not run yet after the pause: the check itself renews, and
    finds the lock another process took meanwhile."""
    lock = RedisLock(redis, "w", ttl=30)  # renewed every 10 s: not during the test
    lock.acquire()
    redis.delete(keys.lock("w"))  # it expired during the pause...
    other = RedisLock(redis, "w")
    other.acquire()  # ...and was taken
    getattr(clock, pause)(11)
    assert not lock.check() and lock.lost and not lock.held
    assert other.check() and other.holder() is not None
    assert other.release() and not lock.release()


def test_a_paused_holder_takes_back_its_lock_if_nobody_took_it(
        redis: redis_py.Redis, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    """Another lock, taken meanwhile, has a fence of its own."""
    lock = RedisLock(redis, "w", ttl=30)
    lock.acquire()
    with caplog.at_level(logging.WARNING, logger="swarm.store.locks"):
        clock.stop(11)
        assert lock.check()  # a plain renewal: nothing to say
        assert caplog.records == []
        neighbour = RedisLock(redis, "v")
        neighbour.acquire()
        redis.delete(keys.lock("w"))  # it expired during a pause; nobody took it
        clock.stop(11)
        assert lock.check() and not lock.lost
    assert 0 < redis.pttl(keys.lock("w")) <= 30_000
    assert [r.getMessage() for r in caplog.records] == [
        "lock w: it expired while this process was stopped or Redis was away, and nobody "
        "took it since: taken back"]
    assert neighbour.release() and lock.release()


def test_a_holder_cut_off_from_redis_trusts_its_lock_until_its_ttl_could_have_run_out(
        redis: redis_py.Redis, cut_redis: tuple[TcpProxy, redis_py.Redis], clock: Clock) -> None:
    link, client = cut_redis
    lock = RedisLock(client, "w", ttl=30)
    lock.acquire()
    link.cut()
    clock.stop(11)
    assert lock.check()  # it cannot have expired yet: what writes next meets the outage
    clock.stop(20)
    with pytest.raises(StoreUnavailableError, match="while renewing the lock w"):
        lock.check()
    link.heal()


def test_a_holder_riding_out_an_outage_waits_for_redis_to_check_and_release(
        redis: redis_py.Redis, cut_redis: tuple[TcpProxy, redis_py.Redis], clock: Clock) -> None:
    link, client = cut_redis
    said: list[str] = []
    lock = RedisLock(client, "w", ttl=30, outage=Outage("the test's Redis", 30, said.append))
    lock.acquire()
    clock.stop(31)
    link.cut()
    threading.Timer(1.5, link.heal).start()  # past the client's 0.5 s timeout
    assert lock.check()  # once Redis answered again: still its own
    assert said and "stopped answering" in said[0]
    link.cut()
    threading.Timer(1.5, link.heal).start()
    lock.release()  # False if the first try's bytes, held by the cut, deleted it already
    assert not redis.exists(keys.lock("w"))


def test_release_of_a_lock_never_taken_is_false(redis: redis_py.Redis) -> None:
    assert RedisLock(redis, "w").release() is False


def test_a_lock_written_by_something_else_is_shown_as_it_is(redis: redis_py.Redis) -> None:
    for raw in ("not json", "[1]"):
        redis.set(keys.lock("w"), raw)
        assert RedisLock(redis, "w").holder() == {"raw": raw}
    redis.set(keys.lock("w"), json.dumps({"pid": 7}))  # no token, no host, no expiry
    assert RedisLock(redis, "w").holder() == {"pid": 7}
    with pytest.raises(LockError, match=r"^another process is working in this folder; .* "
                                        r"expires within 30 s$"):
        RedisLock(redis, "w").acquire()


@pytest.mark.parametrize(("days", "shown"), [(0, "%H:%M"), (3, "%Y-%m-%d %H:%M")])
def test_the_holders_message_says_since_when(redis: redis_py.Redis, days: int,
                                             shown: str) -> None:
    started = time.time() - days * 86400
    redis.set(keys.lock("w"), json.dumps({"token": "t", "pid": 7, "host": "h",
                                          "started": started}), px=5000)
    with pytest.raises(LockError) as err:
        RedisLock(redis, "w").acquire()
    since = time.strftime(shown, time.localtime(started))
    assert f"(pid 7 on host h, since {since}) is working" in str(err.value)
    assert "expires within 5 s" in str(err.value)
