"""Sessions in Redis: one hash per session plus a sorted-set index by last update.

``load`` repairs a history a crash left invalid (a tool call with no result): the
returned :class:`LoadedSession` lists what was repaired in ``repairs`` (empty when
nothing was), and a warning is logged.
"""

from __future__ import annotations

import builtins
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from swarm.domain import history
from swarm.domain.session import Session
from swarm.errors import StoreError
from swarm.store import keys
from swarm.store.connection import Outage, ride, store_errors

log = logging.getLogger(__name__)

#: Seconds at most between a store's refreshes of a saved session's TTL (a hundredth of the
#: TTL when that is shorter): the session lives at least its TTL less this after its last save.
REFRESH = 60.0
#: Sessions whose last refresh a store remembers (forgotten all at once past it).
REFRESHED_MAX = 10_000
#: Seconds a mailbox read with a save stands for a read at the next turn boundary (which
#: follows the save at once; a later boundary reads again).
MAIL_FRESH = 1.0


@dataclass
class LoadedSession(Session):
    """A session as loaded: ``repairs`` describes the pairing problems fixed at load."""

    repairs: list[str] = field(default_factory=list)


class RedisSessionStore:
    """:class:`swarm.agent.protocols.SessionStore` on Redis; a save refreshes the TTL (at
    most every :attr:`refresh` seconds per store and session)."""

    def __init__(self, redis: redis.Redis, ttl: int = keys.SESSION_TTL,
                 index: bool = True, outage: Outage | None = None,
                 fence: Callable[[], None] | None = None,
                 refresh: float | None = None, mail: bool = False) -> None:
        self.redis = redis
        self.ttl = ttl
        self.refresh = min(REFRESH, ttl / 100) if refresh is None else refresh
        """Seconds a save's TTL refresh holds for this store: a save sooner after it sends
        no EXPIRE (a running agent saves every few seconds; each EXPIRE is a command)."""
        self._refreshed: dict[str, float] = {}
        self.index = index
        """List saved sessions in ``swarm sessions`` (children of a swarm are not)."""
        self.outage = outage
        """Rides out a Redis restart in :meth:`save` and :meth:`load` (a root in a terminal);
        None: they fail at once."""
        self.fence = fence
        """Called before every try of :meth:`save`; raises to stop a save whose session lock
        was lost (a try after an outage must not overwrite another process's work)."""
        self.mail = mail
        """Read the agent's unread messages (``swarm say``) in the round trip of each save
        a turn boundary follows (none while calls wait for results): the agent's loop
        reads them there (:meth:`unread_mail`)."""
        self._mail: dict[str, tuple[str, float, list[Any]]] = {}

    def save(self, session: Session) -> None:
        """Replace the stored session whole, index it by ``session.updated``, refresh its TTL
        (unless this store did less than :attr:`refresh` seconds ago and the key was there)."""

        def save() -> None:
            if self.fence is not None:
                self.fence()
            now = time.monotonic()
            refresh = now - self._refreshed.get(session.id, -math.inf) >= self.refresh
            # One HSET replaces both fields at once; no MULTI needed (one round trip).
            with store_errors(f"saving session {session.id}"), \
                    self.redis.pipeline(transaction=False) as pipe:
                write_session(pipe, session, self.ttl if refresh else None, self.index)
                mail = self.mail and not calls_open(session.messages)
                if mail:
                    pipe.xrange(keys.mailbox(session.id), stream_after(session.said), "+")
                replies = pipe.execute()
                if not refresh and replies[0]:  # deleted meanwhile: made again, with no TTL
                    self.redis.expire(keys.session(session.id), self.ttl)
            if mail:
                if len(self._mail) >= REFRESHED_MAX:
                    self._mail.clear()
                self._mail[session.id] = (session.said, time.monotonic(), replies[-1])
            if refresh:
                if len(self._refreshed) >= REFRESHED_MAX:
                    self._refreshed.clear()
                self._refreshed[session.id] = now

        ride(self.outage, save)  # replaces it whole: safe to repeat

    def unread_mail(self, session_id: str, said: str) -> list[Any] | None:
        """The mailbox's entries after ``said`` as the session's last save read them (once,
        and within :data:`MAIL_FRESH` seconds of it); None: read them now."""
        got = self._mail.pop(session_id, None)
        if got is None or got[0] != said or time.monotonic() - got[1] > MAIL_FRESH:
            return None
        return got[2]

    def load(self, session_id: str) -> LoadedSession | None:
        """The session, with a dangling tool call repaired; None when absent or expired."""

        def read() -> list[Any]:
            with store_errors(f"loading session {session_id}"):
                return cast("list[Any]", self.redis.hmget(keys.session(session_id),
                                                          ["meta", "messages"]))

        row = ride(self.outage, read)
        # decode_responses=True: every value is a str (redis-py types it as bytes | str)
        meta, messages = cast("tuple[str | None, str | None]", tuple(row))
        return self.from_fields(session_id, meta, messages)

    @staticmethod
    def from_fields(session_id: str, meta: str | None,
                    messages: str | None) -> LoadedSession | None:
        """:meth:`load` of fields read elsewhere (a worker reads them with its claim)."""
        if meta is None:
            return None
        session = _decode(session_id, meta, messages)
        if session.repairs:
            log.warning("session %s: repaired at load: %s", session_id, "; ".join(session.repairs))
        return session

    def delete(self, session_id: str) -> bool:
        """Forget a session; True if it existed."""
        with store_errors(f"deleting session {session_id}"), self.redis.pipeline() as pipe:
            pipe.delete(keys.session(session_id))
            pipe.zrem(keys.sessions_index(), session_id)
            deleted, _ = pipe.execute()
        return bool(deleted)

    def list(self) -> builtins.list[LoadedSession]:
        """Every stored session, most recently updated first; index entries of expired
        sessions are pruned, undecodable sessions skipped (with a warning)."""
        with store_errors("listing sessions"):
            ids = cast("builtins.list[str]", self.redis.zrevrange(keys.sessions_index(), 0, -1))
            if not ids:
                return []
            with self.redis.pipeline(transaction=False) as pipe:
                for sid in ids:
                    pipe.hmget(keys.session(sid), ["meta", "messages"])
                rows = pipe.execute()
            gone = [sid for sid, (meta, _) in zip(ids, rows, strict=True) if meta is None]
            if gone:
                self.redis.zrem(keys.sessions_index(), *gone)
        out = []
        for sid, (meta, messages) in zip(ids, rows, strict=True):
            if meta is None:
                continue
            try:
                out.append(_decode(sid, meta, messages))
            except StoreError as exc:
                log.warning("%s", exc)
        return out

    def clear(self) -> int:
        """Delete every session and the index; return how many sessions were deleted."""
        with store_errors("clearing sessions"):
            ids = cast("builtins.list[str]", self.redis.zrange(keys.sessions_index(), 0, -1))
            names = {keys.session(sid) for sid in ids}
            names.update(self.redis.scan_iter(match=keys.session("*"), count=500))
            deleted = 0
            batch = sorted(names)
            for i in range(0, len(batch), 500):
                deleted += int(self.redis.delete(*batch[i:i + 500]))
            self.redis.delete(keys.sessions_index())
        return deleted

    def size_bytes(self, session_id: str) -> int:
        """Memory the session takes in Redis (MEMORY USAGE, else its JSON length); 0 if absent."""
        key = keys.session(session_id)
        with store_errors(f"sizing session {session_id}"):
            try:
                used = self.redis.memory_usage(key)
                return int(used or 0)
            except redis.ResponseError:  # MEMORY disabled (some managed Redis services)
                with self.redis.pipeline(transaction=False) as pipe:
                    pipe.hstrlen(key, "meta")
                    pipe.hstrlen(key, "messages")
                    return sum(int(n) for n in pipe.execute())


