"""RedisLock against a real server, across threads and processes."""

from __future__ import annotations

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

import pytest
import redis as redis_py

import swarm
from swarm.errors import LockError
from swarm.store import keys
from swarm.store.locks import RedisLock
from tests.helpers import wait_until

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
    assert info is not None and "token" not in info
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
    b.acquire()
    assert b.held
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
    assert a.lost and not a.held
    assert redis.pttl(keys.lock("w")) > 20_000  # a's renewal did not touch b's lock
    assert a.release() is False
    assert b.holder() is not None and b.held
    assert b.release() is True
