"""The OpenAI-compatible chat client: a call, its retries, streamed or whole answers.

Implements :class:`swarm.agent.protocols.Model`. Every error it raises is a
:class:`swarm.errors.ModelError` (or ConfigError) whose message says what to
check (:mod:`swarm.llm.errors`), and none of them, nor any log line, contains the API key
or the user info of the base URL. The HTTP client is :func:`swarm.llm.http.http_client`;
answers become messages in :mod:`swarm.llm.answer`; ``/models`` is read by
:mod:`swarm.llm.models`. A call in flight is aborted from another thread by setting the
client's :attr:`LLMClient.stop` event (:mod:`swarm.llm.abort`). (Over 400 lines because
the retry loop and both answer paths, streamed and whole, share one error handling; split,
each half would need the other.)
"""

from __future__ import annotations

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
from swarm.llm.answer import MessageAssembler, from_completion
from swarm.llm.errors import UNREADABLE, Retry, http_error, request_error
from swarm.llm.http import http_client
from swarm.llm.models import context_of, find_entry, listing, model_entries
from swarm.llm.sse import iter_events
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
        self._sleep = sleep
        self.gate: RateGate | None = None
        """Shared with other clients (a swarm's children): one backs off, all hold."""
        self.stop: StopEvent | None = None
        """Once set, the call in flight is aborted (its socket shut down) and every call
        raises :class:`ModelCallAborted`: a child's cancel, deadline or lost lease."""
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
        try:
            with abortable:
                response = self._post(payload, headers)
                try:
                    started = True
                    if 200 <= response.status_code < 300:
                        return self._read_answer(response, on_event)
                    body = self._error_body(response)
                finally:
                    response.close()
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            if self._stopped():
                raise self._aborted() from None
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

    def _post(self, payload: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        """``POST /chat/completions``; the answer is read as it arrives (close it)."""
        if self._chat_url is None:  # parsed once (InvalidURL is raised here)
            self._chat_url = httpx.URL(f"{self.base_url}/chat/completions")
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        request = self._http.build_request(
            "POST", self._chat_url, content=body,
            headers={"Content-Type": "application/json", **headers},
            extensions={"trace": self._connections.trace})
        return self._http.send(request, stream=True)

    def _read_answer(self, response: httpx.Response, on_event: OnEvent | None) -> ChatResult:
        # Decide by what came, not by what was asked: some servers ignore `stream`.
        if "text/event-stream" in response.headers.get("content-type", ""):
            return self._read_stream(response.iter_bytes(), on_event)
        body = response.read()
        if body.lstrip().startswith((b"data:", b":")):
            return self._read_stream([body], on_event)
        try:
            data = json.loads(body)
        except UNREADABLE:
            raise Retry(ModelResponseError(
                f"the model server at {self.base_url} answered with something that is not JSON: "
                f"{self._redact(body[:200].decode('utf-8', 'replace'))!r}"
            )) from None
        try:
            return from_completion(data, on_event)
        except ModelResponseError as exc:
            raise Retry(ModelResponseError(self._redact(str(exc)))) from None

    def _read_stream(self, chunks: Iterable[bytes], on_event: OnEvent | None) -> ChatResult:
        assembler = MessageAssembler(on_event)
        done = False
        for event in iter_events(chunks, flush_incomplete=True):
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
        if not done and assembler.finish_reason is None:
            raise Retry(ModelResponseError(
                f"the stream from {self.base_url} ended before the answer was complete "
                "(no finish_reason, no [DONE]); the server may have crashed or a proxy cut it"
            ))
        result = assembler.result()
        if result.finish_reason is None and not result.content and not result.tool_calls \
                and not any(result.message.get(k) for k in ("reasoning_content", "reasoning")):
            raise Retry(ModelResponseError(
                f"the stream from {self.base_url} held no answer at all (no choice, no text, "
                "no tool call); the server may be overloaded or misconfigured"))
        return result

    # -- models -----------------------------------------------------------------------------

    def list_models(self) -> list[dict[str, Any]]:
        """The entries of ``GET {base_url}/models`` (each has at least an ``id``)."""
        models = self._with_retries("listing models", self._models_once)
        self._listed = models
        return models

    def _models_once(self) -> list[dict[str, Any]]:
        try:
            response = self._http.get(f"{self.base_url}/models",
                                      headers=self._headers("application/json"))
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._request_error(exc, False) from exc
        if not 200 <= response.status_code < 300:
            raise self._http_error(response, self._error_body(response))
        try:
            data = response.json()
        except UNREADABLE:
            raise Retry(ModelResponseError(
                f"GET {self.base_url}/models answered with something that is not JSON: "
                f"{self._redact(response.text[:200])!r}"
            )) from None
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
        try:
            models = self._listed if self._listed is not None else self.list_models()
        except (ModelConnectionError, ModelHTTPError, ModelResponseError) as exc:
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
                log.warning("%s failed: %s; retrying in %.1f s (try %d of %d)",
                            what, retry.error, delay, number + 1, self.tries)
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

    def _error_body(self, response: httpx.Response) -> str:
        try:
            response.read()
            return self._redact(response.text[:4000])
        except httpx.HTTPError:
            return ""

    def _request_error(self, exc: httpx.HTTPError | httpx.InvalidURL,
                       started: bool) -> ConfigError | Retry:
        return request_error(exc, started, where=self.base_url, redact=self._redact)

    def _http_error(self, response: httpx.Response, body: str) -> ModelError | Retry:
        return http_error(response, body, where=self.base_url, model=self.model,
                          has_key=bool(self._api_key), backoff_max=self.backoff_max)


def _warn_userinfo(base_url: str) -> None:
    with _warned_lock:
        if base_url in _warned_userinfo:
            return
        _warned_userinfo.add(base_url)
    log.warning("SWARM_BASE_URL has a user name or password (user:password@) for %s; it is "
                "ignored: requests carry SWARM_API_KEY as a Bearer token", base_url)
