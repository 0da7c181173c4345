"""PlainHTTPTransport against a raw TCP server that writes scripted bytes."""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from swarm.llm.client import http_client
from swarm.llm.transport import PlainHTTPTransport

Answer = Callable[[socket.socket, bytes], bool]
"""Writes the answer to one request; returns False to close the connection after it."""


class RawServer:
    """Serves connections one request at a time; each request takes the next answer."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/x"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while self.answers:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    buf += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + buf[:length])
                buf = buf[length:]
                if not self.answers.pop(0)(conn, head):
                    return

    def close(self) -> None:
        self.listener.close()


def ok(body: bytes = b'{"ok": true}', extra: bytes = b"", keep: bool = True) -> Answer:
    def answer(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra +
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return keep
    return answer


def raw(data: bytes, keep: bool = False, pause: float = 0.0, piece: int = 0) -> Answer:
    def answer(conn: socket.socket, head: bytes) -> bool:
        step = piece or len(data) or 1
        for i in range(0, len(data), step):
            conn.sendall(data[i:i + step])
            if pause:
                time.sleep(pause)
        return keep
    return answer


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(transport=PlainHTTPTransport(), timeout=2.0) as c:
        yield c


def test_keeps_the_connection_alive(client: httpx.Client) -> None:
    server = RawServer(ok(b"one"), ok(b"two"))
    assert client.post(server.url, json={"a": 1}).text == "one"
    assert client.get(server.url).text == "two"
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\n") and first.endswith(b'{"a":1}')
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % server.port in first
    server.close()


def test_chunked_answer_split_anywhere(client: httpx.Client) -> None:
    events = b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    head = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: text/event-stream\r\n\r\n")
    server = RawServer(raw(head + body, keep=True, piece=3, pause=0.002), ok(b"after"))
    with client.stream("GET", server.url) as response:
        got = b"".join(response.iter_bytes())
    assert got == b"".join(events)
    assert client.get(server.url).text == "after" and server.connections == 1
    server.close()


def test_a_chunk_is_yielded_before_the_next_is_sent(client: httpx.Client) -> None:
    go_on = threading.Event()

    def answer(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        go_on.wait(5)
        conn.sendall(b"4\r\nnext\r\n0\r\n\r\n")
        return True

    server = RawServer(answer)
    with client.stream("GET", server.url) as response:
        pieces = response.iter_bytes()
        assert next(pieces) == b"first"  # would time out if the transport waited for the end
        go_on.set()
        assert b"".join(pieces) == b"next"
    server.close()


def test_a_connection_the_server_closed_while_idle_is_retried(client: httpx.Client) -> None:
    server = RawServer(ok(b"one", keep=False), ok(b"two"))
    assert client.get(server.url).text == "one"
    time.sleep(0.05)  # the server has closed it; the transport still holds it as idle
    assert client.get(server.url).text == "two"
    assert server.connections == 2
    server.close()


def test_connection_close_is_not_reused(client: httpx.Client) -> None:
    server = RawServer(ok(b"one", extra=b"Connection: close\r\n"), ok(b"two"))
    assert client.get(server.url).text == "one"
    assert client.get(server.url).text == "two"
    assert server.connections == 2
    server.close()


def test_a_body_delimited_by_the_end_of_the_connection(client: httpx.Client) -> None:
    server = RawServer(raw(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end"),
                       ok(b"next"))
    assert client.get(server.url).text == "until the end"
    assert client.get(server.url).text == "next" and server.connections == 2
    server.close()


def test_gzip_is_decoded_by_the_client(client: httpx.Client) -> None:
    server = RawServer(ok(gzip.compress(b"x" * 5000), extra=b"Content-Encoding: gzip\r\n"))
    assert client.get(server.url).text == "x" * 5000
    server.close()


@pytest.mark.parametrize(("answer", "error", "words"), [
    (raw(b""), httpx.RemoteProtocolError, "without sending a response"),
    (raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"), httpx.RemoteProtocolError,
     "complete message body"),
    (raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"),
     httpx.RemoteProtocolError, "complete message body"),
    (raw(b"<html>not http</html>\r\n\r\n"), httpx.RemoteProtocolError, "not an HTTP/1.x"),
    (raw(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"), httpx.RemoteProtocolError,
     "Content-Length"),
    (raw(b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"), httpx.RemoteProtocolError,
     "bad header line"),
    (raw(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain"), httpx.RemoteProtocolError,
     "closed in the headers"),
])
def test_broken_answers_raise_httpx_errors(client: httpx.Client, answer: Answer,
                                           error: type[Exception], words: str) -> None:
    server = RawServer(answer)
    with pytest.raises(error, match=words):
        client.get(server.url).read()
    server.close()


def test_timeouts_and_refused_connections() -> None:
    server = RawServer(raw(b"HTTP/1.1 200 OK\r\n", keep=True, pause=1.0))
    with httpx.Client(transport=PlainHTTPTransport(), timeout=0.2) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.get(server.url)
        closed = socket.create_server(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        with pytest.raises(httpx.ConnectError):
            client.get(f"http://127.0.0.1:{port}/")
    server.close()


def test_only_plain_http() -> None:
    with httpx.Client(transport=PlainHTTPTransport()) as client, \
            pytest.raises(httpx.UnsupportedProtocol):
        client.get("https://127.0.0.1:1/")


def test_http_client_leaves_proxied_endpoints_to_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    url = httpx.URL("http://10.1.2.3:8000/v1/chat/completions")
    proxied = http_client("http://10.1.2.3:8000/v1", 1, 1)
    assert not isinstance(proxied._transport_for_url(url), PlainHTTPTransport)
    monkeypatch.setenv("NO_PROXY", "10.1.2.3")
    direct = http_client("http://10.1.2.3:8000/v1", 1, 1)
    assert isinstance(direct._transport_for_url(url), PlainHTTPTransport)
    proxied.close()
    direct.close()


def test_http_client_uses_it_for_http_only() -> None:
    plain = http_client("http://127.0.0.1:1/v1", 1, 1)
    tls = http_client("https://example.invalid/v1", 1, 1)
    assert isinstance(plain._transport, PlainHTTPTransport)
    assert not isinstance(tls._transport, PlainHTTPTransport)
    plain.close()
    tls.close()
