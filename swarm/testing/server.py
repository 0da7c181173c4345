"""A scripted OpenAI-compatible model server over real HTTP, for tests and demos.

::

    with ScriptedModelServer() as server:
        server.script(Fault(429, retry_after=1), Reply("hi"))
        ...  # point a client at server.base_url

Each chat request takes the next scripted item; when none is left the
``responder`` answers. Safety reviews (a request without tools whose messages
hold ``<command>...</command>``) never touch the script: ``reviewer`` answers them.

Run by hand: ``python -m swarm.testing.server --port 8099`` (``-h`` says what it answers);
a task ``fan out 3: `pwd` `` makes it call the ``agent`` tool (see :func:`demo_responder`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import shlex
import socket
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

from swarm.text import plural

ContextStyle = Literal["vllm", "llamacpp", "openrouter", "none"]
IdStyle = Literal["openai", "llamacpp"]


@dataclass
class ToolCall:
    """A tool call the model makes; ``arguments`` as a dict or a raw (maybe broken) JSON string."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None
    """Fixed call id; None makes one in the server's id style."""


@dataclass
class Reply:
    """One answer of the model."""

    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    usage: dict[str, int] | None = None
    """None counts roughly four characters a token."""
    finish_reason: str | None = None
    """None means ``tool_calls`` when there are calls, else ``stop``."""


@dataclass
class Fault:
    """Answer with an HTTP error status (and ``Retry-After`` when given)."""

    status: int = 500
    retry_after: float | str | None = None
    body: str | dict[str, Any] | None = None
    """None gives an OpenAI-style error object."""


@dataclass
class CutStream:
    """Start the answer, then stop after ``after_chunks`` SSE events without ``[DONE]``.

    ``clean=False`` drops the connection mid-body; ``clean=True`` ends the HTTP body
    properly, so the client sees a plain end of stream without a finish_reason.
    """

    after_chunks: int = 3
    clean: bool = False


@dataclass
class Garbage:
    """Answer 200 with a body (or stream chunk) that is not JSON."""


@dataclass
class Slow:
    """Wait ``seconds`` before answering with ``reply`` (None: the responder's answer)."""

    seconds: float
    reply: Reply | None = None
    after_thinking: bool = False
    """When streaming, send the reply's thinking first and wait before the rest."""


Item = Reply | Fault | CutStream | Garbage | Slow
Responder = Callable[[dict[str, Any]], Item]
"""Answers a request: a reply, or a fault (``Fault``, ``CutStream``, ...) to inject."""
Reviewer = Callable[[str], str]

_CUT_TEXT = "This answer is long enough to be cut into many small pieces before it ends. " * 3
_READ_ONLY = {"ls", "cat", "head", "tail", "grep", "wc", "pwd", "echo", "find"}
_GIT_READ_ONLY = {"status", "log", "diff"}
_COMMAND = re.compile(r"<command>\s*(.*?)\s*</command>", re.S)
_FENCED = re.compile(r"```[\w-]*\n(.*?)```", re.S)
_BACKTICKED = re.compile(r"`([^`\n]+)`")


def default_reviewer(command: str) -> str:
    """``ALLOW`` for plainly read-only commands (pipes of them too), ``DENY`` for the rest."""
    if re.search(r"[;&<>`]|\$\(", command):
        return "DENY"
    for segment in command.split("|"):
        try:
            words = shlex.split(segment)
        except ValueError:
            return "DENY"
        if not words:
            return "DENY"
        head = words[0]
        if head == "git":
            if len(words) < 2 or words[1] not in _GIT_READ_ONLY:
                return "DENY"
        elif head not in _READ_ONLY:
            return "DENY"
        if head == "find" and any(w in {"-delete", "-exec", "-execdir", "-ok", "-okdir",
                                        "-fprint", "-fprintf", "-fls"} for w in words):
            return "DENY"
    return "ALLOW"


