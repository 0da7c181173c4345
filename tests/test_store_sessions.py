"""RedisSessionStore against a real server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis as redis_py

from swarm.domain.history import INTERRUPTED
from swarm.domain.session import Session
from swarm.errors import StoreUnavailableError
from swarm.store import keys, sessions
from swarm.store.connection import Outage, connect
from swarm.store.mailbox import Mailbox
from swarm.store.server import EmbeddedServer
from swarm.store.sessions import RedisSessionStore
from tests.helpers import round_trips


def make(sid: str, updated: float, messages: list[dict[str, object]] | None = None) -> Session:
    return Session(
        id=sid,
        workspace=f"/work/{sid}",
        messages=messages if messages is not None else [{"role": "user", "content": "héllo"}],
        usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        created=updated - 10,
        updated=updated,
        turns=2,
    )


def test_round_trip(redis: redis_py.Redis) -> None:
    store = RedisSessionStore(redis)
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "do it"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "run_cli", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a\nb\n[exit code: 0]"},
        {"role": "assistant", "content": "done ✓"},
    ]
    session = make("s1", 1000.0, messages)
    store.save(session)
    loaded = store.load("s1")
    assert loaded is not None
    assert loaded.messages == messages
    assert (loaded.id, loaded.workspace, loaded.usage, loaded.created, loaded.updated,
            loaded.turns) == ("s1", "/work/s1", session.usage, 990.0, 1000.0, 2)
    assert loaded.repairs == []
    assert store.load("nope") is None
    assert store.size_bytes("s1") > len(json.dumps(messages))
    assert store.size_bytes("nope") == 0


def test_save_replaces_whole_and_refreshes_ttl(redis: redis_py.Redis) -> None:
    store = RedisSessionStore(redis, ttl=100, refresh=0)
    store.save(make("s1", 1.0))
    redis.expire(keys.session("s1"), 5)
    store.save(make("s1", 2.0, [{"role": "user", "content": "second"}]))
    assert 90 < redis.ttl(keys.session("s1")) <= 100
    assert sorted(redis.hkeys(keys.session("s1"))) == ["messages", "meta"]
    loaded = store.load("s1")
    assert loaded is not None and loaded.messages == [{"role": "user", "content": "second"}]
    assert redis.zscore(keys.sessions_index(), "s1") == 2.0


def test_saves_soon_after_a_refresh_send_no_expire_but_a_key_made_again_gets_its_ttl(
        redis: redis_py.Redis) -> None:
    store = RedisSessionStore(redis, ttl=1000, refresh=60)
    store.save(make("s1", 1.0))
    assert 990 < redis.ttl(keys.session("s1")) <= 1000
    redis.expire(keys.session("s1"), 500)
    before = redis.info("commandstats").get("cmdstat_expire", {}).get("calls", 0)
    store.save(make("s1", 2.0))  # within a minute of the refresh: no EXPIRE
    assert redis.info("commandstats").get("cmdstat_expire", {}).get("calls", 0) == before
    assert 490 < redis.ttl(keys.session("s1")) <= 500
    redis.delete(keys.session("s1"))
    store.save(make("s1", 3.0))  # the key was gone: made again, with its TTL
    assert 990 < redis.ttl(keys.session("s1")) <= 1000
    RedisSessionStore(redis, ttl=1000, refresh=60).save(make("s2", 1.0))
    redis.expire(keys.session("s2"), 500)
    RedisSessionStore(redis, ttl=1000, refresh=60).save(make("s2", 2.0))  # another store
    assert 990 < redis.ttl(keys.session("s2")) <= 1000


def test_list_most_recent_first_and_prunes_expired(redis: redis_py.Redis) -> None:
    store = RedisSessionStore(redis)
    now = time.time()
    for sid, updated in (("old", now - 50), ("new", now), ("mid", now - 20), ("gone", now - 1)):
        store.save(make(sid, updated))
    redis.delete(keys.session("gone"))  # as if its TTL ran out
    assert [s.id for s in store.list()] == ["new", "mid", "old"]
    assert redis.zrange(keys.sessions_index(), 0, -1) == ["old", "mid", "new"]


def test_dangling_tool_call_is_repaired_at_load(redis: redis_py.Redis) -> None:
    store = RedisSessionStore(redis)
    call = {"id": "c9", "type": "function", "function": {"name": "run_cli", "arguments": "{}"}}
    crashed = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    store.save(make("s1", 1.0, crashed))
    loaded = store.load("s1")
    assert loaded is not None
    assert loaded.messages[-1] == {"role": "tool", "tool_call_id": "c9", "content": INTERRUPTED}
    assert len(loaded.repairs) == 1 and "c9" in loaded.repairs[0]


def test_delete_and_clear(redis: redis_py.Redis) -> None:
    store = RedisSessionStore(redis)
    for i in range(3):
        store.save(make(f"s{i}", float(i)))
    redis.set("other:key", "kept")
    assert store.delete("s0") is True
    assert store.delete("s0") is False
    redis.zrem(keys.sessions_index(), "s2")  # an unindexed session is cleared too
    assert store.clear() == 2
    assert store.list() == []
    assert redis.exists(keys.sessions_index(), keys.session("s1"), keys.session("s2")) == 0
    assert redis.get("other:key") == "kept"


def test_a_save_riding_out_an_outage_fails_past_its_window_saying_so(tmp_path: Path) -> None:
    """A root's save waits for a Redis that stopped answering, with one line when it
    starts, and past the outage's window fails with the clear error; the fence was
    checked before every try."""
    server = EmbeddedServer(tmp_path)
    client = connect(server.ensure())
    said: list[str] = []
    fenced: list[int] = []
    store = RedisSessionStore(client, outage=Outage("the test's Redis", 0.3, said.append),
                              fence=lambda: fenced.append(1))
    store.save(make("s1", 1000.0))
    server.stop()
    try:
        with pytest.raises(StoreUnavailableError, match=r"did not answer for .* check that it"):
            store.save(make("s1", 1001.0))
    finally:
        client.close()
    assert said == [said[0]] and "stopped answering" in said[0] and "up to 0.3 s" in said[0]
    assert len(fenced) > 2


def test_a_workers_turn_boundary_hears_the_mailbox_read_with_the_save_before_it(
        redis: redis_py.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's store (``mail``) reads the agent's mailbox in the round trip of each save
    a turn boundary follows (not while calls wait for results), so the boundary costs none;
    once, and only while fresh: a message sent after that save is heard at the next
    boundary, none lost, none twice."""
    store = RedisSessionStore(redis, index=False, mail=True)
    mailbox = Mailbox(redis, "a1", sessions=store)
    first = redis.xadd(keys.mailbox("a1"), {"text": "one"})
    session = make("a1", 1.0)
    trips = round_trips(monkeypatch)
    store.save(session)
    assert mailbox.unread("") == [(first, "one")]
    assert trips == ["pipeline of 3"]  # HSET, EXPIRE (a new key), XRANGE
    second = redis.xadd(keys.mailbox("a1"), {"text": "two"})
    trips.clear()
    assert mailbox.unread("") == [(first, "one"), (second, "two")]  # read once: now again
    session.said = first
    store.save(session)
    assert mailbox.unread(first) == [(second, "two")]
    assert trips == ["XRANGE", "pipeline of 2"]
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "run_cli", "arguments": "{}"}} for i in (1, 2)]
    session.messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    trips.clear()
    store.save(session)  # no turn boundary before the calls' results: no read
    session.messages.append({"role": "tool", "tool_call_id": "c1", "content": "ok"})
    store.save(session)
    session.messages.append({"role": "tool", "tool_call_id": "c2", "content": "ok"})
    store.save(session)  # a boundary next
    assert trips == ["pipeline of 1", "pipeline of 1", "pipeline of 2"]
    assert mailbox.unread(first) == [(second, "two")]
    assert trips == ["pipeline of 1", "pipeline of 1", "pipeline of 2"]
    store.save(session)
    monkeypatch.setattr(sessions, "MAIL_FRESH", 0.0)
    trips.clear()
    assert mailbox.unread(first) == [(second, "two")]  # too old: read again
    assert trips == ["XRANGE"]
