"""The OpenAI-compatible chat client: httpx, SSE streaming, retries, typed errors.

Implements :class:`swarm.agent.protocols.Model`. Every error it raises is a
:class:`swarm.errors.ModelError` (or ConfigError) whose message says what to
check, and none of them, nor any log line, contains the API key.
"""

from __future__ import annotations

import email.utils
import functools
import json
import logging
import math
import random
import re
import ssl
import time
import urllib.request
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from swarm.config import Secret
from swarm.domain.messages import ChatResult, Message, OnEvent
from swarm.errors import (
    ConfigError,
    ModelConnectionError,
    ModelError,
    ModelHTTPError,
    ModelNotFoundError,
    ModelRateLimitError,
    ModelResponseError,
)
from swarm.llm.assemble import MessageAssembler, from_completion
from swarm.llm.sse import iter_events
from swarm.llm.transport import PlainHTTPTransport

if TYPE_CHECKING:
    from swarm.config import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

_RETRY_STATUSES = frozenset({408, 409, 429})
_STREAM_WORD = re.compile(r"\bstream(?!_options)")
"""`stream` (or streaming) in an error body, but not only as part of `stream_options`."""
_UNREADABLE = (ValueError, RecursionError)
"""What json.loads raises for a body that is not JSON (or nested too deep)."""