MAX_FAN_OUT = 200
"""The most children one ``fan out N`` task asks for (the swarm's own limits still apply)."""
FAN_OUT_COMMAND = "pwd"
"""What the children of a ``fan out N`` task without a command run."""
_FAN_OUT = re.compile(r"\bfan[ -]?out\b\W*(?:to\W+)?(\d+)", re.I)
HELLO = ("Hello from the scripted model. Put a command in `backticks` and I will run it; "
         "'fan out 3: `pwd`' hands it to 3 child agents and sums up their answers.")


def demo_responder(request: dict[str, Any]) -> Reply:
    """What the scripted model answers when nothing is scripted; it looks only at the
    request, so any number of conversations (a swarm) may talk to it at once:

    - ``fan out N: `COMMAND` `` (a user message): ``N`` calls of the ``agent`` tool, each
      child told to run COMMAND (default ``pwd``) and report its output;
    - the results of ``agent`` calls: a summary, one line per child;
    - a command in backticks (or a fenced block): a ``run_cli`` call; its result: the output;
    - anything else: a greeting that says the above.
    """
    messages = request.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    text = message_text(last)
    if last.get("role") == "tool":
        return fan_in_reply(messages) or Reply("Done. Output:\n" + text[:500])
    if last.get("role") == "user":
        fan_out = fan_out_reply(text, request)
        if fan_out is not None:
            return fan_out
        match = _FENCED.search(text) or _BACKTICKED.search(text)
        if match and match.group(1).strip():
            return Reply(tool_calls=[ToolCall("run_cli", {"command": match.group(1).strip()})])
    return Reply(HELLO)


def fan_out_reply(text: str, request: dict[str, Any]) -> Reply | None:
    """The ``agent`` calls a ``fan out N`` message asks for; None when ``text`` is not one.

    The form is looked for outside backticks, so a child told to run ``echo fan out 2``
    does not fan out itself."""
    match = _FAN_OUT.search(_BACKTICKED.sub("", _FENCED.sub("", text)))
    if match is None:
        return None
    count = int(match[1])
    if not 1 <= count <= MAX_FAN_OUT:
        return Reply(f"I fan out to 1 to {MAX_FAN_OUT} children, not {count}.")
    offered = {str((t.get("function") or {}).get("name")) for t in request.get("tools") or []
               if isinstance(t, dict)}
    if "agent" not in offered:
        return Reply("I cannot fan out here: this request does not offer the `agent` tool.")
    found = _FENCED.search(text) or _BACKTICKED.search(text)
    command = found.group(1).strip() if found and found.group(1).strip() else FAN_OUT_COMMAND
    quoted = f"```sh\n{command}\n```" if "`" in command or "\n" in command else f"`{command}`"
    return Reply(
        content=f"Handing {quoted} to {plural(count, 'child agent')}.",
        tool_calls=[ToolCall("agent", {"message": f"child {i} of {count}: run {quoted} and "
                                                  "report its output"})
                    for i in range(1, count + 1)])


def fan_in_reply(messages: list[dict[str, Any]]) -> Reply | None:
    """A summary of the children's results when the last tool messages answer ``agent``
    calls (one line per child: id, state, its answer or error); else None."""
    start = len(messages)
    while start and isinstance(messages[start - 1], dict) \
            and messages[start - 1].get("role") == "tool":
        start -= 1
    asked = messages[start - 1] if start else {}
    calls = (asked.get("tool_calls") if isinstance(asked, dict) else None) or []
    if start == len(messages) or not calls or any(
            not isinstance(c, dict) or (c.get("function") or {}).get("name") != "agent"
            for c in calls):
        return None
    states: dict[str, int] = {}
    rows = []
    for message in messages[start:]:
        text = message_text(message)
        try:
            result = json.loads(text)
        except ValueError:
            result = None
        if not isinstance(result, dict):
            result = {"state": "unknown", "answer": text}
        state = str(result.get("state") or "unknown")
        states[state] = states.get(state, 0) + 1
        if state == "done":
            said = json.dumps(result["output"]) if "output" in result else result.get("answer")
        else:
            said = result.get("error") or result.get("answer")
        said = " ".join(str(said or "").split())
        rows.append(f"- {result.get('agent_id') or '-'} {state}: {said[:300]}")
    tally = ", ".join(f"{n} {state}" for state, n in states.items())
    return Reply(f"{plural(len(rows), 'child', 'children')}: {tally}.\n" + "\n".join(rows))


