"""How the children of one worker process reach their models: HTTP clients kept per pool
thread, and each model's context length remembered for a while."""

from __future__ import annotations

import threading

import httpx

from swarm.cache import TTLCache
from swarm.config import Settings
from swarm.llm.client import LLMClient, http_client
from swarm.text import without_userinfo


class ModelClients:
    """What the children of one worker process share to reach their models: an HTTP
    client per pool thread and kind of endpoint settings, and each model's context length
    (``/models`` is asked once per :data:`CONTEXT_TTL`, not once per child).

    A client per thread rather than one pool for the process: a child's requests run one
    after another in its thread, so each thread keeps one warm connection, and httpcore's
    pool scans every connection it holds on each request and each close (with 200
    children in one pool that scan was over half the worker's CPU)."""

    CONTEXT_TTL = 300.0

    def __init__(self) -> None:
        self._local = threading.local()
        self._contexts: TTLCache[tuple[str, str], int] = TTLCache(self.CONTEXT_TTL)

    def http(self, settings: Settings) -> httpx.Client:
        """This thread's HTTP client for ``settings``' kind of endpoint."""
        base = settings.base_url.rstrip("/")
        key = (base.startswith("https:"), settings.connect_timeout, settings.read_timeout)
        clients: dict[tuple[bool, float, float], httpx.Client] | None = getattr(
            self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        http = clients.get(key)
        if http is None:
            http = clients[key] = http_client(base, settings.connect_timeout,
                                              settings.read_timeout)
        return http

    def client(self, settings: Settings) -> LLMClient:
        """A client of ``settings``' model on this thread's HTTP client; it knows the
        model's context length when a child of this process learnt it lately."""
        known = self._contexts.get((without_userinfo(settings.base_url.rstrip("/")),
                                    settings.model))
        return LLMClient.from_settings(settings, http=self.http(settings),
                                       context_length=known)

    def close(self, model: LLMClient) -> None:
        """Remember what ``model`` learnt of its context length; the pool stays open."""
        length = model.known_context_length
        if length is not None and model.model:
            # add, not put: a length that came from this cache does not make itself fresh
            # again, so /models is asked once per CONTEXT_TTL.
            self._contexts.add((model.base_url, model.model), length)
        model.close()
