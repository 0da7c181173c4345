"""What a failed model request means: httpx exceptions and HTTP answers mapped to the types
of :mod:`swarm.errors`, each with a message that says what to check, and whether another
try may pass (:class:`Retry`).

``where`` in every function is the endpoint as it may be shown (no user info); ``redact``
takes the API key out of any text that came from outside (an error body, an exception).
"""

from __future__ import annotations

import email.utils
import json
import math
from collections.abc import Callable
from datetime import UTC, datetime

import httpx

from swarm.errors import (
    ConfigError,
    ModelConnectionError,
    ModelError,
    ModelHTTPError,
    ModelRateLimitError,
    ModelResponseError,
)

RETRY_STATUSES = frozenset({408, 409, 429})
UNREADABLE = (ValueError, RecursionError)
"""What json.loads raises for a body that is not JSON (or nested too deep)."""


class Retry(Exception):
    """One try failed in a way another try may fix; ``error`` is raised after the last."""

    def __init__(self, error: ModelError, delay: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.delay = delay


def request_error(exc: httpx.HTTPError | httpx.InvalidURL, started: bool, *, where: str,
                  redact: Callable[[str], str]) -> ConfigError | Retry:
    """The typed error for an httpx exception (``started``: the answer had begun). A URL
    that cannot be used, or a request that cannot be written, is a ConfigError: no other
    try would pass."""
    detail = redact(str(exc) or type(exc).__name__)
    if isinstance(exc, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
        return ConfigError(redact(
            f"SWARM_BASE_URL={where!r} is not a usable URL ({detail}); set it to "
            "the server's OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080/v1"
        ))
    if isinstance(exc, httpx.LocalProtocolError):  # its text quotes the header: not shown
        return ConfigError(
            f"cannot send a request to {where}: httpx refused to write it "
            f"({type(exc).__name__}); check SWARM_BASE_URL and SWARM_API_KEY for characters "
            "a request line or header cannot hold")
    if isinstance(exc, httpx.TimeoutException):
        phase = "connecting to" if isinstance(exc, httpx.ConnectTimeout) else "waiting for"
        return Retry(ModelConnectionError(
            f"timed out {phase} the model server at {where} ({type(exc).__name__}); "
            "is it overloaded? SWARM_CONNECT_TIMEOUT and SWARM_READ_TIMEOUT set the limits"
        ))
    if isinstance(exc, httpx.TransportError):
        if started:
            return Retry(ModelResponseError(
                f"the connection to {where} broke in the middle of the answer: {detail}"))
        return Retry(ModelConnectionError(
            f"cannot connect to the model server at {where}: {detail}. Is the server "
            "running there? Check SWARM_BASE_URL."
        ))
    # DecodingError (a body that does not match its Content-Encoding), TooManyRedirects, ...
    return Retry(ModelResponseError(redact(
        f"cannot read the answer of the model server at {where}: "
        f"{type(exc).__name__}: {detail}"
    )))


def http_error(response: httpx.Response, body: str, *, where: str, model: str,
               has_key: bool, backoff_max: float) -> ModelError | Retry:
    """The typed error for a non-2xx answer whose (redacted) body is ``body``."""
    status = response.status_code
    text = summary(body)
    server = f"the model server at {where}"
    asked = retry_after(response.headers.get("retry-after"))
    delay = None if asked is None else min(asked, backoff_max)
    capped = "" if asked is None or asked <= backoff_max else (
        f". It asked to wait {asked:.0f} s (Retry-After); swarm waits at most {backoff_max:g} s "
        "between tries (SWARM_BACKOFF_MAX: raise it to wait as long as asked)")
    if status == 429:
        return Retry(ModelRateLimitError(
            f"{server} is rate limiting (HTTP 429): {text}. Wait and try again, or lower "
            f"SWARM_MAX_PARALLEL{capped}", status, body), delay)
    if status >= 500 or status in RETRY_STATUSES:
        return Retry(ModelHTTPError(
            f"{server} failed with HTTP {status}: {text}. Check the server's log{capped}",
            status, body), delay)
    if 300 <= status < 400:
        message = (f"{server} redirects to {response.headers.get('location', '?')!r} "
                   f"(HTTP {status}); set SWARM_BASE_URL to the final URL")
    elif status in (401, 403):
        hint = "Check SWARM_API_KEY" + ("" if has_key else "; it is not set")
        message = f"{server} refused the request (HTTP {status}): {text}. {hint}"
    elif status == 404:
        message = (f"{server} answered 404 Not Found for {response.request.url.path}: "
                   f"{text}. Check that SWARM_BASE_URL ends in /v1 (e.g. "
                   f"http://127.0.0.1:8080/v1) and that SWARM_MODEL={model!r} is served")
    elif status in (400, 413, 422) and "context" in body.lower():
        message = (f"the prompt is longer than the context window of {model!r}: "
                   f"{text}. Compact the history or start a new session")
    else:
        message = f"{server} rejected the request (HTTP {status}): {text}"
    return ModelHTTPError(message, status, body)


def summary(body: str) -> str:
    """The error message inside an OpenAI-style error body, else the body's start, without
    a final period (the messages built on it add their own)."""
    try:
        data = json.loads(body)
    except UNREADABLE:
        data = None
    if isinstance(data, dict):
        error = data.get("error", data)
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)[:500].rstrip().rstrip(".") or "(empty message)"
    text = " ".join(body.split())[:300].rstrip(".")
    return text or "(empty body)"


def retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (seconds or HTTP-date)."""
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
    return max(0.0, seconds)
