"""HomeHints: hints.md written atomically, mirrored in Redis; SwarmHints add to them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis as redis_py
from redis.backoff import NoBackoff
from redis.retry import Retry

from swarm.errors import StoreUnavailableError
from swarm.store import keys
from swarm.store.hints import HomeHints


def test_save_writes_file_and_redis(redis: redis_py.Redis, tmp_path: Path) -> None:
    store = HomeHints(redis, tmp_path)
    assert store.load() == ""
    store.save("use uv, not pip\nünïcode")
    assert (tmp_path / "hints.md").read_text(encoding="utf-8") == "use uv, not pip\nünïcode"
    assert redis.get(keys.hints("global")) == "use uv, not pip\nünïcode"
    store.save("second")
    assert store.load() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hints.md"]  # no temp file left


def test_redis_value_wins_and_file_is_the_fallback(redis: redis_py.Redis, tmp_path: Path) -> None:
    store = HomeHints(redis, tmp_path)
    store.save("from file")
    redis.set(keys.hints("global"), "from another host")
    assert store.load() == "from another host"
    redis.delete(keys.hints("global"))
    assert store.load() == "from file"


def test_scopes_are_separate(redis: redis_py.Redis, tmp_path: Path) -> None:
    HomeHints(redis, tmp_path).save("global hints")
    team = HomeHints(redis, tmp_path, scope="team/a")
    assert team.load() == ""
    team.save("team hints")
    assert team.path == tmp_path / "hints-team_a.md"
    assert redis.get(keys.hints("team/a")) == "team hints"
    assert HomeHints(redis, tmp_path).load() == "global hints"


def test_unreachable_redis(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = redis_py.Redis(port=port, retry=Retry(NoBackoff(), 0), decode_responses=True)
    store = HomeHints(dead, tmp_path / "home")
    with pytest.raises(StoreUnavailableError, match="saving memory hints"):
        store.save("kept locally")
    assert store.load() == "kept locally"


def test_swarm_hints_add_to_the_users_and_never_replace_them(redis: redis_py.Redis,
                                                             tmp_path: Path) -> None:
    from swarm.store.hints import SWARM_HINTS_KEPT, SwarmHints

    base = HomeHints(redis, tmp_path)
    base.save("user hint: tests live in tests/")
    first = SwarmHints(redis, "s1", base, agent_id="a1")
    first.save("notes are in notes.md")
    SwarmHints(redis, "s1", base, agent_id="a2").save("the API is flaky; retry")
    seen = SwarmHints(redis, "s1", base).load()
    assert seen.startswith("user hint: tests live in tests/")
    assert "(from agent a1)\nnotes are in notes.md" in seen
    assert seen.index("a1") < seen.index("a2")
    assert base.load() == "user hint: tests live in tests/"
    assert SwarmHints(redis, "other", base).load() == "user hint: tests live in tests/"
    for i in range(SWARM_HINTS_KEPT + 5):
        first.save(f"hint {i}")
    kept = SwarmHints(redis, "s1", base).load()
    assert f"hint {SWARM_HINTS_KEPT + 4}" in kept and "notes are in notes.md" not in kept
