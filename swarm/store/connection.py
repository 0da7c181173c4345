"""Connecting to Redis: one place for timeouts, retries, URL masking and the embedded default.

A ``sentinel://`` URL (with the master's name) connects through Redis Sentinel
(:mod:`swarm.store.sentinel`): the client asks the sentinels where the master is at each
(re)connection, so a failover looks like a restart of Redis, ridden out the same way."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.driver_info import DriverInfo
from redis.retry import Retry
from redis.sentinel import Sentinel

from swarm.config import Settings
from swarm.errors import ConfigError, StoreError, StoreUnavailableError
from swarm.store.sentinel import Sentinels, is_sentinel, require_master
from swarm.store.server import EmbeddedServer

EXTERNAL_HINT = "check SWARM_REDIS_URL, or unset it to use the embedded server"
EMBEDDED_HINT = (
    "the embedded server under SWARM_HOME/redis stopped answering; see its valkey.log, "
    "or set SWARM_REDIS_URL to use an external Redis"
)
_SCHEMES = ("redis", "rediss", "unix")


def mask_url(url: str) -> str:
    """``url`` with its password (in the user info or a ``password=`` query) shown as ``***``
    (in each entry of a ``sentinel://...;sentinel://...`` list)."""
    if ";" in url:
        return ";".join(mask_url(chunk) for chunk in url.split(";"))
    # Edit the string in place: urlunsplit would turn unix:///path into unix:/path.
    head, sep, query = url.partition("?")
    netloc = urlsplit(url).netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        # A lone ``secret@host`` is masked too: people often put the password there.
        masked = f"{user}:***@{host}" if colon else f"***@{host}"
        head = head.replace(f"//{netloc}", f"//{masked}", 1)
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k == "password" else v) for k, v in pairs], safe="*/")
    return head + sep + query


def _password(url: str) -> str | None:
    parts = urlsplit(url.split(";", 1)[0])
    if parts.password:
        return parts.password
    return dict(parse_qsl(parts.query)).get("password")


def _scrub(text: str, url: str) -> str:
    secret = _password(url)
    return text.replace(secret, "***") if secret else text


#: Connections one client may open (redis-py's default is 100).
MAX_CONNECTIONS = 2048
#: What a new connection tells the server (CLIENT SETINFO). Built once: by default redis-py
#: reads its version from the installed package's metadata for every new connection (~1 ms).
DRIVER = DriverInfo(lib_version=redis.__version__)


