"""A Redis lock that says who holds it, renews itself, and never frees someone else's.

The lock's value is a JSON object: a random token plus the holder's info (host, pid,
started, and whatever ``owner_info`` adds), set atomically with ``SET NX PX``. Renewal
and release compare the whole value in a Lua script, so a holder whose lock expired
(and was taken by another) can neither extend nor delete the new holder's lock.

A second key, the lock's *fence* (:func:`~swarm.store.keys.lock_fence`), holds the value of
its last holder. A holder whose lock expired while nobody else took it (its process was
stopped or its laptop asleep past the ttl; Redis was away that long) takes it back at its
next renewal: the fence still holds its value only if no other process acquired the lock
meanwhile, so what it guards was not written by anyone else.

Given an :class:`~swarm.store.connection.Outage` (a root in a terminal), :meth:`RedisLock.check`
and :meth:`RedisLock.release` wait for a Redis that stopped answering to come back; the
renewal thread keeps trying on its own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import redis

from swarm import faults
from swarm.errors import LockError
from swarm.store import keys
from swarm.store.connection import Outage, ride, store_errors

log = logging.getLogger(__name__)

_FENCE_MS = keys.LOCK_FENCE_TTL * 1000

# KEYS: the lock, its fence. ARGV: the holder's value, the lock's ttl and the fence's (ms).
_ACQUIRE = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('set', KEYS[2], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""

# 1: renewed; 2: it had expired and nobody took it since, so it is taken back; 0: lost.
_RENEW = """
local held = redis.call('get', KEYS[1])
if held == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  redis.call('pexpire', KEYS[2], ARGV[3])
  return 1
end
if held == false and redis.call('get', KEYS[2]) == ARGV[1] then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('pexpire', KEYS[2], ARGV[3])
  return 2
end
return 0
"""

_RELEASE = """
if redis.call('get', KEYS[2]) == ARGV[1] then
  redis.call('del', KEYS[2])
