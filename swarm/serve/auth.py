"""API tokens: one from ``SWARM_SERVE_TOKEN``, or many from ``swarm token create``.

Tokens made by ``swarm token create`` are random (256 bits) and stored only as their
SHA-256 in Redis, so a copy of the database does not hand out access; the token itself
is printed once. Nothing here logs a token.
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


class TokenError(ValueError):
    """A token command that cannot be done; the message says why."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class TokenInfo:
    """What is kept of a token: its hash's first 12 hex digits as id, a name, a date."""

    id: str
    name: str
    created: float


class TokenStore:
    """The hashed tokens of ``swarm serve`` in Redis."""

    def __init__(self, redis_: redis.Redis) -> None:
        self.redis = redis_

    def create(self, name: str | None = None) -> tuple[str, TokenInfo]:
        """A new token and its record; the token is never stored."""
        name = name or f"token-{secrets.token_hex(3)}"
        if not NAME.match(name):
            raise TokenError(f"token name {name!r} must be 1-64 letters, digits or _.@- "
                             "(starting with a letter or digit)")
        if any(t.name == name for t in self.all()):
            raise TokenError(f"a token named {name!r} exists; revoke it or pick another name")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        digest = hash_token(token)
        info = TokenInfo(digest[:12], name, time.time())
        self.redis.hset(keys.serve_tokens(), digest,
                        json.dumps({"name": info.name, "created": info.created}))
        return token, info

    def all(self) -> list[TokenInfo]:
        rows = cast("dict[str, str]", self.redis.hgetall(keys.serve_tokens()))
        out = []
        for digest, raw in rows.items():
            data = json.loads(raw)
            out.append(TokenInfo(digest[:12], str(data.get("name", "")),
                                 float(data.get("created", 0))))
        return sorted(out, key=lambda t: t.created)

    def revoke(self, name_or_id: str) -> list[TokenInfo]:
        """Delete the tokens named ``name_or_id`` or whose id is it; returns them."""
        rows = cast("dict[str, str]", self.redis.hgetall(keys.serve_tokens()))
        gone = []
        for digest, raw in rows.items():
            data = json.loads(raw)
            if name_or_id in (data.get("name"), digest[:12]):
                self.redis.hdel(keys.serve_tokens(), digest)
                gone.append(TokenInfo(digest[:12], str(data.get("name", "")),
                                      float(data.get("created", 0))))
        return gone

    def valid(self, token: str) -> bool:
        return bool(self.redis.hexists(keys.serve_tokens(), hash_token(token)))

    def count(self) -> int:
        return int(self.redis.hlen(keys.serve_tokens()))


class Authenticator:
    """Checks bearer tokens: ``SWARM_SERVE_TOKEN`` (compared in constant time) or a stored
    one (looked up by its hash, checked on every request, so a revoke takes effect at once)."""

    def __init__(self, redis_: redis.Redis, env_token: str = "") -> None:
        self.store = TokenStore(redis_)
        self._env_digest = hash_token(env_token) if env_token else ""

    def configured(self) -> bool:
        """True when some token can get in."""
        return bool(self._env_digest) or self.store.count() > 0

    def check(self, token: str) -> bool:
        if not token or len(token) > 512:
            return False
        if self._env_digest and hmac.compare_digest(hash_token(token), self._env_digest):
            return True
        return self.store.valid(token)