def connect(
    url: str,
    *,
    socket_timeout: float | None = 30.0,
    connect_timeout: float = 5.0,
    retries: int = 3,
    health_check_interval: int = 30,
    hint: str = EXTERNAL_HINT,
    master: str = "",
) -> redis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://`` for TLS, ``unix://``, or
    ``sentinel://...`` with the ``master``'s name) that answered PING.

    Strings come back decoded. Connection errors and timeouts are retried ``retries`` times
    with exponential backoff. ``socket_timeout`` bounds every reply: callers of blocking
    commands (BLPOP, XREADGROUP BLOCK) must block for less, or pass ``None``.
    Raises :class:`StoreUnavailableError` (password masked) or :class:`ConfigError`.
    """
    scheme = urlsplit(url).scheme
    if scheme not in _SCHEMES and not is_sentinel(url):
        raise ConfigError(
            f"{mask_url(url)!r} is not a Redis URL; use redis://[[user]:password@]host[:port][/db],"
            " rediss://... for TLS, unix:///path/to/redis.sock, or "
            "sentinel://host1:26379;sentinel://host2:26379 with SWARM_REDIS_MASTER"
        )
    retry = Retry(
        ExponentialBackoff(cap=1.0, base=0.05),
        retries,
        supported_errors=(redis.ConnectionError, redis.TimeoutError, TimeoutError),
    )
    if is_sentinel(url):
        require_master(url, master)
        return _through_sentinels(url, master, retry, socket_timeout=socket_timeout,
                                  connect_timeout=connect_timeout,
                                  health_check_interval=health_check_interval)
    try:
        client = redis.Redis.from_url(
            url,
            # A worker runs many children on one client, each with a lease renewer and a
            # cancel watcher: redis-py's default pool of 100 connections runs out past
            # ~100 children (MaxConnectionsError).
            max_connections=MAX_CONNECTIONS,
            driver_info=DRIVER,
            decode_responses=True,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=retry,
            health_check_interval=health_check_interval,
        )
    except ValueError as exc:
        raise ConfigError(
            f"{mask_url(url)} is not a valid Redis URL: {_scrub(str(exc), url)}"
        ) from None
    try:
        # The first PING goes without retries: redis-py counts a refused login as a
        # connection error, and retrying wrong credentials only delays the message.
        with redis.Redis.from_url(url, socket_timeout=socket_timeout,
                                  socket_connect_timeout=connect_timeout,
                                  retry=Retry(NoBackoff(), 0)) as probe:
            try:
                probe.ping()
            except redis.AuthenticationError:
                raise
            except (redis.RedisError, OSError):
                client.ping()  # a transient failure: try again with the retries
    except redis.AuthenticationError as exc:
        client.close()
        given = "the credentials" if urlsplit(url).password else "a login (no password given)"
        raise StoreUnavailableError(
            f"Redis at {mask_url(url)} refused {given} ({_scrub(str(exc), url)}); "
            "check the user and password in SWARM_REDIS_URL"
        ) from None
    except (redis.RedisError, OSError) as exc:
        client.close()
        raise StoreUnavailableError(
            f"cannot reach Redis at {mask_url(url)} ({_scrub(str(exc), url)}); {hint}"
        ) from None
    return client


def _through_sentinels(url: str, master: str, retry: Retry, *, socket_timeout: float | None,
                       connect_timeout: float, health_check_interval: int) -> redis.Redis:
    """:func:`connect` for a ``sentinel://`` URL: a client of the master the sentinels name,
    found again at each reconnection (a failover)."""
    target = Sentinels.parse(url)
    # redis.sentinel has annotations from redis-py 8.2 only: the ignores serve 8.1 and
    # are unused on 8.2 (both are admitted).
    sentinels = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(target.hosts),
        sentinel_kwargs={"socket_timeout": connect_timeout,
                         "socket_connect_timeout": connect_timeout},
        socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout)
    client: redis.Redis = sentinels.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        master, redis_class=redis.Redis, db=target.db, username=target.username,
        password=target.password, decode_responses=True, retry=retry,
        max_connections=MAX_CONNECTIONS, driver_info=DRIVER,
        health_check_interval=health_check_interval)
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        client.close()
        raise StoreUnavailableError(
            f"the Redis master {master!r} of {mask_url(url)} refused the login "
            f"({_scrub(str(exc), url)}); check the user and password in SWARM_REDIS_URL"
        ) from None
    except (redis.RedisError, OSError) as exc:
        client.close()
        raise StoreUnavailableError(
            f"cannot reach the Redis master {master!r} through the sentinels "
            f"{mask_url(url)} ({_scrub(str(exc), url)}); check that the sentinels run and "
            "watch that master (SWARM_REDIS_URL, SWARM_REDIS_MASTER)"
        ) from None
    return client


@contextlib.contextmanager
def store_errors(doing: str) -> Iterator[None]:
    """Turn redis-py errors raised while ``doing`` something into swarm's store errors."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise StoreUnavailableError(
            f"Redis stopped answering while {doing} ({exc}); check that it runs "
            "(SWARM_REDIS_URL, or the embedded server's log under SWARM_HOME/redis)"
        ) from exc
    except redis.RedisError as exc:
        raise StoreError(f"Redis failed while {doing}: {exc}") from exc


#: Seconds a root in a terminal rides out a Redis that stopped answering, at the least: its
#: session lock's ttl (``SWARM_LOCK_TTL``) when that is longer (:meth:`Outage.of_root`).
OUTAGE_WINDOW = 30.0
_DOWN = (redis.ConnectionError, redis.TimeoutError)
T = TypeVar("T")


