"""API tokens: one from ``SWARM_SERVE_TOKEN``, or many from ``swarm token create``.

Tokens made by ``swarm token create`` are random (256 bits) and stored only as their
SHA-256 in Redis, so a copy of the database does not hand out access; the token itself
is printed once. Nothing here logs a token.

Each token has a scope. A ``user`` token sees and acts on the jobs it submitted only (a
job records the submitting token's id, never the token); another job is a 404 to it, as
if there were none. An ``admin`` token sees every job. ``SWARM_SERVE_TOKEN`` is admin, and
so is a token stored before tokens had scopes (:attr:`TokenInfo.legacy`): deployments made
then keep working as they did, and ``swarm token list`` points them out.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import cast

import redis

from swarm.store import keys

TOKEN_PREFIX = "swm_"
#: The 401's message (HTTP API and /mcp).
UNAUTHORIZED = ("missing or wrong token: send `Authorization: Bearer <token>` with "
                "SWARM_SERVE_TOKEN or a token from `swarm token create`")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
#: A token's scope: its own jobs, or every job.
USER, ADMIN = "user", "admin"
#: The name ``SWARM_SERVE_TOKEN`` goes by.
ENV_NAME = "SWARM_SERVE_TOKEN"


class TokenError(ValueError):
    """A token command that cannot be done; the message says why."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def token_id(digest: str) -> str:
    """A token's id: its SHA-256's first 12 hex digits (listed, and recorded by its jobs)."""
    return digest[:12]


@dataclass(frozen=True)
class Caller:
    """Who makes a request: a token's id (what the jobs it submits record as their owner),
    its name, and whether it is admin (sees every job)."""

    id: str
    name: str
    admin: bool

    def owns(self, owner: str) -> bool:
        """Whether this caller may see and act on a job that records ``owner``: an admin
        any job, a user the jobs it submitted (never one that records no owner)."""
        return self.admin or (bool(owner) and hmac.compare_digest(owner, self.id))


#: ``swarm mcp`` over stdio: the agent that starts it is trusted with every job; the jobs
#: it submits record no owner (only admin tokens see them over HTTP).
LOCAL = Caller("", "local", True)


@dataclass(frozen=True)
class TokenInfo:
    """What is kept of a token: its hash's first 12 hex digits as id, a name, a date, its
    scope (``legacy``: stored without one, before tokens had scopes, so admin)."""

    id: str
    name: str
    created: float
    scope: str = USER
    legacy: bool = False

    @classmethod
    def from_record(cls, digest: str, raw: str) -> TokenInfo:
        data = json.loads(raw)
        scope = data.get("scope")
        return cls(token_id(digest), str(data.get("name", "")), float(data.get("created", 0)),
                   ADMIN if scope is None else str(scope), legacy=scope is None)

    @property
    def caller(self) -> Caller:
        return Caller(self.id, self.name, self.scope == ADMIN)


class TokenStore:
    """The hashed tokens of ``swarm serve`` in Redis."""

    def __init__(self, redis_: redis.Redis) -> None:
        self.redis = redis_

    def create(self, name: str | None = None, admin: bool = False) -> tuple[str, TokenInfo]:
        """A new token (``admin``: it sees every job, else only those it submits) and its
        record; the token is never stored."""
        name = name or f"token-{secrets.token_hex(3)}"
        if not NAME.match(name):
            raise TokenError(f"token name {name!r} must be 1-64 letters, digits or _.@- "
                             "(starting with a letter or digit)")
        if any(t.name == name for t in self.all()):
            raise TokenError(f"a token named {name!r} exists; revoke it or pick another name")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        digest = hash_token(token)
        info = TokenInfo(token_id(digest), name, time.time(), ADMIN if admin else USER)
        self.redis.hset(keys.serve_tokens(), digest, json.dumps(
            {"name": info.name, "created": info.created, "scope": info.scope}))
        return token, info

    def all(self) -> list[TokenInfo]:
        rows = cast("dict[str, str]", self.redis.hgetall(keys.serve_tokens()))
        out = [TokenInfo.from_record(digest, raw) for digest, raw in rows.items()]
        return sorted(out, key=lambda t: t.created)

    def revoke(self, name_or_id: str) -> list[TokenInfo]:
        """Delete the tokens named ``name_or_id`` or whose id is it; returns them."""
        rows = cast("dict[str, str]", self.redis.hgetall(keys.serve_tokens()))
        gone = []
        for digest, raw in rows.items():
            info = TokenInfo.from_record(digest, raw)
            if name_or_id in (info.name, info.id):
                self.redis.hdel(keys.serve_tokens(), digest)
                gone.append(info)
        return gone

    def caller(self, token: str) -> Caller | None:
        """Who ``token`` is, or None when it is not a stored token."""
        digest = hash_token(token)
        raw = self.redis.hget(keys.serve_tokens(), digest)
        return TokenInfo.from_record(digest, cast(str, raw)).caller if raw else None

    def count(self) -> int:
        return int(self.redis.hlen(keys.serve_tokens()))


class Authenticator:
    """Checks bearer tokens: ``SWARM_SERVE_TOKEN`` (compared in constant time; admin) or a
    stored one (looked up by its hash, checked on every request, so a revoke or a new scope
    takes effect at once)."""

    def __init__(self, redis_: redis.Redis, env_token: str = "") -> None:
        self.store = TokenStore(redis_)
        self._env_digest = hash_token(env_token) if env_token else ""

    def configured(self) -> bool:
        """True when some token can get in."""
        return bool(self._env_digest) or self.store.count() > 0

    def check(self, token: str) -> Caller | None:
        """Who sends ``token``; None when no one may."""
        if not token or len(token) > 512:
            return None
        if self._env_digest and hmac.compare_digest(hash_token(token), self._env_digest):
            return Caller(token_id(self._env_digest), ENV_NAME, True)
        return self.store.caller(token)
