"""LLMClient over real HTTP against the scripted model server (sleep is faked, so no waiting)."""

from __future__ import annotations

import contextlib
import email.utils
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarm.config import Secret, Settings
from swarm.domain.messages import StreamEvent
from swarm.errors import (
    ConfigError,
    ModelConnectionError,
    ModelHTTPError,
    ModelNotFoundError,
    ModelRateLimitError,
    ModelResponseError,
)
from swarm.llm.client import LLMClient
from swarm.testing.server import (
    CutStream,
    Fault,
    Garbage,
    Reply,
    ScriptedModelServer,
    Slow,
    ToolCall,
    main,
    parse_script,
)

KEY = "sk-test-4f9c2b7e1d"
USER = [{"role": "user", "content": "hi"}]
RUN_CLI = {"type": "function", "function": {
    "name": "run_cli", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def sleeps() -> list[float]:
    return []


def make_client(server: ScriptedModelServer, sleeps: list[float], **kw: Any) -> LLMClient:
    options: dict[str, Any] = {"model": "scripted-model", "api_key": Secret(KEY), "retries": 3,
                               "backoff_max": 8.0, "sleep": sleeps.append}
    options.update(kw)
    return LLMClient(server.base_url, **options)


@pytest.fixture
def client(model_server: ScriptedModelServer, sleeps: list[float]) -> Iterator[LLMClient]:
    model_server.require_key = KEY  # every test also proves the bearer token is sent
    with make_client(model_server, sleeps) as c:
        yield c


def assert_secret_free(*texts: str) -> None:
    for text in texts:
        assert KEY not in text


# -- answers ---------------------------------------------------------------------------------


def test_streamed_text_with_reasoning(model_server: ScriptedModelServer,
                                      client: LLMClient) -> None:
    text = "Hello there! This answer arrives in many small pieces."
    model_server.script(Reply(text, reasoning="The user greets me."))
    events: list[StreamEvent] = []
    result = client.chat(USER, on_event=events.append)
    assert result.message == {"role": "assistant", "content": text,
                              "reasoning_content": "The user greets me."}
    assert result.finish_reason == "stop"
    assert "".join(e.text for e in events if e.kind == "content") == text
    assert len([e for e in events if e.kind == "content"]) > 5
    assert result.usage.total_tokens > 0  # from the usage chunk that has no choices
    (sent,) = model_server.requests
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert "tools" not in sent and "temperature" not in sent


@pytest.mark.parametrize("style", ["openai", "llamacpp"])
def test_streamed_parallel_tool_calls(model_server: ScriptedModelServer, client: LLMClient,
                                      style: Any) -> None:
    model_server.tool_call_ids = style
    model_server.script(Reply(tool_calls=[
        ToolCall("run_cli", {"command": "ls -la /tmp", "timeout": 30}),
        ToolCall("agent", {"message": "summarise every file in src/ " * 3}),
    ]))
    events: list[StreamEvent] = []
    result = client.chat(USER, [RUN_CLI], on_event=events.append, temperature=0)
    assert result.message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in result.tool_calls] == [
        ("run_cli", {"command": "ls -la /tmp", "timeout": 30}),
        ("agent", {"message": "summarise every file in src/ " * 3}),
    ]
    ids = [c["id"] for c in result.tool_calls]
    if style == "openai":
        assert all(i.startswith("call_") and len(i) == 29 for i in ids)
    else:
        assert all(len(i) == 32 and not i.startswith("call_") for i in ids)
    assert [e.text for e in events if e.kind == "tool_call"] == ["run_cli", "agent"]
    assert result.finish_reason == "tool_calls"
    assert model_server.requests[0]["tools"] == [RUN_CLI]
    assert model_server.requests[0]["temperature"] == 0


def test_not_streamed_when_asked(model_server: ScriptedModelServer, client: LLMClient) -> None:
    model_server.script(Reply("plain", reasoning="r", usage={"prompt_tokens": 3,
                                                          "completion_tokens": 4}))
    events: list[StreamEvent] = []
    result = client.chat(USER, stream=False, on_event=events.append)
    assert result.message == {"role": "assistant", "content": "plain", "reasoning_content": "r"}
    assert result.usage.as_dict() == {"prompt_tokens": 3, "completion_tokens": 4,
                                      "total_tokens": 7}
    assert events == [StreamEvent("reasoning", "r"), StreamEvent("content", "plain")]
    (sent,) = model_server.requests
    assert sent["stream"] is False and "stream_options" not in sent


def test_server_that_ignores_stream_true(model_server: ScriptedModelServer,
                                         client: LLMClient) -> None:
    model_server.force_stream = False
    model_server.script(Reply(tool_calls=[ToolCall("run_cli", {"command": "pwd"})]))
    result = client.chat(USER, [RUN_CLI])
    assert model_server.requests[0]["stream"] is True
    assert result.tool_calls[0]["function"]["arguments"] == '{"command": "pwd"}'


def test_server_that_streams_when_not_asked(model_server: ScriptedModelServer,
                                            client: LLMClient) -> None:
    model_server.force_stream = True
    model_server.script(Reply("streamed anyway"))
    assert client.chat(USER, stream=False).content == "streamed anyway"


def test_stream_options_rejected_once_then_left_out(model_server: ScriptedModelServer,
                                                   client: LLMClient, sleeps: list[float]) -> None:
    model_server.reject_stream_options = True
    model_server.script(Reply("one"), Reply("two"))
    assert client.chat(USER).content == "one"
    assert client.chat(USER).content == "two"
    assert ["stream_options" in r for r in model_server.requests] == [True, False, False]
    assert sleeps == []


# -- retries ---------------------------------------------------------------------------------


def test_429_honours_retry_after_seconds(model_server: ScriptedModelServer, client: LLMClient,
                                         sleeps: list[float]) -> None:
    model_server.script(Fault(429, retry_after=2), Reply("hi"))
    assert client.chat(USER).content == "hi"
    assert sleeps == [2.0]
    assert len(model_server.requests) == 2


def test_429_retry_after_http_date_is_capped(model_server: ScriptedModelServer,
                                             client: LLMClient, sleeps: list[float]) -> None:
    later = email.utils.format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)
    soon = email.utils.format_datetime(datetime.now(UTC) + timedelta(seconds=5), usegmt=True)
    model_server.script(Fault(429, retry_after=later), Fault(429, retry_after=soon), Reply("hi"))
    assert client.chat(USER).content == "hi"
    assert sleeps[0] == 8.0  # backoff_max
    assert 3.0 < sleeps[1] <= 5.0


