"""TTLCache: values trusted for a time, the oldest dropped first, one load per stale key."""

from __future__ import annotations

import functools
import threading

import pytest

from swarm.cache import TTLCache


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_value_is_fresh_for_its_ttl_then_unknown() -> None:
    clock = Clock()
    cache: TTLCache[str, int] = TTLCache(10, clock=clock)
    assert cache.get("a") is None
    cache.put("a", 1)
    clock.now += 9.9
    assert cache.get("a") == 1
    clock.now += 0.1
    assert cache.get("a") is None


def test_get_or_load_loads_once_while_fresh_and_again_when_stale() -> None:
    clock = Clock()
    cache: TTLCache[str, int] = TTLCache(10, clock=clock)
    loads: list[int] = []

    def load() -> int:
        loads.append(len(loads) + 1)
        return loads[-1]

    assert [cache.get_or_load("k", load) for _ in range(3)] == [1, 1, 1]
    clock.now += 10
    assert cache.get_or_load("k", load) == 2
    assert loads == [1, 2]


def test_a_failed_load_raises_and_stores_nothing() -> None:
    cache: TTLCache[str, int] = TTLCache(10, clock=Clock())

    def fail() -> int:
        raise OSError("unreachable")

    with pytest.raises(OSError, match="unreachable"):
        cache.get_or_load("k", fail)
    assert cache.get("k") is None and len(cache) == 0


def test_add_keeps_a_fresh_value_and_its_age() -> None:
    """What a client learnt from the cache, added back, must not make itself fresh again."""
    clock = Clock()
    cache: TTLCache[str, int] = TTLCache(10, clock=clock)
    assert cache.add("ctx", 8192)
    clock.now += 6
    assert not cache.add("ctx", 8192)
    clock.now += 4
    assert cache.get("ctx") is None  # 10 s after the first add, not the second
    assert cache.add("ctx", 4096)
    assert cache.get("ctx") == 4096


def test_a_full_cache_drops_the_stale_then_the_oldest_not_everything() -> None:
    clock = Clock()
    cache: TTLCache[str, int] = TTLCache(10, maxsize=3, clock=clock)
    cache.put("old", 0)
    clock.now += 10  # "old" is stale now
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)  # full: the stale entry goes first
    assert (len(cache), cache.get("a"), cache.get("b"), cache.get("c")) == (3, 1, 2, 3)
    cache.put("a", 11)  # rewritten: now the newest
    cache.put("d", 4)  # full of fresh ones: the oldest written ("b") goes, only it
    assert [cache.get(k) for k in "abcd"] == [11, None, 3, 4]


def test_while_one_thread_loads_a_stale_key_the_others_keep_the_old_value() -> None:
    clock = Clock()
    cache: TTLCache[str, str] = TTLCache(1, clock=clock)
    cache.put("gate", "old")
    clock.now += 1
    loading, release = threading.Event(), threading.Event()

    def slow() -> str:
        loading.set()
        assert release.wait(30)
        return "new"

    got: list[str] = []
    loader = threading.Thread(target=lambda: got.append(cache.get_or_load("gate", slow)))
    loader.start()
    try:
        assert loading.wait(30)

        def refuse() -> str:
            raise AssertionError("a second load of a key already being loaded")

        assert cache.get_or_load("gate", refuse) == "old"
    finally:
        release.set()
        loader.join(30)
    assert got == ["new"]
    assert cache.get("gate") == "new"


def double(n: int) -> int:
    return n * 2


def test_many_threads_keep_it_bounded_and_consistent() -> None:
    cache: TTLCache[int, int] = TTLCache(60, maxsize=50)
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for i in range(2000):
                key = (i * 7 + offset) % 200
                assert cache.get_or_load(key, functools.partial(double, key)) == key * 2
                cache.put(key, key * 2)
                got = cache.get(key)
                assert got is None or got == key * 2
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert 0 < len(cache) <= 50


def test_nonsense_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        TTLCache(0)
    with pytest.raises(ValueError, match="positive"):
        TTLCache(1, maxsize=0)
