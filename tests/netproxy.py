"""A TCP proxy that can cut a link and add latency: a network partition or a slow link
between one process and a server, on one machine (this kernel has no netem).

``cut()`` stops forwarding in both directions without closing anything, as a link that went
down does: the bytes a side sends are held (its reads block, its writes fill the buffers)
until ``heal()`` delivers them, late, as TCP would after the link came back. New
connections made while cut wait too. ``delay`` seconds are added to every chunk forwarded.
A test fixture, not part of swarm: it forwards bytes as they come and parses no protocol
(Redis, HTTP or any other is spoken by the processes at either end, through their own
libraries); plain sockets and threads.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType

_CHUNK = 65536


class TcpProxy:
    """Forwards ``127.0.0.1:port`` (a free port; see :attr:`port`) to ``host:target_port``."""

    def __init__(self, host: str, target_port: int, *, delay: float = 0.0,
                 listen_host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.delay = delay
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server((listen_host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True, name="tcp-proxy")

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    def cut(self) -> None:
        """Stop forwarding (nothing is closed; held bytes go through on :meth:`heal`)."""
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        """Close the listener and every connection (both sides see the link reset)."""
        self._closed.set()
        self._open.set()  # release the pumps so they see the close
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = set(self._sockets), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True,
                             name="tcp-proxy-conn").start()

    def _connect(self, client: socket.socket) -> None:
        self._track(client)
        self._open.wait()
        if self._closed.is_set():
            return
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            self._drop(client)
            return
        upstream.settimeout(None)
        self._track(upstream)
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                             name="tcp-proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self._open.wait()
                data = src.recv(_CHUNK)
                if not data or self._closed.is_set():
                    break
                self._open.wait()  # read while cut: held until the link heals
                if self.delay:
                    time.sleep(self.delay)
                if self._closed.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        self._drop(src)
        self._drop(dst)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
        if self._closed.is_set():
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()
