"""A scripted OpenAI-compatible model server over real HTTP, for tests and demos.

::

    with ScriptedModelServer() as server:
        server.script(Fault(429, retry_after=1), Reply("hi"))
        ...  # point a client at server.base_url

Each chat request takes the next scripted item; when none is left the
``responder`` answers, unless the conversation is in recursion mode (its task says
``recurse N``, or :attr:`ScriptedModelServer.recurse` is set): then it always calls the
``agent`` tool (:mod:`swarm.testing.recursion`). Safety reviews (a request without tools
whose messages hold ``<command>...</command>``) never touch the script: ``reviewer``
answers them.

Run by hand: ``python -m swarm.testing.server --port 8099`` (``-h`` says what it answers);
a task ``fan out 3: `pwd` `` makes it call the ``agent`` tool (see
:func:`~swarm.testing.responders.default_responder`).

This module holds the server's state and the bodies it answers with; the items it is
scripted with are :mod:`swarm.testing.replies` (imported here too, so tests import them
from one place), the default answers :mod:`swarm.testing.responders`, and the HTTP
parsing and writing :mod:`swarm.testing.handler`.

Over 400 lines because the server's state and :func:`main` (its command line, run by hand)
describe the same modes; what stands alone is already in the modules named above.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from swarm.testing.handler import Handler, HTTPServer
from swarm.testing.misbehave import MODES
from swarm.testing.recursion import MAX_RECURSE, recursion_reply
from swarm.testing.replies import (
    CutStream,
    Fault,
    Garbage,
    Item,
    Reply,
    Responder,
    Reviewer,
    Slow,
    ToolCall,
    parse_script,
)
from swarm.testing.responders import (
    default_responder,
    default_reviewer,
    message_text,
    review_command,
)

__all__ = [
    "ContextStyle", "CutStream", "Fault", "Garbage", "IdStyle", "Item", "Reply", "Responder",
    "Reviewer", "ScriptedModelServer", "Slow", "ToolCall", "default_responder",
    "default_reviewer", "main", "message_text", "parse_script", "review_command",
]

ContextStyle = Literal["vllm", "llamacpp", "openrouter", "none"]
IdStyle = Literal["openai", "llamacpp"]


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
        responder: Responder = default_responder,
        reviewer: Reviewer = default_reviewer,
        force_stream: bool | None = None,
        reject_stream_options: bool = False,
        reasoning_key: str = "reasoning_content",
        seed: int = 0,
        misbehave: str | None = None,
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
        self.recurse = 0
        """Answer every conversation with this many ``agent`` calls (0: only those whose
        task says ``recurse N``)."""
        if misbehave is not None and misbehave not in MODES:
            raise ValueError(f"misbehave={misbehave!r} is not one of {', '.join(MODES)}")
        self.misbehave = misbehave
        """A mode of :mod:`swarm.testing.misbehave` for every chat request (None: only a
        conversation whose task says ``misbehave: MODE``)."""
        self.trickle_every = 2.0
        """Seconds between the 5-byte pieces of the ``trickle`` mode."""
        self.huge_size = 50_000_000
        """Bytes of text of the ``huge`` mode's answer."""
        self.host = host
        self.port = port
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._queue: deque[Item] = deque()
        self._requests: list[dict[str, Any]] = []
        self._reviews: list[dict[str, Any]] = []
        self.models_requests = 0
        self._httpd: HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ScriptedModelServer:
        """Bind and serve in a daemon thread."""
        if self._httpd is None:
            self._httpd = HTTPServer((self.host, self.port), Handler)
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

    def record(self, request: dict[str, Any], review: bool) -> None:
        """Keep a chat request (``review``: a safety review) for :attr:`requests`."""
        with self._lock:
            (self._reviews if review else self._requests).append(request)

    def take(self, request: dict[str, Any]) -> Item:
        """What to answer ``request`` with: the next scripted item, else the responder's."""
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        recursion = recursion_reply(request, self.recurse or None)
        return recursion if recursion is not None else self.responder(request)

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
        """The body of ``GET /v1/models`` in the configured context style (counted in
        :attr:`models_requests`)."""
        with self._lock:
            self.models_requests += 1
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


FORMS = """\
what it answers (without --script, or once the script has run out):
  fan out N: `COMMAND`     calls the agent tool N times (1-200); each child runs COMMAND
                           (default: pwd) and answers with its output, then the root sums
                           the children's answers up, one line each (cut at 300 characters,
                           marked "[... N characters cut]"). "fan out 3", "fan out to 5
                           children: `ls -la`" and "Fan-out 2 `wc -l /etc/hosts`" work.
  recurse N                a model stuck in a loop: every answer of the conversation calls
                           the agent tool N times (default 1), each child told "recurse N"
                           too, whatever comes back (refusals, failures); the swarm's limits
                           end it (--recurse N: every conversation, whatever its task)
  a `command` in backticks calls run_cli with it, then answers with its output, whole (as
                           swarm gave it: SWARM_OUTPUT_CAP's cut, if any, is marked)
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

--misbehave MODE (every answer) or a task holding "misbehave: MODE" (that conversation):
a model that misbehaves, to see that swarm holds (safety reviews never misbehave):
""" + "".join(f"  {name:<13} {text}\n" for name, text in MODES.items()) + """\
e.g. SWARM_BASE_URL=http://127.0.0.1:8099/v1 swarm run --yes 'misbehave: endless'
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
    parser.add_argument("--recurse", type=int, default=0, metavar="N",
                        help="recursion mode for every conversation: always call the agent "
                        f"tool N times (1-{MAX_RECURSE}); see 'recurse N' below")
    parser.add_argument("--misbehave", choices=list(MODES), metavar="MODE",
                        help="misbehave on every chat request (see below)")
    parser.add_argument("--trickle-every", type=float, default=2.0, metavar="SECONDS",
                        help="trickle mode: seconds between pieces (default: %(default)s)")
    parser.add_argument("--huge-size", type=int, default=50_000_000, metavar="BYTES",
                        help="huge mode: bytes of the answer (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 0 <= args.recurse <= MAX_RECURSE:
        parser.error(f"--recurse takes 1 to {MAX_RECURSE} agent calls an answer")
    server = ScriptedModelServer(
        models=args.model or ["scripted-model"], context_style=args.context_style,
        context_length=args.context_length, tool_call_ids=args.tool_call_ids,
        latency=args.latency, require_key=args.api_key, host=args.host, port=args.port,
        misbehave=args.misbehave,
    )
    server.recurse = args.recurse
    server.trickle_every, server.huge_size = args.trickle_every, args.huge_size
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