class _Retry(Exception):
    """One try failed in a way another try may fix; ``error`` is raised after the last."""

    def __init__(self, error: ModelError, delay: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.delay = delay


class RateGate(Protocol):
    """Holds the model calls of many clients together (one per swarm, in Redis)."""

    def wait(self) -> None:
        """Block while the gate is closed."""
        ...

    def pause(self, seconds: float) -> None:
        """Close the gate for everyone for ``seconds`` (a 429, an overloaded server)."""
        ...


class LLMClient:
    """A chat model behind an OpenAI-compatible endpoint (``POST {base_url}/chat/completions``).

    ``retries`` is the number of tries per call (at least one). ``transport``,
    ``sleep`` and ``backoff_base`` exist for tests. One ``httpx.Client`` is shared
    by every call, so an instance may be used from several threads.
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
        self.base_url = base_url.rstrip("/")
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
        self._stream_options = True
        self._stream_rejected = False
        self._context_length: int | None = context_length
        self._listed: list[dict[str, Any]] | None = None
        self._chat: tuple[httpx.URL, httpx.BaseTransport | None, list[tuple[str, str]],
                          dict[str, Any]] | None = None
        self._owns_http = http is None
        self._http = http if http is not None else http_client(
            self.base_url, connect_timeout, read_timeout, transport=transport)

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
        try:
            response = self._post(payload, headers)
            try:
                started = True
                if 200 <= response.status_code < 300:
                    return self._read_answer(response, on_event)
                body = self._error_body(response)
            finally:
                response.close()
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
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
        """``POST /chat/completions`` with a streamed body, straight to the transport.

        ``httpx.Client.stream`` merges URLs, headers and cookies and reads ``Set-Cookie``
        on every call: a third of the CPU of a request to a local server, and a worker
        makes thousands. The URL, the transport (a proxy from the environment, or the
        pool) and the client's default headers are worked out once; no OpenAI-compatible
        API needs cookies or redirects (a redirect is an error that names the new URL).
        """
        if self._chat is None:
            url = httpx.URL(f"{self.base_url}/chat/completions")
            pick = getattr(self._http, "_transport_for_url", None)
            transport = pick(url) if pick is not None else None
            self._chat = (url, transport, list(self._http.headers.multi_items()),
                          {"timeout": self._http.timeout.as_dict()})
        url, transport, defaults, extensions = self._chat
        given = {k.lower() for k in headers}
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        request = httpx.Request(
            "POST", url, content=body, extensions=extensions,
            headers=[*(h for h in defaults if h[0].lower() not in given),
                     ("Content-Type", "application/json"), *headers.items()])
        if transport is None:  # an httpx without the lookup: the public way
            return self._http.send(request, stream=True)
        response = transport.handle_request(request)
        response.request = request
        return response

    def _read_answer(self, response: httpx.Response, on_event: OnEvent | None) -> ChatResult:
        # Decide by what came, not by what was asked: some servers ignore `stream`.
        if "text/event-stream" in response.headers.get("content-type", ""):
            return self._read_stream(response.iter_bytes(), on_event)
        body = response.read()
        if body.lstrip().startswith((b"data:", b":")):
            return self._read_stream([body], on_event)
        try:
            data = json.loads(body)
        except _UNREADABLE:
            raise _Retry(ModelResponseError(
                f"the model server at {self.base_url} answered with something that is not JSON: "
                f"{self._redact(body[:200].decode('utf-8', 'replace'))!r}"
            )) from None
        try:
            return from_completion(data, on_event)
        except ModelResponseError as exc:
            raise _Retry(ModelResponseError(self._redact(str(exc)))) from None

    def _read_stream(self, chunks: Iterable[bytes], on_event: OnEvent | None) -> ChatResult:
        assembler = MessageAssembler(on_event)
        done = False
        for event in iter_events(chunks, flush_incomplete=True):
            data = event.data.strip()
            if data == "[DONE]":
                done = True
                break
            if not data or event.event == "ping":
                continue
            try:
                chunk = json.loads(data)
            except _UNREADABLE:
                raise _Retry(ModelResponseError(
                    f"the model server sent a stream chunk that is not JSON: "
                    f"{self._redact(data[:200])!r}"
                )) from None
            if event.event == "error" and isinstance(chunk, dict) and "error" not in chunk:
                chunk = {"error": chunk}
            try:
                assembler.feed(chunk)
            except ModelResponseError as exc:
                raise _Retry(ModelResponseError(self._redact(str(exc)))) from None
        if not done and assembler.finish_reason is None:
            raise _Retry(ModelResponseError(
                f"the stream from {self.base_url} ended before the answer was complete "
                "(no finish_reason, no [DONE]); the server may have crashed or a proxy cut it"
            ))
        result = assembler.result()
        if result.finish_reason is None and not result.content and not result.tool_calls \
                and not any(result.message.get(k) for k in ("reasoning_content", "reasoning")):
            raise _Retry(ModelResponseError(
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
        except _UNREADABLE:
            raise _Retry(ModelResponseError(
                f"GET {self.base_url}/models answered with something that is not JSON: "
                f"{self._redact(response.text[:200])!r}"
            )) from None
        entries = data.get("data") if isinstance(data, dict) else data
        if not isinstance(entries, list):
            raise ModelResponseError(
                f"GET {self.base_url}/models has no 'data' list; is SWARM_BASE_URL an "
                "OpenAI-compatible endpoint ending in /v1?"
            )
        return [e for e in entries if isinstance(e, dict) and e.get("id")]

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
                          f"{len(ids)} models; set SWARM_MODEL to one of: {_listing(ids)}")

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
        entry = self._entry(models)
        length = _context_of(entry) if entry is not None else None
        if length is None:
            log.info("%s/models does not tell the context length of %s; assuming %d tokens",
                     self.base_url, self.model, self.default_context_length)
        self._context_length = length or self.default_context_length
        return self._context_length

    def _entry(self, models: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not models:
            return None
        wanted = (self.model,) if ":" in self.model else (self.model, f"{self.model}:latest")
        for entry in models:
            if entry.get("id") in wanted:
                return entry
        ids = [str(entry["id"]) for entry in models]
        raise ModelNotFoundError(
            f"the model server at {self.base_url} does not list SWARM_MODEL={self.model!r}; "
            f"it lists: {_listing(ids)}. Set SWARM_MODEL to one of them."
        )

    # -- retries and errors -----------------------------------------------------------------

    def _with_retries(self, what: str, attempt: Callable[[], T]) -> T:
        for number in range(1, self.tries + 1):
            if self.gate is not None:
                self.gate.wait()
            try:
                return attempt()
            except _Retry as retry:
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
                self._sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, number: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2^(n-1))]."""
        return random.uniform(0.0, min(self.backoff_max, self.backoff_base * 2 ** (number - 1)))

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {"Accept": accept}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
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

    def _request_error(
        self, exc: httpx.HTTPError | httpx.InvalidURL, started: bool
    ) -> ConfigError | _Retry:
        """The typed error for an httpx exception: a bad URL is a ConfigError (not retried)."""
        detail = self._redact(str(exc) or type(exc).__name__)
        if isinstance(exc, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
            return ConfigError(self._redact(
                f"SWARM_BASE_URL={self.base_url!r} is not a usable URL ({detail}); set it to "
                "the server's OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080/v1"
            ))
        if isinstance(exc, httpx.TransportError):
            return self._transport_error(exc, started)
        # DecodingError (a body that does not match its Content-Encoding), TooManyRedirects, ...
        return _Retry(ModelResponseError(self._redact(
            f"cannot read the answer of the model server at {self.base_url}: "
            f"{type(exc).__name__}: {detail}"
        )))

    def _transport_error(self, exc: httpx.TransportError, started: bool) -> _Retry:
        detail = self._redact(str(exc) or type(exc).__name__)
        if isinstance(exc, httpx.TimeoutException):
            phase = "connecting to" if isinstance(exc, httpx.ConnectTimeout) else "waiting for"
            return _Retry(ModelConnectionError(
                f"timed out {phase} the model server at {self.base_url} ({type(exc).__name__}); "
                "is it overloaded? SWARM_CONNECT_TIMEOUT and SWARM_READ_TIMEOUT set the limits"
            ))
        if started:
            return _Retry(ModelResponseError(
                f"the connection to {self.base_url} broke in the middle of the answer: {detail}"
            ))
        return _Retry(ModelConnectionError(
            f"cannot connect to the model server at {self.base_url}: {detail}. Is the server "
            "running there? Check SWARM_BASE_URL."
        ))

    def _http_error(self, response: httpx.Response, body: str) -> ModelError | _Retry:
        status = response.status_code
        summary = _summary(body)
        where = f"the model server at {self.base_url}"
        delay = _retry_after(response.headers.get("retry-after"), self.backoff_max)
        if status == 429:
            return _Retry(ModelRateLimitError(
                f"{where} is rate limiting (HTTP 429): {summary}. Wait and try again, or lower "
                "SWARM_MAX_PARALLEL", status, body), delay)
        if status >= 500 or status in _RETRY_STATUSES:
            return _Retry(ModelHTTPError(
                f"{where} failed with HTTP {status}: {summary}. Check the server's log",
                status, body), delay)
        if 300 <= status < 400:
            message = (f"{where} redirects to {response.headers.get('location', '?')!r} "
                       f"(HTTP {status}); set SWARM_BASE_URL to the final URL")
        elif status in (401, 403):
            hint = "Check SWARM_API_KEY" + ("; it is not set" if not self._api_key else "")
            message = f"{where} refused the request (HTTP {status}): {summary}. {hint}"
        elif status == 404:
            message = (f"{where} answered 404 Not Found for {response.request.url.path}: "
                       f"{summary}. Check that SWARM_BASE_URL ends in /v1 (e.g. "
                       f"http://127.0.0.1:8080/v1) and that SWARM_MODEL={self.model!r} is served")
        elif status in (400, 413, 422) and "context" in body.lower():
            message = (f"the prompt is longer than the context window of {self.model!r}: "
                       f"{summary}. Compact the history or start a new session")
        else:
            message = f"{where} rejected the request (HTTP {status}): {summary}"
        return ModelHTTPError(message, status, body)


def http_client(base_url: str, connect_timeout: float, read_timeout: float, *,
                transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """The ``httpx.Client`` an :class:`LLMClient` for ``base_url`` uses: over
    :class:`~swarm.llm.transport.PlainHTTPTransport` for ``http://`` (unless ``transport``
    is given, or a proxy from the environment applies), with the CA bundle loaded only for
    ``https://``."""
    if transport is None and base_url.startswith("http://") and not _env_proxy(base_url):
        transport = PlainHTTPTransport()
    return httpx.Client(
        timeout=httpx.Timeout(
            connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout
        ),
        transport=transport,
        verify=_ssl_context() if base_url.startswith("https:") else _plain_context(),
        headers={"User-Agent": "swarm"},
        limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
    )


def _env_proxy(base_url: str) -> bool:
    """Whether HTTP_PROXY / ALL_PROXY (and NO_PROXY) send ``base_url`` through a proxy:
    httpx applies them only with its own transport."""
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get("http") or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(urlsplit(base_url).hostname or "")


@functools.cache
def _plain_context() -> ssl.SSLContext:
    # For an http:// endpoint: no CA bundle to load (it costs ~150 ms at startup); TLS is
    # never used, and if it were, verification would fail closed.
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes ~30 ms and some memory; a worker runs many clients.
    return httpx.create_ssl_context()


def _summary(body: str) -> str:
    """The error message inside an OpenAI-style error body, else the body's start, without
    a final period (the messages built on it add their own)."""
    try:
        data = json.loads(body)
    except _UNREADABLE:
        data = None
    if isinstance(data, dict):
        error = data.get("error", data)
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)[:500].rstrip().rstrip(".") or "(empty message)"
    text = " ".join(body.split())[:300].rstrip(".")
    return text or "(empty body)"


def _retry_after(value: str | None, cap: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (seconds or HTTP-date), capped."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if math.isnan(seconds):
        return None
    return min(cap, max(0.0, seconds))


def _context_of(entry: dict[str, Any]) -> int | None:
    """The context window an entry of ``/models`` states, in the known dialects."""
    candidates: list[Any] = [entry.get(key) for key in (
        "max_model_len",  # vLLM
        "context_length",  # OpenRouter, LiteLLM, SGLang
        "max_context_length",  # LM Studio
        "context_window",  # Groq
    )]
    meta = entry.get("meta")
    if isinstance(meta, dict):  # llama.cpp
        candidates += [meta.get("n_ctx"), meta.get("n_ctx_train")]
    provider = entry.get("top_provider")
    if isinstance(provider, dict):
        candidates.append(provider.get("context_length"))
    for value in candidates:
        if isinstance(value, bool):
            continue
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: 1e999 is inf
            continue
        if number > 0:
            return number
    return None


def _listing(ids: list[str], limit: int = 20) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f" (and {len(ids) - limit} more)" if len(ids) > limit else "")