def message_text(message: dict[str, Any]) -> str:
    """The text of a message whose content is a string or a list of parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def review_command(request: dict[str, Any]) -> str | None:
    """The command of a safety-review request, or None when the request is not one."""
    if request.get("tools"):
        return None
    for message in reversed(request.get("messages") or []):
        if isinstance(message, dict):
            match = _COMMAND.search(message_text(message))
            if match:
                return match.group(1)
    return None


def parse_script(items: Iterable[dict[str, Any]]) -> list[Item]:
    """Script items from JSON objects: ``{"content"|"tool_calls"|"reasoning": ...}``,
    ``{"fault": 429, "retry_after": 1}``, ``{"cut": 3}``, ``{"garbage": true}``, ``{"slow": 2}``."""
    out: list[Item] = []
    for raw in items:
        if "fault" in raw:
            out.append(Fault(int(raw["fault"]), raw.get("retry_after"), raw.get("body")))
        elif "cut" in raw:
            out.append(CutStream(int(raw["cut"]), bool(raw.get("clean", False))))
        elif raw.get("garbage"):
            out.append(Garbage())
        elif "slow" in raw:
            out.append(Slow(float(raw["slow"])))
        else:
            calls = [ToolCall(c["name"], c.get("arguments", {}), c.get("id"))
                     for c in raw.get("tool_calls", [])]
            out.append(Reply(raw.get("content"), calls, raw.get("reasoning"), raw.get("usage")))
    return out


class ScriptedModelServer:
    """An OpenAI-compatible HTTP server on 127.0.0.1 whose answers are scripted.

    Settings are plain attributes read on every request, so a test may change
    them on a running server.
    """

    def __init__(
        self,
        *,
        models: Iterable[str] = ("scripted-model",),
        context_style: ContextStyle = "vllm",
        context_length: int = 32_768,
        tool_call_ids: IdStyle = "openai",
        latency: float = 0.0,
        require_key: str | None = None,
        responder: Responder = demo_responder,
        reviewer: Reviewer = default_reviewer,
        force_stream: bool | None = None,
        reject_stream_options: bool = False,
        reasoning_key: str = "reasoning_content",
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.models = list(models)
        self.context_style: ContextStyle = context_style
        self.context_length = context_length
        self.tool_call_ids: IdStyle = tool_call_ids
        self.latency = latency
        self.require_key = require_key
        self.responder = responder
        self.reviewer = reviewer
        self.force_stream = force_stream
        """None honours the request's ``stream``; True/False ignores it, like some servers."""
        self.reject_stream_options = reject_stream_options
        """Answer 400 to requests carrying ``stream_options``, like some older servers."""
        self.reasoning_key = reasoning_key
        self.host = host
        self.port = port
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._queue: deque[Item] = deque()
        self._requests: list[dict[str, Any]] = []
        self._reviews: list[dict[str, Any]] = []
        self.models_requests = 0
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ScriptedModelServer:
        """Bind and serve in a daemon thread."""
        if self._httpd is None:
            self._httpd = _HTTPServer((self.host, self.port), _Handler)
            self._httpd.owner = self
            self.port = self._httpd.server_address[1]
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01},
                name=f"scripted-model:{self.port}", daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> ScriptedModelServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1`` (start the server first)."""
        if self._httpd is None:
            raise RuntimeError("the scripted model server is not started")
        return f"http://{self.host}:{self.port}/v1"

    # -- scripting ---------------------------------------------------------------------------

    def script(self, *items: Item) -> ScriptedModelServer:
        """Queue answers; each chat request (not a review) takes one."""
        with self._lock:
            self._queue.extend(items)
        return self

    @property
    def pending(self) -> int:
        """Scripted items not yet used."""
        with self._lock:
            return len(self._queue)

    @property
    def requests(self) -> list[dict[str, Any]]:
        """JSON bodies of the chat requests received (reviews excluded), oldest first."""
        with self._lock:
            return list(self._requests)

    @property
    def review_requests(self) -> list[dict[str, Any]]:
        """JSON bodies of the safety-review requests received."""
        with self._lock:
            return list(self._reviews)

    def _record(self, request: dict[str, Any], review: bool) -> None:
        with self._lock:
            (self._reviews if review else self._requests).append(request)

    def _take(self, request: dict[str, Any]) -> Item:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        return self.responder(request)

    def _call_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        with self._lock:
            if self.tool_call_ids == "llamacpp":
                return "".join(self._rng.choices(alphabet, k=32))
            return "call_" + "".join(self._rng.choices(alphabet, k=24))

    def _split(self, text: str) -> list[str]:
        """Small pieces of 1-6 characters."""
        pieces = []
        with self._lock:
            i = 0
            while i < len(text):
                n = self._rng.randint(1, 6)
                pieces.append(text[i:i + n])
                i += n
        return pieces

    # -- answers -----------------------------------------------------------------------------

    def models_body(self) -> dict[str, Any]:
        """The body of ``GET /v1/models`` in the configured context style."""
        data = []
        for name in self.models:
            entry: dict[str, Any] = {"id": name, "object": "model", "created": 0,
                                     "owned_by": "swarm-testing"}
            if self.context_style == "vllm":
                entry["max_model_len"] = self.context_length
            elif self.context_style == "openrouter":
                entry["context_length"] = self.context_length
            elif self.context_style == "llamacpp":
                entry["meta"] = {"n_ctx": self.context_length, "n_ctx_train": 131_072,
                                 "n_vocab": 32_000}
            data.append(entry)
        return {"object": "list", "data": data}

    def _usage(self, reply: Reply, request: dict[str, Any], size: int | None) -> dict[str, int]:
        if reply.usage is not None:
            return dict(reply.usage)
        # From the body's size when the handler knows it: re-encoding every request cost
        # this server a seventh of its CPU.
        prompt = (size if size is not None else len(json.dumps(request.get("messages", [])))) // 4
        produced = (reply.content or "") + (reply.reasoning or "")
        produced += "".join(_arguments(c) + c.name for c in reply.tool_calls)
        completion = max(1, len(produced) // 4)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def stream_chunks(self, reply: Reply, request: dict[str, Any],
                      size: int | None = None) -> list[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of a streamed reply (without ``[DONE]``).

        Without a ``usage`` in the reply, prompt tokens are a quarter of ``size`` (the
        request body's length), else of the messages' JSON."""
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": request.get("model") or self.models[0]}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}]}

        out = [chunk({"role": "assistant", "content": ""})]
        out += [chunk({self.reasoning_key: p}) for p in self._split(reply.reasoning or "")]
        out += [chunk({"content": p}) for p in self._split(reply.content or "")]
        for index, call in enumerate(reply.tool_calls):
            pieces = self._split(_arguments(call))
            # llama.cpp puts the first piece of the arguments into the delta that names the call.
            first = pieces.pop(0) if self.tool_call_ids == "llamacpp" and pieces else ""
            out.append(chunk({"tool_calls": [{
                "index": index, "id": call.id or self._call_id(), "type": "function",
                "function": {"name": call.name, "arguments": first},
            }]}))
            out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": p}}]})
                    for p in pieces]
        out.append(chunk({}, _finish(reply)))
        options = request.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            out.append({**base, "choices": [], "usage": self._usage(reply, request, size)})
        return out

    def completion(self, reply: Reply, request: dict[str, Any],
                   size: int | None = None) -> dict[str, Any]:
        """The ``chat.completion`` object of a non-streamed reply (``size`` as for
        :meth:`stream_chunks`)."""
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.reasoning:
            message[self.reasoning_key] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.id or self._call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": _arguments(c)}}
                for c in reply.tool_calls
            ]
        elif message["content"] is None:
            message["content"] = ""
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
            "created": int(time.time()), "model": request.get("model") or self.models[0],
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish(reply)}],
            "usage": self._usage(reply, request, size),
        }


