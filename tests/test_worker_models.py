"""ModelClients: the children of one worker process share an HTTP client per thread and
what they learnt of a model's context length (``/models`` once per CONTEXT_TTL)."""

from __future__ import annotations

import threading

from swarm.cache import TTLCache
from swarm.config import Settings
from swarm.testing.server import ScriptedModelServer
from swarm.workers.models import ModelClients


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_context_length_is_asked_once_per_ttl_not_once_per_child(
        model_server: ScriptedModelServer) -> None:
    model_server.context_length = 12_345
    settings = Settings(base_url=model_server.base_url, model=model_server.models[0])
    clock = Clock()
    clients = ModelClients()
    clients._contexts = TTLCache(ModelClients.CONTEXT_TTL, clock=clock)

    def child() -> int:
        model = clients.client(settings)
        try:
            return model.context_length()
        finally:
            clients.close(model)

    assert child() == 12_345 and model_server.models_requests == 1
    clock.now += 200
    assert child() == 12_345 and model_server.models_requests == 1  # learnt, not asked
    # The second child knew it from the cache: giving it back does not make it fresh again.
    clock.now += ModelClients.CONTEXT_TTL - 200
    model_server.context_length = 54_321
    assert child() == 54_321 and model_server.models_requests == 2


def test_each_thread_keeps_its_own_http_client(model_server: ScriptedModelServer) -> None:
    settings = Settings(base_url=model_server.base_url, model=model_server.models[0])
    clients = ModelClients()
    mine = clients.http(settings)
    assert clients.http(settings) is mine
    other: list[object] = []
    thread = threading.Thread(target=lambda: other.append(clients.http(settings)))
    thread.start()
    thread.join(30)
    assert other and other[0] is not mine


def test_a_base_url_with_userinfo_still_shares_the_context_length(
        model_server: ScriptedModelServer) -> None:
    model_server.context_length = 4_096
    url = model_server.base_url.replace("http://", "http://alice:hunter2@")
    settings = Settings(base_url=url, model=model_server.models[0])
    clients = ModelClients()
    for _ in range(3):
        model = clients.client(settings)
        try:
            assert model.context_length() == 4_096
        finally:
            clients.close(model)
    assert model_server.models_requests == 1