@dataclass(frozen=True)
class SessionMeta:
    """A session's ``meta`` field: its figures without its messages (what a view reads
    of many sessions at once)."""

    id: str
    workspace: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0
    turns: int = 0
    parked: str = ""
    said: str = ""

    @classmethod
    def parse(cls, session_id: str, raw: str) -> SessionMeta:
        """The meta field's JSON; :class:`StoreError` when it is damaged."""
        try:
            meta = json.loads(raw)
            if not isinstance(meta, dict):
                raise ValueError("meta must be an object")
            return cls(id=session_id, workspace=str(meta.get("workspace", "")),
                       usage={k: int(v) for k, v in (meta.get("usage") or {}).items()},
                       created=float(meta.get("created", 0.0)),
                       updated=float(meta.get("updated", 0.0)),
                       turns=int(meta.get("turns", 0)), parked=str(meta.get("parked") or ""),
                       said=str(meta.get("said") or ""))
        except (ValueError, TypeError, AttributeError) as exc:
            raise _damaged(session_id, exc) from exc


def _damaged(session_id: str, exc: Exception) -> StoreError:
    return StoreError(
        f"session {session_id} in Redis is damaged ({exc}); delete it "
        f"(`swarm sessions` / DEL {keys.session(session_id)}) to start that folder afresh")


def _decode(session_id: str, meta_raw: str, messages_raw: str | None) -> LoadedSession:
    meta = SessionMeta.parse(session_id, meta_raw)
    try:
        messages: builtins.list[dict[str, Any]] = json.loads(messages_raw or "[]")
        if not isinstance(messages, builtins.list):
            raise ValueError("messages must be a list")
        found = [] if meta.parked else history.problems(messages)
        if found:
            messages = history.repair(messages)
    except (ValueError, TypeError, AttributeError) as exc:
        raise _damaged(session_id, exc) from exc
    return LoadedSession(id=session_id, workspace=meta.workspace, messages=messages,
                         usage=meta.usage, created=meta.created, updated=meta.updated,
                         turns=meta.turns, parked=meta.parked, said=meta.said, repairs=found)


def calls_open(messages: builtins.list[dict[str, Any]]) -> bool:
    """Whether calls of the last assistant message still wait for results (no turn
    boundary comes next)."""
    answered: set[str] = set()
    for message in reversed(messages):
        if message.get("role") != "tool":
            return message.get("role") == "assistant" and \
                not set(history.call_ids(message)) <= answered
        answered.add(str(message.get("tool_call_id")))
    return False


def stream_after(message_id: str) -> str:
    """XRANGE's start for the entries after ``message_id`` ("": all of them)."""
    return f"({message_id}" if message_id else "-"


def session_fields(session: Session) -> dict[str, str]:
    """The fields of a session's hash (``meta`` and ``messages``, both JSON)."""
    meta = {"id": session.id, "workspace": session.workspace, "created": session.created,
            "updated": session.updated, "usage": session.usage, "turns": session.turns,
            "parked": session.parked, "said": session.said}
    return {"meta": json.dumps(meta),
            "messages": json.dumps(session.messages, ensure_ascii=False)}


def write_session(pipe: Any, session: Session, ttl: int | None, index: bool) -> None:
    """Queue the writes of :meth:`RedisSessionStore.save` on ``pipe`` (a pipeline, or a
    transaction after MULTI): the HSET first; the EXPIRE unless ``ttl`` is None."""
    key = keys.session(session.id)
    pipe.hset(key, mapping=session_fields(session))
    if ttl is not None:
        pipe.expire(key, ttl)
    if index:
        pipe.zadd(keys.sessions_index(), {session.id: session.updated})
