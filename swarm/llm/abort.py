"""Aborting a model request in flight from another thread.

A synchronous httpx request cannot be cancelled: the thread that sent it blocks in a read
until the answer (a whole answer can take minutes) or the read timeout. What does end
that read at once is a ``shutdown()`` of its socket: the read returns end of file, httpcore
raises ``RemoteProtocolError`` (or ``ReadError``), and the connection is dropped from the
pool.

httpcore tells which sockets a client opens through its public ``trace`` request extension
(``connection.connect_tcp.complete`` and ``connection.start_tls.complete`` carry the new
network stream); :class:`Connections` keeps them (weakly) per ``httpx.Client``.
:meth:`Connections.abort` shuts down every socket of the client: the request in flight,
and the idle keep-alive ones, which the pool then replaces on their next use. So abort the
client of one caller at a time: a worker keeps one client per pool thread, and a thread
runs one child at a time (:mod:`swarm.workers.models`).
"""

from __future__ import annotations

import socket
import threading
import weakref
from typing import Any

import httpx

#: The trace events whose ``return_value`` is a new network stream.
_OPENED = frozenset({"connection.connect_tcp.complete", "connection.start_tls.complete",
                     "connection.connect_unix_socket.complete"})


class Connections:
    """The network streams one ``httpx.Client`` opened (as its requests' trace reported)."""

    def __init__(self) -> None:
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's ``trace`` extension: keeps each stream a request opens."""
        if event in _OPENED:
            stream = info.get("return_value")
            if stream is not None:
                with self._lock:
                    self._streams.add(stream)

    def abort(self) -> int:
        """Shut down every socket of the client (both ways): a read in progress returns at
        once. Idempotent, and safe from any thread. Returns how many sockets it shut."""
        with self._lock:
            streams = list(self._streams)
        shut = 0
        for stream in streams:
            sock = stream.get_extra_info("socket")
            if not isinstance(sock, socket.socket):
                continue
            try:
                # The plain socket's shutdown, also for TLS: SSLSocket.shutdown would unwrap
                # the TLS object under the reading thread's feet (a ValueError there).
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
                shut += 1
            except OSError:
                pass  # closed already, or never connected
        return shut


_registry: weakref.WeakKeyDictionary[httpx.Client, Connections] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def connections_of(client: httpx.Client) -> Connections:
    """The :class:`Connections` of ``client`` (one per client, shared by its users)."""
    with _registry_lock:
        found = _registry.get(client)
        if found is None:
            found = _registry[client] = Connections()
        return found
