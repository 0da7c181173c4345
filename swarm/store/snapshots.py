"""Workspace snapshots in Redis: content-addressed git bundles, stored in chunks.

A snapshot's id is the git commit it carries (a seed: a commit of the whole workspace
tree without parents; a state: a commit over a seed, stored as a delta bundle of the
objects the seed lacks). The same workspace snapshotted twice has the same id and is
stored once. Chunks and the record live :data:`~swarm.store.keys.SNAPSHOT_TTL`, pushed
on at every read, longer than the runs that start from them. Which hosts hold a
snapshot (and how many bytes each fetched) is counted here too, so a benchmark or a
test can tell that a host fetched it once, or never.

A snapshot may be stored as a delta over another (its ``base``): a child's work over its
seed, and a seed over the previous seed of the same folder, so a second fan-out from a
repository stores and moves only what changed. A host that lacks the base fetches it
first; chains are at most :data:`MAX_CHAIN` deep, and a delta's base lives as long as
the delta (both pushed on together).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import cast

import redis

from swarm.errors import SnapshotTooLarge, WorkspaceLost
from swarm.store import keys
from swarm.text import human_bytes

#: Deltas over deltas at most: a longer chain stores the whole snapshot again.
MAX_CHAIN = 8

_PUT = """
-- KEYS: record, swarm counters, hosts, chunk 0..n-1
-- ARGV: ttl, swarm cap (0: none), origin host, 12 x (field, value) of the record, chunks
-- 1 stored, 0 stored already, -(stored bytes + 1) when the swarm's cap would be passed.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local ttl, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local size = tonumber(ARGV[5])
local stored = tonumber(redis.call('HGET', KEYS[2], 'snapshot_bytes') or '0')
if cap > 0 and stored + size > cap then return -(stored + 1) end
local first = 28
for i = 4, #KEYS do redis.call('SET', KEYS[i], ARGV[first + i - 4], 'EX', ttl) end
redis.call('HSET', KEYS[1], unpack(ARGV, 4, first - 1))
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('HSET', KEYS[3], ARGV[3], 0)
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('HINCRBY', KEYS[2], 'snapshot_bytes', size)
return 1
"""
"""One script (not a WATCH transaction: the swarm's counters change with every child's
progress, and 500 children settling at once retried it over and over)."""


@dataclass(frozen=True)
class SnapshotMeta:
    """A stored snapshot's record (see :func:`swarm.store.keys.snapshot`)."""

    id: str
    size: int
    chunks: int
    sha256: str
    base: str = ""
    files: int = 0
    origin: str = ""
    odb: str = ""
    local: str = ""
    subdir: str = ""
    preface: str = ""
    """What a child's system prompt reads of its files, as JSON (``listing``,
    ``instructions``): a seed's, so its children ask the model while their files arrive
    ("": they wait for them)."""
    lineage: str = ""
    """The folder it is a snapshot of (a hash; a delta's is its base's): a host keeps the
    snapshots it fetched in one repository per lineage ("": one from before lineages)."""

    @classmethod
    def from_hash(cls, snapshot_id: str, row: dict[str, str]) -> SnapshotMeta | None:
        if not row or "chunks" not in row:
            return None
        return cls(snapshot_id, int(row.get("size") or 0), int(row["chunks"]),
                   row.get("sha256", ""), row.get("base", ""), int(row.get("files") or 0),
                   row.get("origin", ""), row.get("odb", ""), row.get("local", ""),
                   row.get("subdir", ""), row.get("preface", ""), row.get("lineage", ""))


def binary_client(redis_: redis.Redis) -> redis.Redis:
    """A client on the same server as ``redis_`` that returns bytes (the store's clients
    decode replies as text; a bundle is binary)."""
    pool = redis_.connection_pool
    kwargs = {**pool.connection_kwargs, "decode_responses": False}
    return redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool.connection_class, max_connections=pool.max_connections,
        **kwargs))