class Outage:
    """Rides out a Redis that stopped answering (a restart, a failover): waits between
    tries with a backoff (no busy loop), says so once when it starts and once when it is
    over, and raises :class:`StoreUnavailableError` after ``limit`` seconds of it.

    ``failed(exc)`` after each failed try (it sleeps before the next), ``ok()`` after
    each try that worked; or :meth:`ride` a call that is safe to repeat."""

    def __init__(self, where: str, limit: float, say: Callable[[str], None],
                 base: float = 0.1, cap: float = 2.0) -> None:
        self.where, self.limit, self.say = where, limit, say
        self.base, self.cap = base, cap
        self.since: float | None = None
        self.tries = 0

    @classmethod
    def of_root(cls, store: Store, settings: Settings, say: Callable[[str], None]) -> Outage:
        """How a root in a terminal rides out its store's outages: for
        ``max(OUTAGE_WINDOW, SWARM_LOCK_TTL)`` seconds."""
        return cls(store.masked_url, max(OUTAGE_WINDOW, settings.lock_ttl), say)

    def failed(self, exc: Exception) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self.say(f"Redis at {self.where} stopped answering ({exc}); waiting up to "
                     f"{self.limit:g} s for it to come back")
        elif now - self.since > self.limit:
            # Not chained: a ride around this one must not take it for an outage to ride.
            raise StoreUnavailableError(
                f"Redis at {self.where} did not answer for {now - self.since:.0f} s ({exc}); "
                "check that it runs (SWARM_REDIS_URL, or the embedded server's log under "
                "SWARM_HOME/redis)") from None
        time.sleep(min(self.cap, self.base * 2 ** self.tries))
        self.tries += 1

    def ok(self) -> None:
        if self.since is not None:
            self.say(f"Redis at {self.where} is back after {time.monotonic() - self.since:.1f} s")
            self.since, self.tries = None, 0

    def ride(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, tried again while Redis does not answer (a redis-py connection
        error or timeout, or the :class:`StoreUnavailableError` :func:`store_errors` makes of
        one). It must be safe to repeat: idempotent, or fenced (checking first that its
        lock is still its own)."""
        while True:
            try:
                result = attempt()
            except _DOWN as exc:
                self.failed(exc)
                continue
            except StoreUnavailableError as exc:
                if not isinstance(exc.__cause__, _DOWN):
                    raise
                self.failed(exc.__cause__)
                continue
            self.ok()
            return result


def ride(outage: Outage | None, attempt: Callable[[], T]) -> T:
    """``outage.ride(attempt)``; without an outage, ``attempt()`` once."""
    return outage.ride(attempt) if outage is not None else attempt()


@dataclass
class Store:
    """An open store: a client, its URL and, in the embedded default, the server."""

    redis: redis.Redis
    url: str
    server: EmbeddedServer | None = None
    master: str = ""
    """The master's name when ``url`` lists sentinels (``SWARM_REDIS_MASTER``)."""

    @property
    def embedded(self) -> bool:
        return self.server is not None

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)


@contextlib.contextmanager
def open_store(settings: Settings, *, adopt: bool = False) -> Iterator[Store]:
    """The store of ``settings``: the external Redis of ``redis_url``, else the embedded server
    of ``home`` (ensured on enter, released on exit; with ``adopt``, only a running one:
    see :meth:`EmbeddedServer.ensure`)."""
    if settings.redis_url:
        client = connect(settings.redis_url, master=settings.redis_master)
        try:
            yield Store(client, settings.redis_url, master=settings.redis_master)
        finally:
            client.close()
        return
    server = EmbeddedServer(settings.home)
    url = server.ensure(start=not adopt)
    try:
        client = connect(url, hint=EMBEDDED_HINT)
        try:
            yield Store(client, url, server)
        finally:
            client.close()
    finally:
        server.release()
