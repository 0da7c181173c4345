"""Redis Sentinel addresses, spelt as Celery and kombu spell them.

``SWARM_REDIS_URL=sentinel://[[user]:password@]host:port[/db];sentinel://host:port;...``
lists the sentinels (port 26379 when left out); ``SWARM_REDIS_MASTER`` names the master they
watch (kombu's ``master_name`` transport option; the name in ``sentinel monitor NAME``).
The user, password and database of the first entry are those of the master (and its
replicas), not of the sentinels, which are asked without a password, as kombu asks them.

The same setting serves every component: the swarm's store (redis-py's
:class:`redis.sentinel.Sentinel`, :func:`swarm.store.connection.connect`), the Celery
broker and result backend (kombu's and Celery's own ``sentinel://`` transports,
:func:`swarm.broker.app.configure`) and celery-redbeat's schedules (its
``redis-sentinel://`` options, :func:`swarm.schedules.store.configure_redbeat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import SplitResult, unquote, urlsplit

from swarm.errors import ConfigError

SCHEME = "sentinel"
DEFAULT_PORT = 26379
MASTER_HINT = ("set SWARM_REDIS_MASTER to the name of the master the sentinels watch (the "
               "NAME of `sentinel monitor NAME host port quorum`)")


def is_sentinel(url: str) -> bool:
    """Whether ``url`` lists sentinels (``sentinel://...``) rather than one Redis."""
    return url.strip().lower().startswith(f"{SCHEME}://")


@dataclass(frozen=True)
class Sentinels:
    """The sentinels of a ``sentinel://`` URL, and how to log in to the master they name."""

    hosts: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> Sentinels:
        """Parse ``sentinel://...;sentinel://...``; :class:`ConfigError` saying what is
        wrong (the message never holds the password)."""
        hosts: list[tuple[str, int]] = []
        first: SplitResult | None = None
        for chunk in filter(None, (c.strip() for c in url.split(";"))):
            parts = urlsplit(chunk)
            if parts.scheme.lower() != SCHEME:
                raise ConfigError(f"every entry of a Sentinel URL starts with sentinel://; "
                                  f"{parts.scheme or '(no scheme)'}:// is not one. Write "
                                  "sentinel://host1:26379;sentinel://host2:26379")
            try:
                port = parts.port or DEFAULT_PORT
            except ValueError:
                raise ConfigError(f"a sentinel's port in SWARM_REDIS_URL is not a number "
                                  f"(entry {len(hosts) + 1})") from None
            if not parts.hostname:
                raise ConfigError(f"entry {len(hosts) + 1} of the Sentinel URL names no host; "
                                  "write sentinel://host:port")
            hosts.append((parts.hostname, port))
            first = first or parts
        if first is None:
            raise ConfigError("SWARM_REDIS_URL=sentinel:// lists no sentinel; write "
                              "sentinel://host1:26379;sentinel://host2:26379")
        db = first.path.strip("/") or "0"
        if not db.isdigit():
            raise ConfigError(f"the database of a Sentinel URL is a number (/0), not {db!r}")
        return cls(tuple(hosts), int(db), unquote(first.username) if first.username else None,
                   unquote(first.password) if first.password else None)


def require_master(url: str, master: str) -> None:
    """:class:`ConfigError` when ``url`` lists sentinels and no master is named."""
    if is_sentinel(url) and not master:
        raise ConfigError(f"SWARM_REDIS_URL lists Redis Sentinels; {MASTER_HINT}")
