"""Every place swarm relies on a library's internals: its private names, or how it calls its
own methods. Nothing else in swarm may; this module imports third-party libraries only.

Each entry says what it buys (measured), and the versions it was checked against; those
libraries are capped below their next minor release in pyproject.toml, and
tests/test_patches.py fails when the upstream behaviour an entry relies on changes.

- :class:`RedisTransport` (kombu 5.4-5.7): one ``redis.Redis`` per kombu channel, and a
  connection error (not a crash) for a command on a channel whose connection closed;
  :class:`SentinelTransport` the same for ``sentinel://`` URLs.
- :func:`reset_connections` (Celery 5.4-5.7): the app's cached pools and result backend,
  dropped when the app is pointed at another broker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import redis
from kombu import transport as kombu_transport
from kombu.transport import redis as kombu_redis

# -- kombu -------------------------------------------------------------------------------


class RedisChannel(kombu_redis.Channel):
    """kombu's Redis channel, keeping one synchronous ``redis.Redis`` instead of building
    one for every command.

    kombu runs each synchronous Redis command of a channel (a publish, an ack, the unacked
    bookkeeping) in ``with self.conn_or_acquire() as client``, which builds a new
    ``redis.Redis`` (``_create_client``) each time; redis-py 8 fills a 170-entry
    response-callback table per client: 180 us of CPU (median of 9 x 2,000, redis 8.1),
    and a Celery event publish costs 587 us with it, 276 us without (median of 3 runs of
    7 x 2,000, kombu 5.7). A worker does ~4.2 such commands per child, the coordinator ~1
    (counted over a 200-child job): ~0.2-0.3 CPU s per 200 children. A ``redis.Redis``
    over a connection pool is thread-safe, so one per channel serves all of them; it is
    rebuilt when kombu replaces the channel's pool (a reconnection).

    Relies on (kombu 5.4-5.7): ``conn_or_acquire(client=None)`` is a context manager
    yielding a client of ``self.pool``, and kombu's synchronous commands go through it;
    ``self.connection.client`` (the kombu Connection) is None once the connection closed.

    A command on a channel whose connection was closed (Celery acks a finished task while
    it reconnects after Redis went away) raises ``redis.ConnectionError``, which Celery
    handles as a lost connection ("Couldn't ack", the message is delivered again). kombu
    itself raises AttributeError there (``_connparams`` reads ``None.hostname``), and the
    worker process dies with "Unrecoverable error" (kombu issue #582, still so in 5.7).
    """

    _reused: Any = None

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client is None and getattr(self.connection, "client", None) is None:
            raise redis.ConnectionError("the broker connection of this channel was closed")
        if client is None:
            client = self._reused
            if client is None or client.connection_pool is not self.pool:
                with super().conn_or_acquire() as client:
                    self._reused = client
        yield client


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport (``redis://``, ``rediss://``, ``redis+socket://``) with
    :class:`RedisChannel`."""

    Channel = RedisChannel


class SentinelChannel(RedisChannel, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel (its pool is the master's, found through the sentinels)
    with :class:`RedisChannel`'s kept client and closed-channel error: a failover closes
    the broker connection just as a Redis restart does."""


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's ``sentinel://`` transport with :class:`SentinelChannel`."""

    Channel = SentinelChannel


_TRANSPORTS = {"redis": RedisTransport, "rediss": RedisTransport,
               "sentinel": SentinelTransport}


def install_redis_transport() -> bool:
    """Make kombu use :class:`RedisTransport` for Redis URLs (and
    :class:`SentinelTransport` for ``sentinel://``) in this process; False when kombu had
    resolved them before (the stock transport then stays: slower, not wrong)."""
    for scheme, cls in _TRANSPORTS.items():
        kombu_transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:{cls.__name__}"
    return all(kombu_transport.get_transport_cls(scheme) is cls
               for scheme, cls in _TRANSPORTS.items())


# -- Celery ------------------------------------------------------------------------------


def reset_connections(app: Any) -> None:
    """Forget ``app``'s broker connection pool, producer pool and result backend, so the
    next use connects to the URLs now in ``app.conf``.

    Celery builds each once and keeps it for the life of the app (it resets the pools only
    in a forked child, and never the backend); a process whose app is pointed at another
    Redis (tests, an embedded server restarted on another port) would go on sending to the
    old one. No public API does this (``app.close()`` drops the broker pool only, and
    unregisters the app). What it buys is correctness, not time: without it,
    ``configure(url_b).send_task(...)`` after a send to ``url_a`` lands on ``url_a``.

    Relies on (Celery 5.4-5.7): ``app._pool``, ``app.amqp._producer_pool``,
    ``app._backend_cache`` and ``app._local.backend`` hold them, and ``None`` (or no
    attribute) makes Celery build them again.
    """
    app._pool = None
    app.amqp._producer_pool = None
    vars(app._local).pop("backend", None)
    app._backend_cache = None
