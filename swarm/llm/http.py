"""The ``httpx.Client`` a model client talks through: httpx's own transport (HTTP/1.1,
keep-alive, proxies from HTTP_PROXY/HTTPS_PROXY/ALL_PROXY/NO_PROXY), timeouts, and a TLS
context built once per process."""

from __future__ import annotations

import functools
import ssl

import httpx


def http_client(base_url: str, connect_timeout: float, read_timeout: float, *,
                transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """The ``httpx.Client`` for an endpoint at ``base_url`` (whose scheme decides whether
    the CA bundle is loaded). ``transport`` replaces httpx's own (tests: ``MockTransport``).

    One client may serve many :class:`~swarm.llm.client.LLMClient` at once, from any
    thread (a worker keeps one per pool thread: see ``swarm.workers``)."""
    return httpx.Client(
        timeout=httpx.Timeout(
            connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout
        ),
        transport=transport,
        verify=_ssl_context() if base_url.startswith("https:") else _plain_context(),
        headers={"User-Agent": "swarm"},
        limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
    )


@functools.cache
def _plain_context() -> ssl.SSLContext:
    # For an http:// endpoint: no CA bundle to load (it costs ~150 ms at startup); TLS is
    # never used, and if it were (an https:// proxy), verification would fail closed.
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes ~30 ms and some memory; a worker runs many clients.
    return httpx.create_ssl_context()