end
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class RedisLock:
    """A lock named ``name`` (key ``keys.lock(name)``) living ``ttl`` seconds unless renewed.

    While held, a daemon thread renews it every ``ttl/3``, taking it back if it expired
    and nobody took it since; if a renewal finds it taken by another, :attr:`lost` becomes
    True. Call :meth:`check` before writing what it guards. ``subject`` names what the
    lock guards in the :class:`LockError` message; with ``outage``, :meth:`check` and
    :meth:`release` ride out a Redis restart.
    """

    def __init__(
        self,
        redis: redis.Redis,
        name: str,
        ttl: float = keys.LOCK_TTL,
        owner_info: Mapping[str, Any] | None = None,
        *,
        blocking_timeout: float | None = None,
        subject: str = "this folder",
        outage: Outage | None = None,
    ) -> None:
        self.redis = redis
        self.name = name
        self.key = keys.lock(name)
        self.fence = keys.lock_fence(name)
        self.ttl = ttl
        self.owner_info = dict(owner_info or {})
        self.blocking_timeout = blocking_timeout
        self.subject = subject
        self.outage = outage
        self._ttl_ms = max(1, int(ttl * 1000))
        self._value: str | None = None
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = (0.0, 0.0)  # monotonic and wall time of the last renewal
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    @property
    def held(self) -> bool:
        """True between a successful :meth:`acquire` and :meth:`release`, unless lost."""
        return self._value is not None and not self._lost.is_set()

    @property
    def lost(self) -> bool:
        """True once a renewal found the lock taken by another holder since it expired."""
        return self._lost.is_set()

    def acquire(self, blocking_timeout: float | None = None) -> None:
        """Take the lock, waiting up to ``blocking_timeout`` s (default: the constructor's;
        None = do not wait). Raises :class:`LockError` naming the holder."""
        if self._value is not None:
            raise RuntimeError(f"lock {self.name!r} is already acquired by this object")
        timeout = self.blocking_timeout if blocking_timeout is None else blocking_timeout
        deadline = time.monotonic() + (timeout or 0.0)
        value = json.dumps({
            "token": secrets.token_hex(16),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            **self.owner_info,
        })
        while True:
            sent = (time.monotonic(), time.time())
            with store_errors(f"taking the lock {self.name}"):
                if self._acquire(keys=[self.key, self.fence],
                                 args=[value, self._ttl_ms, _FENCE_MS]):
                    break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockError(self._held_message())
            time.sleep(min(0.05, remaining))
        self._value = value
        self._renewed = sent
        self._lost.clear()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._renew_loop, args=(value,), name=f"lock-renew:{self.name}", daemon=True
        )
        self._thread.start()

    def release(self) -> bool:
        """Stop renewing and delete the lock if it is still ours; True if it was deleted."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        value = self._value
        if value is None:
            return False

        def release() -> bool:
            with store_errors(f"releasing the lock {self.name}"):
                return bool(self._release(keys=[self.key, self.fence], args=[value]))

        released = ride(self.outage, release)  # deletes only its own value: safe to repeat
        self._value = None
        return released

    def holder(self) -> dict[str, Any] | None:
        """The current holder's info (without its token), or None when the lock is free."""
        with store_errors(f"reading the lock {self.name}"):
            raw = self.redis.get(self.key)
        if raw is None:
            return None
        try:
            info = json.loads(raw)
        except ValueError:
            return {"raw": raw}
        if not isinstance(info, dict):
            return {"raw": raw}
        info.pop("token", None)
        return info

    def _held_message(self) -> str:
        with store_errors(f"reading the lock {self.name}"), self.redis.pipeline() as pipe:
            pipe.get(self.key)
            pipe.pttl(self.key)
            raw, pttl = pipe.execute()
        if raw is None:
            return f"the lock on {self.subject} was released just now; try again"
        try:
            info = json.loads(raw)
            who = (
                f"another swarm process (pid {info['pid']} on host {info['host']}, "
                f"since {_clock(float(info['started']))})"
            )
        except (ValueError, KeyError, TypeError):
            who = "another process"
        expires = math.ceil(pttl / 1000) if pttl and pttl > 0 else math.ceil(self.ttl)
        return (
            f"{who} is working in {self.subject}; wait for it or work in another folder; "
            f"a crashed holder's lock expires within {expires} s"
        )

    def check(self) -> bool:
        """True while the lock is held. When its last renewal is older than a third of its
        ttl (this process was stopped, or its machine asleep, since), renew it now, taking
        it back if nobody took it meanwhile: the renewal thread may not have run yet."""
        value = self._value
        if value is None or self._lost.is_set():
            return False
        if self._younger_than(self._ttl_ms / 3000):
            return True
        # With an outage, it waits for Redis to answer: the fence then tells whether the
        # lock was taken meanwhile (False) or is still, or again, its own.
        return ride(self.outage, lambda: self._checked(value))

    def _checked(self, value: str) -> bool:
        try:
            # An answer that came late (the process stopped after Redis renewed) is asked
            # again: the lock could have expired and been taken meanwhile.
            for _ in range(3):
                if not self._renew_once(value) or self._younger_than(self.ttl / 2):
                    break
            return not self._lost.is_set() and self._younger_than(self.ttl / 2)
        except redis.RedisError as exc:
            if self.outage is None and self._younger_than(self.ttl):
                return True  # it cannot have expired yet: what writes next meets the outage
            with store_errors(f"renewing the lock {self.name}"):
                raise exc  # unknown until Redis answers: nothing is written meanwhile

    def _younger_than(self, seconds: float) -> bool:
        """The last renewal was sent less than ``seconds`` ago, by both clocks (the
        monotonic one stops while the machine sleeps)."""
        mono, wall = self._renewed
        return time.monotonic() - mono < seconds and abs(time.time() - wall) < seconds

    def _renew_once(self, value: str) -> bool:
        # Timed from the request: a process stopped before it read the answer must not
        # count the lock as renewed from when it woke.
        sent = (time.monotonic(), time.time())
        renewed = self._renew(keys=[self.key, self.fence], args=[value, self._ttl_ms, _FENCE_MS])
        if renewed == 2:
            log.warning("lock %s: it expired while this process was stopped or Redis was "
                        "away, and nobody took it since: taken back", self.name)
        if renewed:
            self._renewed = sent
            return True
        self._lost.set()
        log.warning("lock %s: lost (taken by another process after it expired)", self.name)
        return False

    def _renew_loop(self, value: str) -> None:
        interval = self._ttl_ms / 3000
        while not self._stop.wait(interval):
            faults.point("lock-renewal")
            try:
                if not self._renew_once(value):
                    return
            except redis.RedisError as exc:
                # Keep trying: unless another process takes the lock meanwhile, it is
                # taken back when Redis answers again.
                log.warning("lock %s: renewal failed (%s); retrying", self.name, exc)

    def __enter__(self) -> RedisLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _clock(ts: float) -> str:
    """``12:01`` today, ``2025-01-31 12:01`` on another day."""
    then = time.localtime(ts)
    same_day = time.strftime("%Y-%m-%d", then) == time.strftime("%Y-%m-%d")
    return time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", then)
