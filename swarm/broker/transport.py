"""kombu's Redis transport, with one Redis client per channel instead of one per operation.

kombu builds a new ``redis.Redis`` for every publish, ack and prefetch bookkeeping step
(``Channel.conn_or_acquire`` -> ``_create_client``), and redis-py 8 fills a 170-entry
response-callback table for each client: ~190 us of CPU every time, ~8 times per task in
a worker (the task's message, its ack, its Celery events, the progress events for Flower).
A ``redis.Redis`` over a connection pool is thread-safe, so one per channel serves them all.
The cache follows the channel's pool, which kombu replaces when it reconnects. New
connections also skip redis-py's per-connection package-metadata read (see ``DRIVER``).
"""

from __future__ import annotations

from typing import Any

from kombu import transport as kombu_transport
from kombu.transport import redis as kombu_redis

from swarm.store.connection import DRIVER


class Channel(kombu_redis.Channel):
    """A kombu Redis channel that reuses its synchronous client."""

    _swarm_client: Any = None

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        params: dict[str, Any] = super()._connparams(asynchronous)  # type: ignore[no-untyped-call]
        params.setdefault("driver_info", DRIVER)
        return params

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[no-untyped-call]
        client = self._swarm_client
        if client is None or client.connection_pool is not self.pool:
            client = self._swarm_client = super()._create_client()  # type: ignore[no-untyped-call]
        return client


class Transport(kombu_redis.Transport):
    """``redis://``, ``rediss://`` and ``redis+socket://`` brokers for swarm's Celery app."""

    Channel = Channel


NAME = f"{__name__}:Transport"


def install() -> None:
    """Make kombu use :class:`Transport` for Redis URLs in this process (idempotent)."""
    for scheme in ("redis", "rediss"):
        kombu_transport.TRANSPORT_ALIASES[scheme] = NAME
        kombu_transport._transport_cache.pop(scheme, None)