def test_500_then_success_with_jittered_backoff(model_server: ScriptedModelServer,
                                                client: LLMClient, sleeps: list[float]) -> None:
    model_server.script(Fault(500), Fault(503), Reply("recovered"))
    assert client.chat(USER).content == "recovered"
    assert len(sleeps) == 2
    assert 0.0 <= sleeps[0] <= 1.0 and 0.0 <= sleeps[1] <= 2.0


@pytest.mark.parametrize("fault", [CutStream(3), CutStream(3, clean=True), Garbage()],
                         ids=["cut-connection", "cut-clean-eof", "garbage-chunk"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_broken_answer_then_success(model_server: ScriptedModelServer, client: LLMClient,
                                    sleeps: list[float], fault: Any, stream: bool) -> None:
    model_server.script(fault, Reply("whole answer"))
    result = client.chat(USER, stream=stream)
    assert result.message == {"role": "assistant", "content": "whole answer"}
    assert len(sleeps) == 1 and len(model_server.requests) == 2


def test_read_timeout_then_success(model_server: ScriptedModelServer,
                                   sleeps: list[float]) -> None:
    model_server.script(Slow(0.5), Reply("in time"))
    with make_client(model_server, sleeps, read_timeout=0.1) as c:
        assert c.chat(USER).content == "in time"
    assert len(sleeps) == 1


def test_retries_exhausted_raise_typed_errors_without_the_key(
        model_server: ScriptedModelServer, client: LLMClient, sleeps: list[float],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    model_server.script(Fault(500, body=f"upstream echoed {KEY}"), Fault(502), Fault(500))
    with pytest.raises(ModelHTTPError) as info:
        client.chat(USER)
    error = info.value
    assert error.status_code == 500 and "gave up after 3 tries" in str(error)
    assert len(sleeps) == 2
    model_server.script(*[Fault(429)] * 3)
    with pytest.raises(ModelRateLimitError) as limited:
        client.chat(USER)
    assert "429" in str(limited.value)
    assert_secret_free(str(error), repr(error), error.body, str(limited.value), repr(client),
                       caplog.text, *(r.getMessage() for r in caplog.records))
    assert "***" in repr(client)


def test_stream_cut_every_time_raises_response_error(model_server: ScriptedModelServer,
                                                     client: LLMClient) -> None:
    model_server.script(CutStream(2), CutStream(4, clean=True), Garbage(), Reply("too late"))
    with pytest.raises(ModelResponseError, match=r"not JSON.*gave up after 3 tries"):
        client.chat(USER)
    assert model_server.pending == 1


@pytest.mark.parametrize("status", [400, 403, 422])
def test_client_errors_are_not_retried(model_server: ScriptedModelServer, client: LLMClient,
                                       sleeps: list[float], status: int) -> None:
    model_server.script(Fault(status), Reply("never"))
    with pytest.raises(ModelHTTPError) as info:
        client.chat(USER)
    assert info.value.status_code == status and sleeps == [] and model_server.pending == 1


@pytest.mark.parametrize("status", [408, 409, 502])
def test_retryable_statuses(model_server: ScriptedModelServer, client: LLMClient,
                            sleeps: list[float], status: int) -> None:
    model_server.script(Fault(status), Reply("ok"))
    assert client.chat(USER).content == "ok" and len(sleeps) == 1


def test_401_says_check_the_api_key(model_server: ScriptedModelServer,
                                    sleeps: list[float]) -> None:
    model_server.require_key = "the-right-key"
    with make_client(model_server, sleeps) as c, pytest.raises(ModelHTTPError) as info:
        c.chat(USER)
    assert info.value.status_code == 401 and "SWARM_API_KEY" in str(info.value)
    assert_secret_free(str(info.value)) and sleeps == []
    with make_client(model_server, sleeps, api_key="") as c, pytest.raises(ModelHTTPError) as info:
        c.chat(USER)
    assert "not set" in str(info.value)


def test_404_says_check_base_url(model_server: ScriptedModelServer, sleeps: list[float]) -> None:
    wrong = model_server.base_url.removesuffix("/v1")
    with LLMClient(wrong, "scripted-model", sleep=sleeps.append) as c, \
            pytest.raises(ModelHTTPError) as info:
        c.chat(USER)
    assert info.value.status_code == 404
    assert "SWARM_BASE_URL ends in /v1" in str(info.value) and "SWARM_MODEL" in str(info.value)


def test_400_about_context_says_the_prompt_is_too_long(model_server: ScriptedModelServer,
                                                       client: LLMClient) -> None:
    model_server.script(Fault(400, body={"error": {
        "message": "This model's maximum context length is 4096 tokens. However, you requested "
                   "5000 tokens.", "code": "context_length_exceeded"}}))
    with pytest.raises(ModelHTTPError, match="longer than the context window"):
        client.chat(USER)


def test_connection_refused(sleeps: list[float]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with LLMClient(url, "m", Secret(KEY), retries=4, sleep=sleeps.append) as c, \
            pytest.raises(ModelConnectionError) as info:
        c.chat(USER)
    assert url in str(info.value) and "running" in str(info.value)
    assert_secret_free(str(info.value))
    assert len(sleeps) == 3


def test_mid_stream_details_over_mock_transport(sleeps: list[float]) -> None:
    """What the scripted server never sends: an error event, pings, a last event without its
    blank line and no finish_reason; and the exact Authorization header."""
    answers = [
        b': hello\n\nevent: ping\ndata: \n\ndata: {"choices":[{"delta":{"content":"par"}}]}\n\n'
        b'data: {"error": {"message": "upstream overloaded"}}\n\n',
        b'data: {"choices":[{"delta":{"content":"whole"}}]}\r\n\r\ndata: [DONE]',
    ]
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=answers[len(seen) - 1])

    with LLMClient("http://model.test/v1", "m", Secret(KEY), sleep=sleeps.append,
                   transport=httpx.MockTransport(handler)) as c:
        assert c.chat(USER).message == {"role": "assistant", "content": "whole"}
    assert [r.headers["authorization"] for r in seen] == [f"Bearer {KEY}"] * 2
    assert len(sleeps) == 1


class Relay:
    """A TCP relay in front of the scripted server that counts the connections it carries:
    how many were opened, and the most open at once."""

    def __init__(self, target: ScriptedModelServer) -> None:
        self.target = ("127.0.0.1", int(target.base_url.split(":")[2].split("/")[0]))
        self.opened = 0
        self.open = 0
        self.most_open = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.opened += 1
                self.open += 1
                self.most_open = max(self.most_open, self.open)
            upstream = socket.create_connection(self.target)
            done = threading.Event()
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b, done), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, done: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            if not done.is_set():
                done.set()
                with self.lock:
                    self.open -= 1

    def close(self) -> None:
        self.listener.close()


def test_concurrent_calls_share_one_client(model_server: ScriptedModelServer,
                                           sleeps: list[float]) -> None:
    """Calls from many threads at once go through one client's connection pool: a second
    round of concurrent calls opens no new connection."""
    model_server.latency = 0.2
    relay = Relay(model_server)
    results: list[str] = []

    def call(i: int, start: threading.Barrier) -> None:
        start.wait(10)
        results.append(client.chat([{"role": "user", "content": f"run `echo {i}`"}],
                                   [RUN_CLI]).tool_calls[0]["function"]["arguments"])

    def round_of(n: int) -> None:
        start = threading.Barrier(n)
        threads = [threading.Thread(target=call, args=(i, start)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    with LLMClient(relay.base_url, "scripted-model", sleep=sleeps.append) as client:
        round_of(8)
        assert relay.most_open > 1  # the calls did overlap
        opened = relay.opened
        round_of(8)
        assert relay.opened == opened  # and the second round reused the first's connections
    relay.close()
    assert sorted(json.loads(r)["command"] for r in results) == \
        sorted(f"echo {i}" for i in [*range(8), *range(8)])
    assert sleeps == []


# -- what the HTTP transport does (httpx's own) ---------------------------------------------


class RawServer:
    """Serves HTTP/1.1 connections one request at a time from a list of answers (each
    writes its bytes and says whether to keep the connection); records every request."""

    def __init__(self, *answers: Callable[[socket.socket], bool]) -> None:
        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = threading.Semaphore(0)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
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
                if not self.answers.pop(0)(conn):
                    return
        finally:
            conn.close()
            self.closed.release()

    def close(self) -> None:
        self.listener.close()


def completion_bytes(content: str) -> bytes:
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]}).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


def answer(content: str, keep: bool = True) -> Callable[[socket.socket], bool]:
    def write(conn: socket.socket) -> bool:
        conn.sendall(completion_bytes(content))
        return keep
    return write


def hang_up(conn: socket.socket) -> bool:
    """Read the request, answer nothing, close."""
    return False


def test_a_connection_the_server_closed_while_idle_costs_no_retry(sleeps: list[float]) -> None:
    server = RawServer(answer("one", keep=False), answer("two"))
    with LLMClient(f"http://127.0.0.1:{server.port}/v1", "m", Secret(KEY),
                   sleep=sleeps.append) as c:
        assert c.chat(USER, stream=False).content == "one"
        assert server.closed.acquire(timeout=10)  # the client still holds it as idle
        assert c.chat(USER, stream=False).content == "two"
    assert server.connections == 2 and len(server.requests) == 2 and sleeps == []
    server.close()


def test_a_request_the_server_received_is_not_sent_again_unasked(sleeps: list[float]) -> None:
    """A server that hangs up after reading a request may have run it (a model call is
    billed): only the client's own retry, after its backoff, may send it again."""
    server = RawServer(answer("one"), hang_up, answer("three"))
    with LLMClient(f"http://127.0.0.1:{server.port}/v1", "m", Secret(KEY), retries=2,
                   sleep=sleeps.append) as c:
        assert c.chat(USER, stream=False).content == "one"
        assert c.chat(USER, stream=False).content == "three"
    assert len(server.requests) == 3 and len(sleeps) == 1
    server.close()


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def test_a_proxy_from_the_environment_is_used(no_proxy_env: pytest.MonkeyPatch,
                                              sleeps: list[float]) -> None:
    proxy = RawServer(answer("via the proxy"))
    no_proxy_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
    with LLMClient("http://model.invalid:8000/v1", "m", Secret(KEY), retries=1,
                   sleep=sleeps.append) as c:
        assert c.chat(USER, stream=False).content == "via the proxy"
    (request,) = proxy.requests
    assert request.startswith(b"POST http://model.invalid:8000/v1/chat/completions HTTP/1.1")
    assert b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n" in request
    no_proxy_env.setenv("NO_PROXY", "model.invalid")
    with LLMClient("http://model.invalid:8000/v1", "m", Secret(KEY), retries=1,
                   sleep=sleeps.append) as c, pytest.raises(ModelConnectionError):
        c.chat(USER, stream=False)  # straight to a host that does not resolve
    assert len(proxy.requests) == 1
    proxy.close()


def test_user_info_in_the_base_url_is_neither_sent_nor_shown(
        model_server: ScriptedModelServer, sleeps: list[float],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    model_server.require_key = KEY  # a Basic header from the user info would get a 401
    model_server.context_length = 4321
    with_user = model_server.base_url.replace("http://", "http://alice:hunter2@")
    model_server.script(Reply("hi"))
    with LLMClient(with_user, "scripted-model", Secret(KEY), sleep=sleeps.append) as c:
        assert c.chat(USER).content == "hi"
        assert c.context_length() == 4321  # GET /models carried the Bearer key too
        shown = [repr(c), c.base_url]
    wrong = with_user.removesuffix("/v1")
    with LLMClient(wrong, "scripted-model", Secret(KEY), retries=2,
                   sleep=sleeps.append) as c:
        assert c.context_length() == 128_000  # /models failed: the warning names the URL
        with pytest.raises(ModelHTTPError) as info:
            c.chat(USER)
        shown += [str(info.value), repr(c)]
    shown += [caplog.text, *(r.getMessage() for r in caplog.records)]
    assert not [text for text in shown if "hunter2" in text or "alice" in text]
    assert "cannot read the context length from http://127.0.0.1:" in caplog.text
    assert caplog.text.count("user name or password") == 2  # once per base URL


def test_a_line_break_in_the_api_key_is_refused_before_sending(
        model_server: ScriptedModelServer, sleeps: list[float]) -> None:
    with make_client(model_server, sleeps, api_key="sk-1\r\nX-Injected: yes") as c, \
            pytest.raises(ConfigError, match="SWARM_API_KEY") as info:
        c.chat(USER)
    assert model_server.requests == [] and sleeps == []
    assert "X-Injected" not in str(info.value)


# -- odd servers over a mock transport ------------------------------------------------------


def mock_client(handler: Any, sleeps: list[float], **kw: Any) -> LLMClient:
    return LLMClient("http://model.test/v1", "m", Secret(KEY), retries=3,
                     sleep=sleeps.append, transport=httpx.MockTransport(handler), **kw)


def completion(content: str, usage: Any) -> dict[str, Any]:
    return {"choices": [{"message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}], "usage": usage}


@pytest.mark.parametrize("usage", [{"prompt_tokens": "n/a", "completion_tokens": 2},
                                   {"prompt_tokens": {}, "total_tokens": [3]},
                                   {"prompt_tokens": None, "completion_tokens": None}, "lots",
                                   {"prompt_tokens": -5}, {"completion_tokens": 2.5}])
@pytest.mark.parametrize("stream", [False, True])
def test_garbage_usage_is_replaced_by_swarms_own_count(sleeps: list[float], usage: Any,
                                                        stream: bool) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if not stream:
            return httpx.Response(200, json=completion("fine", usage))
        chunks = [{"choices": [{"delta": {"content": "fine"}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": usage}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    with mock_client(handler, sleeps) as c:
        result = c.chat(USER, stream=stream)
    assert result.content == "fine" and sleeps == []
    if usage == {"prompt_tokens": None, "completion_tokens": None}:  # none reported
        assert result.usage.total_tokens == 0 and result.notices == {}
    else:  # a quarter of the request's bytes, a quarter of the answer's characters
        assert result.usage.prompt_tokens > 0 and result.usage.completion_tokens == 1
        assert "cannot be true" in result.notices["usage"]


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000,
                                  b"data: " + b"[" * 100_000 + b"\n\n"], ids=["json", "sse"])
def test_unreadable_answers_end_in_model_response_error(sleeps: list[float], body: bytes) -> None:
    with mock_client(lambda request: httpx.Response(200, content=body), sleeps) as c, \
            pytest.raises(ModelResponseError, match=r"not JSON.*gave up after 3 tries"):
        c.chat(USER)
    assert len(sleeps) == 2


def test_a_body_that_does_not_match_its_encoding_is_a_model_response_error(
        sleeps: list[float]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-encoding": "gzip",
                                            "content-type": "application/json"},
                              content=b"not gzip at all")

    with mock_client(handler, sleeps) as c, \
            pytest.raises(ModelResponseError, match="DecodingError") as info:
        c.chat(USER)
    assert "gave up after 3 tries" in str(info.value) and len(sleeps) == 2


@pytest.mark.parametrize("message", ["Streaming is not supported by this endpoint",
                                     "unsupported parameter: stream"])
def test_stream_true_rejected_once_then_whole_answers(sleeps: list[float], message: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        if sent[-1]["stream"]:
            return httpx.Response(400, json={"error": {"message": message}})
        return httpx.Response(200, json=completion(f"answer {len(sent)}", None))

    events: list[StreamEvent] = []
    with mock_client(handler, sleeps) as c:
        assert c.chat(USER, on_event=events.append).content == "answer 2"
        assert c.chat(USER).content == "answer 3"
        assert c.chat(USER, stream=True).content == "answer 4"
    assert [r["stream"] for r in sent] == [True, False, False, False]
    assert "stream_options" not in sent[1]
    assert events == [StreamEvent("content", "answer 2")] and sleeps == []
    assert "stream: true" in caplog.text


def test_a_400_not_about_streaming_is_not_retried_without_it(sleeps: list[float]) -> None:
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "bad temperature; upstream said no"}})

    with mock_client(handler, sleeps) as c, pytest.raises(ModelHTTPError, match="temperature"):
        c.chat(USER)
    assert len(sent) == 1


@pytest.mark.parametrize("url", ["http://[::1/v1", f"http://[::1/v1?key={KEY}", "ftp://host/v1",
                                 "localhost:8080/v1"])
def test_an_unusable_base_url_is_a_config_error(sleeps: list[float], url: str) -> None:
    with LLMClient(url, "m", Secret(KEY), sleep=sleeps.append) as c:
        with pytest.raises(ConfigError, match=r"SWARM_BASE_URL.*e\.g\. http://") as info:
            c.chat(USER)
        with pytest.raises(ConfigError) as listing:
            c.list_models()
    assert sleeps == []
    assert_secret_free(str(info.value), repr(info.value), str(listing.value))


# -- models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("style,expected", [("vllm", 12_345), ("llamacpp", 12_345),
                                            ("openrouter", 12_345), ("none", 99_000)])
def test_context_length_per_style(model_server: ScriptedModelServer, sleeps: list[float],
                                  style: Any, expected: int) -> None:
    model_server.context_style = style
    model_server.context_length = 12_345
    with make_client(model_server, sleeps, default_context_length=99_000) as c:
        assert c.context_length() == expected
        assert c.context_length() == expected
    assert model_server.models_requests == 1


def test_context_length_falls_back_when_models_fails(
        model_server: ScriptedModelServer, sleeps: list[float],
        caplog: pytest.LogCaptureFixture) -> None:
    wrong = model_server.base_url.removesuffix("/v1")
    with LLMClient(wrong, "m", default_context_length=4096, sleep=sleeps.append) as c:
        assert c.context_length() == 4096
    assert "SWARM_CONTEXT_LENGTH" in caplog.text


def test_model_not_listed(model_server: ScriptedModelServer, sleeps: list[float]) -> None:
    model_server.models = ["qwen3-32b", "llama-3.3-70b"]
    with make_client(model_server, sleeps, model="gpt-5") as c, \
            pytest.raises(ModelNotFoundError) as info:
        c.context_length()
    assert "'gpt-5'" in str(info.value)
    assert "qwen3-32b, llama-3.3-70b" in str(info.value)


def test_resolve_model_with_one_listed(model_server: ScriptedModelServer,
                                       sleeps: list[float]) -> None:
    model_server.models = ["only-one"]
    model_server.script(Reply("ok"))
    with make_client(model_server, sleeps, model="") as c:
        assert c.chat(USER).content == "ok"
        assert c.model == "only-one" and c.context_length() == 32_768
    assert model_server.requests[0]["model"] == "only-one"
    assert model_server.models_requests == 1


def test_resolve_model_with_several_listed(model_server: ScriptedModelServer,
                                           sleeps: list[float]) -> None:
    model_server.models = ["a", "b"]
    with make_client(model_server, sleeps, model="") as c, \
            pytest.raises(ConfigError, match="SWARM_MODEL to one of: a, b"):
        c.resolve_model()


def test_from_settings(model_server: ScriptedModelServer) -> None:
    settings = Settings.from_env({}, base_url=model_server.base_url, model="scripted-model",
                                 api_key=KEY, retries=2, stream=False)
    model_server.require_key = KEY
    model_server.script(Reply("configured"))
    with LLMClient.from_settings(settings) as c:
        assert c.tries == 2 and c.stream is False
        assert c.chat(USER).content == "configured"
    assert model_server.requests[0]["stream"] is False


# -- the scripted server itself ----------------------------------------------------------------


def test_reviews_bypass_the_script(model_server: ScriptedModelServer, client: LLMClient) -> None:
    model_server.script(Reply("scripted"))

    def review(command: str) -> str:
        return client.chat([{"role": "user", "content": f"Review:\n<command>\n{command}\n"
                                                        "</command>"}], temperature=0).content

    assert review("ls -la | grep x") == "ALLOW"
    assert review("git status") == "ALLOW"
    assert review("rm -rf /") == "DENY"
    assert review("find . -delete") == "DENY"
    assert review("echo hi > file") == "DENY"
    assert model_server.pending == 1 and len(model_server.review_requests) == 5
    assert model_server.requests == []
    assert client.chat(USER).content == "scripted"


def test_demo_responder(client: LLMClient) -> None:
    call = client.chat([{"role": "user", "content": "please run `ls -la`"}], [RUN_CLI])
    assert json.loads(call.tool_calls[0]["function"]["arguments"]) == {"command": "ls -la"}
    history = [*USER, call.message, {"role": "tool", "tool_call_id": call.tool_calls[0]["id"],
                                     "content": "x" * 5000}]
    done = client.chat(history, [RUN_CLI])
    assert done.content == "Done. Output:\n" + "x" * 5000  # whole: it was cut at 500, unmarked
    assert client.chat(USER).content and not client.chat(USER).tool_calls


def test_script_file_format(tmp_path: Path) -> None:
    items = parse_script([{"content": "hi"}, {"fault": 429, "retry_after": 1},
                          {"tool_calls": [{"name": "run_cli", "arguments": {"command": "ls"}}]},
                          {"cut": 2}, {"garbage": True}, {"slow": 0.5}])
    assert items == [Reply("hi"), Fault(429, 1), Reply(None, [ToolCall("run_cli",
                     {"command": "ls"})]), CutStream(2), Garbage(), Slow(0.5)]
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0


# -- a misbehaving server cannot make a call unbounded ---------------------------------------


def test_a_silent_server_fails_at_the_call_timeout_not_the_read_timeout(
        model_server: ScriptedModelServer, sleeps: list[float]) -> None:
    model_server.script(Slow(20, Reply("too late")))
    with make_client(model_server, sleeps, read_timeout=60, call_timeout=0.5) as c, \
            pytest.raises(ModelConnectionError, match=r"after 0\.5 s \(SWARM_CALL_TIMEOUT\)"):
        c.chat(USER)
    assert len(model_server.requests) == 1 and sleeps == []  # not tried again


@pytest.mark.parametrize("stream", [True, False])
def test_a_tool_call_cut_short_is_left_out_and_the_cut_marked(
        model_server: ScriptedModelServer, sleeps: list[float], stream: bool) -> None:
    model_server.script(Reply("a" * 300, [ToolCall("run_cli", {"command": "true"}),
                                          ToolCall("run_cli", {"command": "b" * 5000})]))
    events: list[StreamEvent] = []
    with make_client(model_server, sleeps, answer_max=1000) as c:
        result = c.chat(USER, [RUN_CLI], stream=stream, on_event=events.append)
    assert result.cut == "cut at 1,000 characters (SWARM_ANSWER_MAX=1000)"
    assert [json.loads(call["function"]["arguments"]) for call in result.tool_calls] == [
        {"command": "true"}]
    assert result.content == "a" * 300 + (
        "\n\n[swarm: this answer was cut at 1,000 characters (SWARM_ANSWER_MAX=1000); the rest "
        "of it was dropped, with its unfinished call of run_cli]")
    assert "".join(e.text for e in events if e.kind == "content") == "a" * 300


@pytest.mark.parametrize("kind", ["stream", "whole", "stream in a whole body"])
def test_an_answer_in_one_piece_too_large_to_read_is_read_as_far_as_it_goes(
        sleeps: list[float], kind: str) -> None:
    text = "é" * 3_000_000  # 6 bytes a character once escaped: past any bound of the cap
    def handler(request: httpx.Request) -> httpx.Response:
        if kind == "whole":
            return httpx.Response(200, json=completion(text, {"prompt_tokens": 3}))
        chunk = {"choices": [{"delta": {"content": text}, "finish_reason": "stop"}]}
        body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=body, headers={
            "content-type": "text/event-stream" if kind == "stream" else "application/json"})

    with mock_client(handler, sleeps, answer_max=100_000) as c:
        result = c.chat(USER, stream=kind != "whole")
    assert result.cut and sleeps == []
    assert result.content.startswith("é" * 100_000 + "\n\n[swarm: this answer was cut at")


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 10**12, "completion_tokens": 5, "total_tokens": 10**12 + 5},
    {"prompt_tokens": 5, "completion_tokens": 10**9},
    {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10**9}])
def test_token_counts_that_cannot_be_true_give_way_to_swarms_own(
        model_server: ScriptedModelServer, sleeps: list[float], usage: dict[str, int]) -> None:
    model_server.script(Reply("fine", usage=usage), Reply("fine", usage={
        "prompt_tokens": 900, "completion_tokens": 1, "total_tokens": 901}))
    with make_client(model_server, sleeps) as c:
        lied, told = c.chat(USER), c.chat(USER)
    sent = len(json.dumps(model_server.requests[0], separators=(",", ":")))
    assert abs(lied.usage.prompt_tokens - sent // 4) <= 8 and lied.usage.completion_tokens == 1
    assert "cannot be true" in lied.notices["usage"]
    assert told.usage.total_tokens == 901 and told.notices == {}  # a plausible one is kept
