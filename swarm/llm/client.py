"""The OpenAI-compatible chat client: a call, its retries, streamed or whole answers.

Implements :class:`swarm.agent.protocols.Model`. Every error it raises is a
:class:`swarm.errors.ModelError` (or ConfigError) whose message says what to
check (:mod:`swarm.llm.errors`), and none of them, nor any log line, contains the API key
or the user info of the base URL. The HTTP client is :func:`swarm.llm.http.http_client`;
answers become messages in :mod:`swarm.llm.answer`; ``/models`` is read by
:mod:`swarm.llm.models`. A call in flight is aborted from another thread by setting the
client's :attr:`LLMClient.stop` event (:mod:`swarm.llm.abort`).

Whatever the server does, a call is bounded (:mod:`swarm.llm.bounds`): an answer over
``answer_max`` characters is cut and marked (so is one whose body or stream event is too
large to read), a try over ``call_timeout`` seconds fails, bytes that are not UTF-8 are
replaced, and token counts that cannot be true are replaced by swarm's own count; the
result's ``notices`` say so. (Over 400 lines because the retry loop and both answer paths,
streamed and whole, share one error handling; split, each half would need the other.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import httpx

from swarm.config import Secret
from swarm.domain.messages import ChatResult, Message, OnEvent
from swarm.domain.stop import StopEvent
from swarm.errors import (
    ConfigError,
    ModelCallAborted,
    ModelConnectionError,
    ModelError,
    ModelHTTPError,
    ModelResponseError,
)
from swarm.llm.abort import connections_of
from swarm.llm.answer import MessageAssembler, completion_assembler
from swarm.llm.bounds import (
    BYTES_PER_CHAR,
    ENVELOPE,
    Deadline,
    PastDeadline,
    close_cut_json,
    estimated_usage,
    implausible_usage,
)
from swarm.llm.errors import UNREADABLE, Retry, http_error, request_error
from swarm.llm.http import http_client
from swarm.llm.models import context_of, find_entry, listing, model_entries
from swarm.llm.sse import EventTooLarge, LineDecoder, iter_events
from swarm.text import without_userinfo

if TYPE_CHECKING:
    from swarm.config import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["LLMClient", "RateGate", "http_client"]

_STREAM_WORD = re.compile(r"\bstream(?!_options)")
"""`stream` (or streaming) in an error body, but not only as part of `stream_options`."""
_warned_userinfo: set[str] = set()
_warned_lock = threading.Lock()
NOT_UTF8 = ("the model server sent bytes that are not UTF-8; each such sequence was replaced "
            "by \ufffd")
MODELS_MAX = 16 << 20
"""Bytes of a ``/models`` listing read at most."""


class RateGate(Protocol):
    """Holds the model calls of many clients together (one per swarm, in Redis)."""

    def wait(self, stop: threading.Event | None = None) -> None:
        """Block while the gate is closed (or until ``stop`` is set)."""
        ...

    def pause(self, seconds: float) -> None:
        """Close the gate for everyone for ``seconds`` (a 429, an overloaded server)."""
        ...


class LLMClient:
    """A chat model behind an OpenAI-compatible endpoint (``POST {base_url}/chat/completions``).

    ``retries`` is the number of tries per call (at least one). ``transport``,
    ``sleep`` and ``backoff_base`` exist for tests. One ``httpx.Client`` is shared
    by every call, so an instance may be used from several threads.

    A ``user:password@`` in ``base_url`` is dropped: the client authenticates with
    ``api_key`` as a Bearer token only (httpx would send the user info as Basic auth,
    replacing the key), and no message or log line shows it (a warning says once per
    process that it is ignored).
    """

    def __init__(
        self,
        base_url: str,
        model: str = "",
        api_key: Secret | str = "",
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 300.0,
        retries: int = 5,
        backoff_max: float = 30.0,
        stream: bool = True,
        default_context_length: int = 128_000,
        answer_max: int = 1_000_000,
        call_timeout: float = 1800.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        backoff_base: float = 1.0,
        http: httpx.Client | None = None,
        context_length: int | None = None,
    ) -> None:
        self.base_url = without_userinfo(base_url).rstrip("/")
        if self.base_url != base_url.rstrip("/"):
            _warn_userinfo(self.base_url)
        self.model = model
        self._api_key = api_key if isinstance(api_key, Secret) else Secret(api_key)
        self.tries = max(1, retries)
        self.backoff_max = backoff_max
        self.backoff_base = backoff_base
        self.stream = stream
        self.default_context_length = default_context_length
        self.answer_max = answer_max
        """Characters of one answer kept (text, thinking, tool names and arguments)."""
        self.call_timeout = call_timeout
        """Seconds one try of a call may take, from the request to the answer's last byte."""
        self._sleep = sleep
        self.gate: RateGate | None = None
        """Shared with other clients (a swarm's children): one backs off, all hold."""
        self.stop: StopEvent | None = None
        """Once set, the call in flight is aborted (its socket shut down) and every call
        raises :class:`ModelCallAborted`: a child's cancel, deadline or lost lease."""
        self.on_retry: Callable[[str], None] | None = None
        """Told each retry (what failed, the wait, the try) instead of a warning in the log:
        a terminal shows it in one line."""
        self._stream_options = True
        self._stream_rejected = False
        self._context_length: int | None = context_length
        self._listed: list[dict[str, Any]] | None = None
        self._chat_url: httpx.URL | None = None
        self._owns_http = http is None
        self._http = http if http is not None else http_client(
            self.base_url, connect_timeout, read_timeout, transport=transport)
        self._connections = connections_of(self._http)

    @classmethod
    def from_settings(
        cls, settings: Settings, transport: httpx.BaseTransport | None = None, *,
        http: httpx.Client | None = None, context_length: int | None = None,
    ) -> LLMClient:
        """A client configured by :class:`swarm.config.Settings`; ``http`` (from
        :func:`http_client`) and a known ``context_length`` let many short-lived clients
        share one connection pool and one ``/models`` lookup."""
        return cls(
            settings.base_url,
            settings.model,
            settings.api_key,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            retries=settings.retries,
            backoff_max=settings.backoff_max,
            stream=settings.stream,
            default_context_length=settings.context_length,
            answer_max=settings.answer_max,
            call_timeout=settings.call_timeout,
            transport=transport,
            http=http,
            context_length=context_length,
        )

    def __repr__(self) -> str:
        return (f"LLMClient(base_url={self.base_url!r}, model={self.model!r}, "
                f"api_key={self._api_key!r})")

    def close(self) -> None:
        """Close the connection pool (unless it was lent to this client)."""
        if self._owns_http:
            self._http.close()

    @property
    def known_context_length(self) -> int | None:
        """The context length once looked up (or given), else None; never a request."""
        return self._context_length

    def __enter__(self) -> LLMClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- chat -------------------------------------------------------------------------------

    def chat(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
        *,
        on_event: OnEvent | None = None,
        temperature: float | None = None,
        stream: bool | None = None,
    ) -> ChatResult:
        """One completion; retries what may pass on another try, then raises a ModelError.

        After a broken stream the whole call is retried, so ``on_event`` may see the
        start of an answer twice; the returned message is always whole.
        """
        if not self.model:
            self.resolve_model()
        use_stream = (self.stream if stream is None else stream) and not self._stream_rejected
        return self._with_retries(
            "model call",
            lambda: self._chat_once(messages, tools, on_event, temperature, use_stream),
        )

    def _chat_once(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        on_event: OnEvent | None,
        temperature: float | None,
        use_stream: bool,
    ) -> ChatResult:
        payload: dict[str, Any] = {"model": self.model, "messages": messages, "stream": use_stream}
        if tools:
            payload["tools"] = tools
        if temperature is not None:
            payload["temperature"] = temperature
        if use_stream and self._stream_options:
            payload["stream_options"] = {"include_usage": True}
        headers = self._headers("text/event-stream" if use_stream else "application/json")
        started = False
        abortable: AbstractContextManager[None] = nullcontext() if self.stop is None \
            else self.stop.on_set(self._connections.abort)
        deadline = Deadline(self.call_timeout, self._connections.abort)
        try:
            with abortable, deadline:
                response, sent = self._post(payload, headers)
                try:
                    started = True
                    if 200 <= response.status_code < 300:
                        return self._read_answer(response, on_event, deadline, sent)
                    body = self._error_body(response, deadline)
                finally:
                    response.close()
        except (httpx.HTTPError, httpx.InvalidURL, Retry, PastDeadline) as exc:
            if self._stopped():
                raise self._aborted() from None
            if deadline.expired:
                raise self._too_long(deadline) from None
            if isinstance(exc, (Retry, PastDeadline)):
                raise
            raise self._request_error(exc, started) from exc
        if response.status_code == 400 and use_stream:
            if "stream_options" in payload and "stream_options" in body:
                log.info("%s does not accept stream_options; sending without it", self.base_url)
                self._stream_options = False
                return self._chat_once(messages, tools, on_event, temperature, use_stream)
            if _STREAM_WORD.search(body.lower()):
                log.info("%s does not accept stream: true; asking for whole answers",
                         self.base_url)
                self._stream_rejected = True
                return self._chat_once(messages, tools, on_event, temperature, False)
        raise self._http_error(response, body)

    def _post(self, payload: dict[str, Any], headers: dict[str, str]
              ) -> tuple[httpx.Response, int]:
        """``POST /chat/completions``; the answer is read as it arrives (close it), and the
        bytes of the request."""
        if self._chat_url is None:  # parsed once (InvalidURL is raised here)
            self._chat_url = httpx.URL(f"{self.base_url}/chat/completions")
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        request = self._http.build_request(
            "POST", self._chat_url, content=body,
            headers={"Content-Type": "application/json", **headers},
            extensions={"trace": self._connections.trace})
        return self._http.send(request, stream=True), len(body)

    @property
    def max_event(self) -> int:
        """Characters of one stream event, or bytes of a whole answer, read at most."""
        return BYTES_PER_CHAR * self.answer_max + ENVELOPE

    def _read_answer(self, response: httpx.Response, on_event: OnEvent | None,
                     deadline: Deadline, sent: int) -> ChatResult:
        """The answer to a request of ``sent`` bytes."""
        # Decide by what came, not by what was asked: some servers ignore `stream`.
        if "text/event-stream" in response.headers.get("content-type", ""):
            return self._read_stream(deadline.chunks(response.iter_bytes()), on_event, sent)
        body, cut = self._read_body(response, deadline, self.max_event)
        if body.lstrip().startswith((b"data:", b":")):
            return self._read_stream([body], on_event, sent, cut=cut)
        text, replaced = _decode(body)
        data = close_cut_json(text) if cut else _loads(text)
        if data is None:
            raise Retry(ModelResponseError(
                f"the model server at {self.base_url} answered with something that is not JSON: "
                f"{self._redact(text[:200])!r}"
            ))
        try:
            assembler = completion_assembler(data, on_event, limit=self.answer_max, cut=cut)
        except ModelResponseError as exc:
            raise Retry(ModelResponseError(self._redact(str(exc)))) from None
        return self._result(assembler, replaced, sent)

    def _read_stream(self, chunks: Iterable[bytes], on_event: OnEvent | None, sent: int, *,
                     cut: bool = False) -> ChatResult:
        """The answer in an event stream; ``cut``: the stream is the start of a body that
        was cut (its last event may be too)."""
        assembler = MessageAssembler(on_event, self.answer_max)
        lines = LineDecoder()
        done = False
        try:
            for event in iter_events(chunks, flush_incomplete=True, max_event=self.max_event,
                                     lines=lines):
                data = event.data.strip()
                if data == "[DONE]":
                    done = True
                if done or not data or event.event == "ping":
                    # After [DONE], read on to the end of the body: a connection whose answer
                    # was read whole goes back to the pool, a half-read one is closed.
                    continue
                try:
                    chunk = json.loads(data)
                except UNREADABLE:
                    if cut:  # the last event, cut with the body
                        _salvage(assembler, data)
                        break
                    raise Retry(ModelResponseError(
                        f"the model server sent a stream chunk that is not JSON: "
                        f"{self._redact(data[:200])!r}"
                    )) from None
                if event.event == "error" and isinstance(chunk, dict) and "error" not in chunk:
                    chunk = {"error": chunk}
                try:
                    assembler.feed(chunk)
                except ModelResponseError as exc:
                    raise Retry(ModelResponseError(self._redact(str(exc)))) from None
                if assembler.cut:
                    break
        except EventTooLarge as big:
            _salvage(assembler, big.data)
        if cut:
            assembler.cut_here()
        if not done and assembler.finish_reason is None and not assembler.cut:
            raise Retry(ModelResponseError(
                f"the stream from {self.base_url} ended before the answer was complete "
                "(no finish_reason, no [DONE]); the server may have crashed or a proxy cut it"
            ))
        result = self._result(assembler, lines.replaced, sent)
        if result.finish_reason is None and not result.content and not result.tool_calls \
                and not any(result.message.get(k) for k in ("reasoning_content", "reasoning")):
            raise Retry(ModelResponseError(
                f"the stream from {self.base_url} held no answer at all (no choice, no text, "
                "no tool call); the server may be overloaded or misconfigured"))
        return result

    def _result(self, assembler: MessageAssembler, replaced: bool, sent: int) -> ChatResult:
        """The answer of ``assembler`` to a request of ``sent`` bytes: marked when it was cut,
        with swarm's own token count where the server's cannot be true, and the notices
        (``replaced``: bytes of it were not UTF-8)."""
        cut = note = ""
        if assembler.cut:
            cut = (f"cut at {assembler.size:,} characters (SWARM_ANSWER_MAX="
                   f"{self.answer_max})")
            dropped = assembler.dropped_call
            note = (f"[swarm: this answer was {cut}; the rest of it was dropped"
                    + (f", with its unfinished call of {dropped}" if dropped else "") + "]")
        result = assembler.result(cut, note)
        if replaced:
            result.notices["utf8"] = NOT_UTF8
        why = implausible_usage(assembler.raw_usage, sent, assembler.size, self._context_length)
        if why:
            log.info("ignoring the token counts of %s: %s", self.base_url, why)
            result.notices["usage"] = (
                f"the model server reports token counts that cannot be true ({why}); swarm "
                "counts tokens itself for the context, budgets and costs")
        if why or (result.cut and not result.usage.total_tokens):
            result.usage = estimated_usage(sent, assembler.size)
        return result

    def _read_body(self, response: httpx.Response, deadline: Deadline | None,
                   limit: int) -> tuple[bytes, bool]:
        """The body, or its first ``limit`` bytes and True when it is longer."""
        parts: list[bytes] = []
        size = 0
        chunks = response.iter_bytes()
        for chunk in deadline.chunks(chunks) if deadline is not None else chunks:
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                return b"".join(parts)[:limit], True
        return b"".join(parts), False

    def _too_long(self, deadline: Deadline) -> ModelConnectionError:
        return ModelConnectionError(
            f"the model at {self.base_url} had not finished its answer after "
            f"{deadline.seconds:g} s (SWARM_CALL_TIMEOUT), {deadline.received:,} bytes in: a "
            "stream that never ends or a model this slow is stopped there; raise "
            "SWARM_CALL_TIMEOUT if the model is only slow")

    # -- models -----------------------------------------------------------------------------

    def list_models(self) -> list[dict[str, Any]]:
        """The entries of ``GET {base_url}/models`` (each has at least an ``id``)."""
        models = self._with_retries("listing models", self._models_once)
        self._listed = models
        return models

    def _models_once(self) -> list[dict[str, Any]]:
        deadline = Deadline(self.call_timeout, self._connections.abort)
        try:
            with deadline, self._http.stream(
                    "GET", f"{self.base_url}/models", headers=self._headers("application/json"),
                    extensions={"trace": self._connections.trace}) as response:
                if not 200 <= response.status_code < 300:
                    raise self._http_error(response, self._error_body(response, deadline))
                body, cut = self._read_body(response, deadline, MODELS_MAX)
        except PastDeadline:
            raise self._too_long(deadline) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            if deadline.expired:
                raise self._too_long(deadline) from None
            raise self._request_error(exc, False) from exc
        text = _decode(body)[0]
        data = None if cut else _loads(text)
        if data is None:
            raise Retry(ModelResponseError(
                f"GET {self.base_url}/models answered with something that is not JSON"
                + (f" of {MODELS_MAX:,} bytes or less" if cut else "")
                + f": {self._redact(text[:200])!r}"))
        return model_entries(data, where=self.base_url)

    def resolve_model(self) -> str:
        """The model id: the configured one, else the only one ``/models`` lists."""
        if self.model:
            return self.model
        ids = [str(entry["id"]) for entry in self.list_models()]
        if len(ids) == 1:
            self.model = ids[0]
            log.info("SWARM_MODEL is not set; using %s, the only model %s lists",
                     self.model, self.base_url)
            return self.model
        if not ids:
            raise ConfigError(f"SWARM_MODEL is not set and {self.base_url}/models lists no "
                              "models; set SWARM_MODEL to the model id to use")
        raise ConfigError(f"SWARM_MODEL is not set and {self.base_url}/models lists "
                          f"{len(ids)} models; set SWARM_MODEL to one of: {listing(ids)}")

    def context_length(self) -> int:
        """The model's context window from ``/models``, else ``default_context_length``.

        Raises ModelNotFoundError when ``/models`` lists models but not this one.
        """
        if self._context_length is not None:
            return self._context_length
        if not self.model:
            self.resolve_model()
        # A server that cannot be reached fails here: guessing its context would only put the
        # same error off to the first call, after as many tries again.
        try:
            models = self._listed if self._listed is not None else self.list_models()
        except (ModelHTTPError, ModelResponseError) as exc:
            log.warning("cannot read the context length from %s/models (%s); assuming %d "
                        "tokens (SWARM_CONTEXT_LENGTH sets this)",
                        self.base_url, exc, self.default_context_length)
            self._context_length = self.default_context_length
            return self._context_length
        entry = find_entry(models, self.model, where=self.base_url)
        length = context_of(entry) if entry is not None else None
        if length is None:
            log.info("%s/models does not tell the context length of %s; assuming %d tokens",
                     self.base_url, self.model, self.default_context_length)
        self._context_length = length or self.default_context_length
        return self._context_length

    # -- retries and errors -----------------------------------------------------------------

    def _with_retries(self, what: str, attempt: Callable[[], T]) -> T:
        for number in range(1, self.tries + 1):
            if self.gate is not None:
                self.gate.wait(self.stop)
            if self._stopped():
                raise self._aborted()
            try:
                return attempt()
            except Retry as retry:
                if self._stopped():  # what broke was the abort (a cut stream, say)
                    raise self._aborted() from None
                if number == self.tries:
                    error = retry.error
                    if self.tries > 1:
                        error.args = (f"{error.args[0]} (gave up after {self.tries} tries)",
                                      *error.args[1:])
                    raise error from retry.__cause__
                delay = retry.delay if retry.delay is not None else self._backoff(number)
                text = (f"{what}: try {number} of {self.tries} failed, the next in "
                        f"{delay:.1f} s: {retry.error}")
                if self.on_retry is None:
                    log.warning("%s", text)
                else:
                    log.info("%s", text)
                    self.on_retry(text)
                if self.gate is not None:
                    self.gate.pause(delay)
                if self.stop is None:
                    self._sleep(delay)
                elif self.stop.wait(delay):
                    raise self._aborted() from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def _aborted(self) -> ModelCallAborted:
        return ModelCallAborted(f"the call to the model at {self.base_url} was cut short: "
                                "this agent was told to stop (cancel, a time limit or a lost "
                                "lease)")

    def _backoff(self, number: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2^(n-1))]."""
        return random.uniform(0.0, min(self.backoff_max, self.backoff_base * 2 ** (number - 1)))

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {"Accept": accept}
        if self._api_key:
            key = self._api_key.reveal()
            if not key.isascii() or not key.isprintable():
                raise ConfigError("SWARM_API_KEY holds a line break, a control character or "
                                  "a character outside ASCII, which an HTTP header cannot "
                                  "carry; set it to the key alone")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _redact(self, text: str) -> str:
        key = self._api_key.reveal()
        return text.replace(key, "***") if key else text

    def _error_body(self, response: httpx.Response, deadline: Deadline | None = None) -> str:
        try:
            body = self._read_body(response, deadline, 4000)[0]
        except httpx.HTTPError:
            return ""
        return self._redact(body.decode("utf-8", "replace"))

    def _request_error(self, exc: httpx.HTTPError | httpx.InvalidURL,
                       started: bool) -> ConfigError | Retry:
        return request_error(exc, started, where=self.base_url, redact=self._redact)

    def _http_error(self, response: httpx.Response, body: str) -> ModelError | Retry:
        return http_error(response, body, where=self.base_url, model=self.model,
                          has_key=bool(self._api_key), backoff_max=self.backoff_max)


def _salvage(assembler: MessageAssembler, data: str) -> None:
    """Feed what can be read of a cut stream event, and end the answer there."""
    chunk = close_cut_json(data)
    if isinstance(chunk, dict):
        with contextlib.suppress(ModelResponseError):
            assembler.feed(chunk)
    assembler.cut_here()


def _decode(body: bytes) -> tuple[str, bool]:
    """The text of a JSON body (UTF-8, or the UTF-16/32 JSON allows), and whether bytes of
    it were not in that encoding (replaced, as in a stream)."""
    encoding = json.detect_encoding(body)
    try:
        return body.decode(encoding), False
    except UnicodeDecodeError:
        return body.decode(encoding, "replace"), True


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except UNREADABLE:
        return None


def _warn_userinfo(base_url: str) -> None:
    with _warned_lock:
        if base_url in _warned_userinfo:
            return
        _warned_userinfo.add(base_url)
    log.warning("SWARM_BASE_URL has a user name or password (user:password@) for %s; it is "
                "ignored: requests carry SWARM_API_KEY as a Bearer token", base_url)
