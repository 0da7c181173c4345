"""A lean HTTP/1.1 transport for ``http://`` model endpoints (a local vLLM, llama.cpp).

httpx's own transport (httpcore + h11) spends ~0.7 ms of CPU on a request to a local
server; a worker running 200 children makes thousands, on the same cores as the model
server. This one writes the request in one ``sendall`` and parses the status line and
headers itself: ~0.2 ms. It is an ordinary ``httpx.BaseTransport``: the ``httpx.Client``
around it still decodes content and hands out the body as a stream. It speaks to the
endpoint directly, so :func:`swarm.llm.client.http_client` keeps httpx's own transport for
an endpoint reached through a proxy from the environment (HTTP_PROXY, ALL_PROXY, NO_PROXY).

Connections are kept alive and reused: an idle one is taken from a list, never scanned.
A request that finds its reused connection closed by the server (while it idled, before
any of the answer arrived) goes on the next idle one, or a new one, as httpcore does.
Failures raise httpx's exceptions (``ConnectError``, ``ReadTimeout``,
``RemoteProtocolError``...), so callers handle them as they would with the default
transport.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx

MAX_LINE = 65_536
MAX_HEADERS = 100
READ_SIZE = 65_536
MAX_IDLE = 64
"""Idle connections kept per transport (more are closed when returned)."""


class _Connection:
    def __init__(self, host: str, port: int, timeout: float | None) -> None:
        self.key = (host, port)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class _Body(httpx.SyncByteStream):
    """The body of one answer, read as it arrives; the connection goes back to the pool
    once the body was read whole (and the server keeps it open)."""

    def __init__(self, transport: PlainHTTPTransport, conn: _Connection, length: int | None,
                 chunked: bool, reusable: bool) -> None:
        self.transport, self.conn = transport, conn
        self.length, self.chunked, self.reusable = length, chunked, reusable
        self.done = length == 0

    def __iter__(self) -> Iterator[bytes]:
        if self.done:
            return
        try:
            if self.chunked:
                yield from self._chunks()
            elif self.length is not None:
                left = self.length
                while left:
                    data = self.conn.file.read1(min(left, READ_SIZE))
                    if not data:
                        raise httpx.RemoteProtocolError(
                            f"peer closed connection without sending complete message body "
                            f"({left} of {self.length} bytes missing)")
                    left -= len(data)
                    yield data
            else:  # delimited by the end of the connection
                while data := self.conn.file.read1(READ_SIZE):
                    yield data
            self.done = True
        except TimeoutError as exc:
            raise httpx.ReadTimeout("timed out reading the answer") from exc
        except OSError as exc:
            raise httpx.ReadError(f"reading the answer failed: {exc}") from exc

    def _chunks(self) -> Iterator[bytes]:
        file = self.conn.file
        while True:
            line = file.readline(MAX_LINE)
            if not line.endswith(b"\n"):
                raise httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body "
                    "(in a chunk size line)")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise httpx.RemoteProtocolError(f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                while (trailer := file.readline(MAX_LINE)) not in (b"\r\n", b"\n"):
                    if not trailer:
                        raise httpx.RemoteProtocolError("connection closed in the trailers")
                return
            while size:
                data = file.read1(size)
                if not data:
                    raise httpx.RemoteProtocolError(
                        "peer closed connection without sending complete message body "
                        "(in a chunk)")
                size -= len(data)
                yield data
            if file.readline(MAX_LINE) not in (b"\r\n", b"\n"):
                raise httpx.RemoteProtocolError("a chunk does not end with CRLF")

    def close(self) -> None:
        conn, self.conn = self.conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self.done and self.reusable:
            self.transport._release(conn)
        else:
            conn.close()


class PlainHTTPTransport(httpx.BaseTransport):
    """HTTP/1.1 over plain TCP, for ``http://`` URLs; thread-safe."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"the plain transport speaks http:// only, not {url.scheme}://")
        timeout: dict[str, float | None] = request.extensions.get("timeout", {})
        key = (url.host, url.port or 80)
        data = self._head(request) + request.read()
        while True:
            conn = self._acquire(key)
            reused = conn is not None
            if conn is None:
                conn = _Connection(key[0], key[1], timeout.get("connect"))
            try:
                self._send(conn, data, timeout.get("write"), reused)
                conn.sock.settimeout(timeout.get("read"))
                return self._response(request, conn, reused)
            except _Stale:
                conn.close()
                if not reused:
                    raise httpx.RemoteProtocolError(
                        "Server disconnected without sending a response.") from None
                # The server closed it while it idled: the next idle one, or a new one.
            except BaseException:
                conn.close()
                raise

    @staticmethod
    def _head(request: httpx.Request) -> bytes:
        url = request.url
        lines = [b"%s %s HTTP/1.1" % (request.method.encode(), url.raw_path)]
        if "host" not in request.headers:
            lines.append(b"Host: " + url.netloc)
        lines += [name + b": " + value for name, value in request.headers.raw]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    @staticmethod
    def _send(conn: _Connection, data: bytes, timeout: float | None, reused: bool) -> None:
        try:
            conn.sock.settimeout(timeout)
            conn.sock.sendall(data)
        except TimeoutError as exc:
            raise httpx.WriteTimeout("timed out sending the request") from exc
        except OSError as exc:
            if reused:
                raise _Stale from exc
            raise httpx.WriteError(f"sending the request failed: {exc}") from exc

    def _response(self, request: httpx.Request, conn: _Connection,
                  reused: bool) -> httpx.Response:
        try:
            status_line = conn.file.readline(MAX_LINE)
            if not status_line:
                raise _Stale
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
                raise httpx.RemoteProtocolError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
            headers = self._headers(conn)
        except TimeoutError as exc:
            raise httpx.ReadTimeout("timed out waiting for the answer") from exc
        except OSError as exc:
            if reused:
                raise _Stale from exc
            raise httpx.ReadError(f"reading the answer failed: {exc}") from exc
        status = int(parts[1])
        if 100 <= status < 200:  # an interim answer (no 100-continue is asked): skip it
            return self._response(request, conn, False)
        length: int | None = None
        chunked = False
        reusable = parts[0] == b"HTTP/1.1"
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise httpx.RemoteProtocolError(f"bad Content-Length {value!r}") from None
            elif lower == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif lower == b"connection":
                if b"close" in value.lower():
                    reusable = False
                elif b"keep-alive" in value.lower():
                    reusable = True
        if request.method == "HEAD" or status in (204, 304):
            length, chunked = 0, False
        if chunked:
            length = None
        elif length is None:
            reusable = False  # the body ends where the connection does
        stream = _Body(self, conn, length, chunked, reusable)
        return httpx.Response(status, headers=headers, stream=stream, request=request,
                              extensions={"http_version": parts[0],
                                          "reason_phrase": parts[2].strip()
                                          if len(parts) > 2 else b""})

    @staticmethod
    def _headers(conn: _Connection) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        for _ in range(MAX_HEADERS + 1):
            line = conn.file.readline(MAX_LINE)
            if line in (b"\r\n", b"\n"):
                return headers
            if not line.endswith(b"\n"):
                raise httpx.RemoteProtocolError(
                    "the connection closed in the headers, or a header line is too long")
            name, sep, value = line.partition(b":")
            if not sep:
                raise httpx.RemoteProtocolError(f"bad header line {line[:80]!r}")
            headers.append((name.strip(), value.strip()))
        raise httpx.RemoteProtocolError(f"more than {MAX_HEADERS} header lines")

    def _acquire(self, key: tuple[str, int]) -> _Connection | None:
        with self._lock:
            idle = self._idle.get(key)
            return idle.pop() if idle else None

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(conn.key, [])
            if not self._closed and len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


class _Stale(Exception):
    """The connection ended before any answer: the server closed it while it idled."""