class SnapshotStore:
    """Put, get and count snapshots; ``swarm_cap`` bounds what one swarm stores."""

    def __init__(self, redis_: redis.Redis, ttl: int = keys.SNAPSHOT_TTL,
                 chunk: int = keys.SNAPSHOT_CHUNK) -> None:
        self.redis = redis_
        self.raw = binary_client(redis_)
        self.ttl = ttl
        self.chunk = chunk
        self._put = redis_.register_script(_PUT)

    def meta(self, snapshot_id: str) -> SnapshotMeta | None:
        return SnapshotMeta.from_hash(snapshot_id, cast(
            "dict[str, str]", self.redis.hgetall(keys.snapshot(snapshot_id))))

    def exists(self, snapshot_id: str) -> bool:
        """Whether it is stored; its TTL is pushed on (a seed reused by a later call)."""
        meta = self.meta(snapshot_id)
        if meta is None:
            return False
        self._touch(meta)
        return True

    def depth(self, snapshot_id: str) -> int | None:
        """How many snapshots the one stored as ``snapshot_id`` needs, itself included (1:
        a whole one), every one of them pushed on; None when one of them is gone."""
        meta, found = self.meta(snapshot_id), 0
        while meta is not None:
            found += 1
            self._touch(meta, chain=False)
            if not meta.base or found > MAX_CHAIN:
                return found
            meta = self.meta(meta.base)
        return None

    def put(self, meta: SnapshotMeta, data: bytes, swarm_id: str, swarm_cap: int) -> bool:
        """Store ``data`` under ``meta.id`` and count its bytes against the swarm, in one
        script; False when it was stored already (nothing counted). Raises
        :class:`SnapshotTooLarge` when the swarm would pass ``swarm_cap`` bytes."""
        parts = [data[i:i + self.chunk] for i in range(0, len(data), self.chunk)] or [b""]
        stored = int(self._put(
            keys=[keys.snapshot(meta.id), keys.swarm_counters(swarm_id),
                  keys.snapshot_hosts(meta.id),
                  *(keys.snapshot_chunk(meta.id, i) for i in range(len(parts)))],
            args=[self.ttl, swarm_cap, meta.origin,
                  "size", len(data), "chunks", len(parts),
                  "sha256", hashlib.sha256(data).hexdigest(), "base", meta.base,
                  "files", meta.files, "origin", meta.origin, "odb", meta.odb,
                  "local", meta.local, "subdir", meta.subdir, "preface", meta.preface,
                  "lineage", meta.lineage, "created", f"{time.time():.3f}",
                  *parts]))
        if stored < 0:
            raise SnapshotTooLarge(
                f"this swarm has stored {human_bytes(-stored - 1)} of workspace snapshots and "
                f"this one needs {human_bytes(len(data))} more; the cap is "
                f"{human_bytes(swarm_cap)} (SWARM_SNAPSHOT_SWARM_MAX). Add ignores to "
                ".swarmignore (or .gitignore), raise SWARM_SNAPSHOT_SWARM_MAX, or call "
                "agent with seed=false for children that start empty")
        return stored == 1

    def get(self, snapshot_id: str) -> tuple[SnapshotMeta, bytes]:
        """The snapshot's record and bundle; :class:`WorkspaceLost` when it is gone or its
        chunks do not add up (expired, evicted, flushed)."""
        meta = self.meta(snapshot_id)
        if meta is None:
            raise WorkspaceLost(f"snapshot {snapshot_id[:12]} is not in the store (expired "
                                "or flushed)")
        with self.raw.pipeline(transaction=False) as pipe:
            for i in range(meta.chunks):
                pipe.get(keys.snapshot_chunk(snapshot_id, i))
            parts = pipe.execute()
        if any(p is None for p in parts):
            raise WorkspaceLost(f"snapshot {snapshot_id[:12]} lost chunks in the store")
        data = b"".join(cast("list[bytes]", parts))
        if len(data) != meta.size or hashlib.sha256(data).hexdigest() != meta.sha256:
            raise WorkspaceLost(f"snapshot {snapshot_id[:12]} is corrupt in the store")
        self._touch(meta)
        return meta, data

    def fetched(self, snapshot_id: str, host: str, nbytes: int) -> None:
        """``host`` now holds the snapshot, having fetched ``nbytes`` for it."""
        key = keys.snapshot_hosts(snapshot_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hincrby(key, host, nbytes)
            pipe.expire(key, self.ttl)
            pipe.execute()

    def hosts(self, snapshot_id: str) -> dict[str, int]:
        """Hosts that hold the snapshot, and the bytes each fetched."""
        row = cast("dict[str, str]", self.redis.hgetall(keys.snapshot_hosts(snapshot_id)))
        return {host: int(n) for host, n in row.items()}

    def _touch(self, meta: SnapshotMeta, chain: bool = True) -> None:
        """Push on the TTL of ``meta``'s snapshot and (``chain``) of those it is a delta
        over: a base never expires before its delta."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(keys.snapshot(meta.id), self.ttl)
            pipe.expire(keys.snapshot_hosts(meta.id), self.ttl)
            for i in range(meta.chunks):
                pipe.expire(keys.snapshot_chunk(meta.id, i), self.ttl)
            pipe.execute()
        if chain and meta.base:
            self.depth(meta.base)
