"""A small thread-safe cache whose entries go stale after a time to live.

For what a process may trust for a while instead of asking Redis or a model endpoint each
time (a swarm's settings, a model's context length, a rate gate's closing time). Entries
are kept in the order they were written, so the stale ones are the oldest: writing to a
full cache drops those, then the oldest fresh ones, never more than it must.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """Values by key, each trusted for ``ttl`` seconds after it was written.

    ``maxsize`` bounds the entries; ``clock`` (seconds, monotonic) is for tests. ``None``
    is not a value it can hold: :meth:`get` answers ``None`` for "unknown or stale".
    """

    def __init__(self, ttl: float, maxsize: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl <= 0 or maxsize <= 0:
            raise ValueError("a TTLCache needs a positive ttl and maxsize")
        self.ttl, self.maxsize, self.clock = ttl, maxsize, clock
        self._items: dict[K, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key: K) -> V | None:
        """The value of ``key`` if it is fresh, else None."""
        with self._lock:
            found = self._items.get(key)
            if found is None or self.clock() - found[0] >= self.ttl:
                return None
            return found[1]

    def put(self, key: K, value: V) -> None:
        """Store ``value`` for ``key``, fresh from now."""
        with self._lock:
            self._store(key, value)

    def add(self, key: K, value: V) -> bool:
        """Store ``value`` unless ``key`` has a fresh value (whose age then keeps counting);
        True when it was stored."""
        with self._lock:
            found = self._items.get(key)
            if found is not None and self.clock() - found[0] < self.ttl:
                return False
            self._store(key, value)
            return True

    def get_or_load(self, key: K, load: Callable[[], V]) -> V:
        """The fresh value of ``key``, else ``load()``'s (stored; its exception is raised
        and nothing stored).

        While one thread loads a stale key, the others asking for it get the stale value
        instead of loading too (it is marked fresh for them until the load is done).
        """
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                if self.clock() - found[0] < self.ttl:
                    return found[1]
                self._store(key, found[1])
        value = load()
        self.put(key, value)
        return value

    def discard(self, key: K) -> None:
        with self._lock:
            self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def _store(self, key: K, value: V) -> None:
        """Write under the lock: the newest entry goes last, so the oldest go first."""
        now = self.clock()
        self._items.pop(key, None)
        items = self._items
        while items:
            oldest = next(iter(items))
            if len(items) < self.maxsize and now - items[oldest][0] < self.ttl:
                break
            del items[oldest]
        items[key] = (now, value)
