"""The HTTP side of the scripted model server: a request parser without the ``email``
package, routing, and the writing of answers and faults (whole, streamed, cut, garbled).
What to answer is the :class:`~swarm.testing.server.ScriptedModelServer`'s business."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from swarm.testing import misbehave
from swarm.testing.replies import CutStream, Fault, Reply, Slow
from swarm.testing.responders import review_command

if TYPE_CHECKING:
    from swarm.testing.server import ScriptedModelServer

_CUT_TEXT = "This answer is long enough to be cut into many small pieces before it ends. " * 3


def _error(message: str, kind: str, code: int | str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # hundreds of children connect at once (socketserver: 5)
    owner: ScriptedModelServer


class _Headers(dict[str, str]):
    """Request headers by lower-cased name; ``get`` ignores case, like ``email.message``."""

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


class Handler(BaseHTTPRequestHandler):
    # Answers go out as many small writes; without TCP_NODELAY the last one waits for the
    # client's delayed ACK (~40 ms an answer), which would show up as swarm overhead.
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"
    server: HTTPServer
    timeout = 60
    max_headers = 100
    _size: int | None = None
    raw_requestline: bytes
    _headers_buffer: list[bytes]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def parse_request(self) -> bool:
        """``BaseHTTPRequestHandler.parse_request`` without the ``email`` package for the
        headers: that parser took a third of this server's CPU, which a benchmark on the
        same cores counts against the swarm. Anything but a plain HTTP/1.x request line
        goes to the stock parser (nothing of the request is read yet)."""
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = line.split()
        if len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
            return super().parse_request()
        self.requestline = line
        self.command, path, self.request_version = words
        self.path = "/" + path.lstrip("/") if path.startswith("//") else path
        headers = _Headers()
        for _ in range(self.max_headers + 1):
            raw = self.rfile.readline(65537)
            if len(raw) > 65536:
                self.send_error(431, "Line too long")
                return False
            if raw in (b"\r\n", b"\n", b""):
                break
            name, _, value = str(raw, "iso-8859-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        else:
            self.send_error(431, "Too many headers")
            return False
        self.headers = headers  # type: ignore[assignment]
        connection = headers.get("connection", "").lower()
        self.close_connection = (connection == "close"
                                 or (self.request_version == "HTTP/1.0"
                                     and connection != "keep-alive"))
        if headers.get("expect", "").lower() == "100-continue" \
                and self.request_version == "HTTP/1.1":
            return self.handle_expect_100()
        return True

    @property
    def owner(self) -> ScriptedModelServer:
        return self.server.owner

    def handle(self) -> None:
        # The client may go away mid-answer (it gave up waiting, or retries).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
            super().handle()

    # -- routing -----------------------------------------------------------------------------

    def do_GET(self) -> None:
        if not self._authorised():
            return
        if self.path.rstrip("/") == "/v1/models":
            self._send_json(200, self.owner.models_body())
        else:
            self._send_json(404, _error(f"no route GET {self.path}", "not_found", 404))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        self._size = len(raw)
        if not self._authorised():
            return
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send_json(404, _error(f"no route POST {self.path}", "not_found", 404))
            return
        try:
            request = json.loads(raw)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            self._send_json(400, _error(f"request body is not JSON: {exc}",
                                        "invalid_request_error", 400))
            return
        self._chat(request)

    def _authorised(self) -> bool:
        key = self.owner.require_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._send_json(401, _error("Incorrect API key provided.", "invalid_request_error",
                                    "invalid_api_key"))
        return False

    def _chat(self, request: dict[str, Any]) -> None:
        owner = self.owner
        stream = bool(request.get("stream")) if owner.force_stream is None else owner.force_stream
        command = review_command(request)
        owner.record(request, review=command is not None)
        if owner.reject_stream_options and "stream_options" in request:
            self._send_json(400, _error("Unrecognized request argument supplied: stream_options",
                                        "invalid_request_error", 400))
            return
        if owner.latency:
            time.sleep(owner.latency)
        if command is not None:
            self._reply(Reply(owner.reviewer(command)), request, stream)
            return
        item = misbehave.answer(self, request, stream, lambda: owner.take(request))
        if item is None:  # it misbehaved
            return
        pause = 0.0
        if isinstance(item, Slow):
            if item.after_thinking and stream:
                pause = item.seconds
            else:
                time.sleep(item.seconds)
            item = item.reply or owner.responder(request)
        if isinstance(item, Reply):
            self._reply(item, request, stream, pause)
        elif isinstance(item, Fault):
            self._fault(item)
        elif isinstance(item, CutStream):
            self._cut(item, request, stream)
        else:
            self._garbage(stream)

    # -- writing -----------------------------------------------------------------------------

    def _send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self._end_headers_with(data)

    def _end_headers_with(self, data: bytes) -> None:
        """End the headers and send them with ``data`` in one write, as servers do with a
        small body (two writes would cost the client a second read)."""
        self._headers_buffer.append(b"\r\n")
        self._headers_buffer.append(data)
        self.flush_headers()

    def _reply(self, reply: Reply, request: dict[str, Any], stream: bool,
               pause: float = 0.0) -> None:
        if stream:
            chunks = self.owner.stream_chunks(reply, request, self._size)
            events = [json.dumps(c) for c in chunks]
            # The pause comes after the role chunk and the thinking.
            at = 1 + sum(1 for c in chunks if c["choices"] and self.owner.reasoning_key
                         in c["choices"][0]["delta"]) if pause else 0
            self._send_events([*events, "[DONE]"], pause=(at, pause))
        else:
            self._send_json(200, self.owner.completion(reply, request, self._size))

    def _fault(self, fault: Fault) -> None:
        headers = {}
        if fault.retry_after is not None:
            value = fault.retry_after
            headers["Retry-After"] = (str(int(value)) if isinstance(value, float | int)
                                      and float(value).is_integer() else str(value))
        body = fault.body if fault.body is not None else _error(
            f"scripted fault {fault.status}", "server_error" if fault.status >= 500
            else "invalid_request_error", fault.status)
        self._send_json(fault.status, body, headers)

    def _cut(self, cut: CutStream, request: dict[str, Any], stream: bool) -> None:
        reply = Reply(_CUT_TEXT)
        if stream:
            events = [json.dumps(c) for c in self.owner.stream_chunks(reply, request, self._size)]
            self._send_events(events[:cut.after_chunks], end=cut.clean)
            if not cut.clean:
                self._drop()
            return
        data = json.dumps(self.owner.completion(reply, request, self._size)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self._drop()

    def _garbage(self, stream: bool) -> None:
        if stream:
            self._send_events(['{"id": "chatcmpl-garbage", "choices": [{"delta": {"content": "Hel',
                               "[DONE]"])
        else:
            self._send_json(200, "<html><body>502 Bad Gateway</body></html>")

    def _send_events(self, datas: list[str], end: bool = True,
                     pause: tuple[int, float] = (0, 0.0)) -> None:
        """Send ``datas`` as SSE events; ``pause`` is (index, seconds): wait before that
        event."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for index, data in enumerate(datas):
            if pause[1] and index == pause[0]:
                time.sleep(pause[1])
            payload = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        if end:
            self.wfile.write(b"0\r\n\r\n")

    def _drop(self) -> None:
        """Close the connection abruptly, in the middle of the body."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