def _arguments(call: ToolCall) -> str:
    if isinstance(call.arguments, str):
        return call.arguments
    return json.dumps(call.arguments, ensure_ascii=False)


def _finish(reply: Reply) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def _error(message: str, kind: str, code: int | str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: ScriptedModelServer


class _Headers(dict[str, str]):
    """Request headers by lower-cased name; ``get`` ignores case, like ``email.message``."""

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


class _Handler(BaseHTTPRequestHandler):
    # Answers go out as many small writes; without TCP_NODELAY the last one waits for the
    # client's delayed ACK (~40 ms an answer), which would show up as swarm overhead.
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
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
            with self.owner._lock:
                self.owner.models_requests += 1
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
        owner._record(request, review=command is not None)
        if owner.reject_stream_options and "stream_options" in request:
            self._send_json(400, _error("Unrecognized request argument supplied: stream_options",
                                        "invalid_request_error", 400))
            return
        if owner.latency:
            time.sleep(owner.latency)
        if command is not None:
            self._reply(Reply(owner.reviewer(command)), request, stream)
            return
        item = owner._take(request)
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


FORMS = """\
what it answers (without --script, or once the script has run out):
  fan out N: `COMMAND`     calls the agent tool N times (1-200); each child runs COMMAND
                           (default: pwd) and answers with its output, then the root sums
                           the children's answers up, one line each. "fan out 3", "fan out
                           to 5 children: `ls -la`" and "Fan-out 2 `wc -l /etc/hosts`" work.
  a `command` in backticks calls run_cli with it, then answers with its output
  anything else            a greeting that says the above
  safety reviews           ALLOW for read-only commands (ls, cat, pwd, wc, ...), else DENY
It keeps no state: several copies answer one swarm alike (the root's and the workers').

try it (on the embedded default, nothing else to start):
  python -m swarm.testing.server --port 8099 &
  SWARM_BASE_URL=http://127.0.0.1:8099/v1 swarm run --yes 'fan out 3: `ls -la`'

--script FILE: a JSON list of answers, taken in order by the chat requests (reviews take
none), whichever conversation sends them; then the answers above:
  {"content": "..."}  {"tool_calls": [{"name": "agent", "arguments": {"message": "..."}}]}
  {"fault": 429, "retry_after": 1}  {"cut": 3}  {"garbage": true}  {"slow": 2}
examples/ in the swarm repository has scripts to start from.
"""


def main(argv: list[str] | None = None) -> None:
    """Serve the scripted model by hand (demos, trying a deployment)."""
    parser = argparse.ArgumentParser(
        prog="python -m swarm.testing.server",
        description="A scripted OpenAI-compatible model server, not an LLM. Point swarm at it\n"
        "with SWARM_BASE_URL=http://HOST:PORT/v1 (any SWARM_MODEL and SWARM_API_KEY).",
        epilog=FORMS, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 for other machines (default: "
                        "%(default)s)")
    parser.add_argument("--port", type=int, default=8099, help="(default: %(default)s)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--script", type=Path, metavar="FILE",
                        help="JSON list of answers, used in order (see below)")
    parser.add_argument("--model", action="append", help="model id to list (repeatable)")
    parser.add_argument("--context-style", default="vllm",
                        choices=["vllm", "llamacpp", "openrouter", "none"],
                        help="how /v1/models tells the context length")
    parser.add_argument("--context-length", type=int, default=32_768)
    parser.add_argument("--tool-call-ids", default="openai", choices=["openai", "llamacpp"])
    parser.add_argument("--api-key", help="answer 401 unless this bearer token is sent")
    args = parser.parse_args(argv)
    server = ScriptedModelServer(
        models=args.model or ["scripted-model"], context_style=args.context_style,
        context_length=args.context_length, tool_call_ids=args.tool_call_ids,
        latency=args.latency, require_key=args.api_key, host=args.host, port=args.port,
    )
    if args.script:
        try:
            items = json.loads(args.script.read_text())
            if not isinstance(items, list):
                raise ValueError("not a JSON list")
            server.script(*parse_script(items))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--script {args.script}: {exc}")
    try:
        server.start()
    except OSError as exc:
        parser.error(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
                     "pick another --port")
    try:
        print(f"scripted model serving on {server.base_url} (Ctrl-C stops)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
