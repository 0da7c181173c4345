"""The Celery app: broker and result backend are the same Redis as the ledger.

Settings that matter for tasks as long as an agent's (minutes to hours): late acks,
redelivery when a pool child dies, one task prefetched per slot, events on for
Flower, and a broker visibility timeout longer than any run — our own lease in
the ledger takes over the children of a dead worker, not kombu's redelivery.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
from typing import Any

from celery import Celery, bootsteps
from celery.signals import worker_ready, worker_shutdown

from swarm import patches
from swarm.store.sentinel import is_sentinel, require_master

patches.install_redis_transport()

QUEUE = "swarm"


def host_queue(host: str) -> str:
    """The queue only the workers of ``host`` take tasks from (besides their others): a
    child taken over while its folder is on that host, with no snapshot to restore it
    elsewhere, is sent there."""
    return f"{QUEUE}.host.{host}"


#: Longer than any healthy run: a shorter one makes Redis redeliver a live task.
VISIBILITY_TIMEOUT = 12 * 3600

#: Its tasks (:mod:`swarm.broker.names`) are registered by the modules that define them,
#: which ``swarm worker`` imports: this module names no layer above its own.
app = Celery("swarm")
app.conf.update(
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_send_task_events=True,
    task_send_sent_event=True,
    # Flower learns that a task started from the worker's task-started event; the
    # STARTED state in the result backend would cost a write and a publish per task.
    task_track_started=False,
    # One result backend (one connection pool) per process, not one per pool thread.
    result_backend_thread_safe=True,
    result_extended=True,
    result_expires=24 * 3600,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
    result_backend_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
    worker_hijack_root_logger=False,
    worker_redirect_stdouts=False,
)


def configure(redis_url: str, master: str = "") -> Celery:
    """Point the app at ``redis_url`` (the same Redis holds broker, results and ledger).

    A ``sentinel://...;sentinel://...`` URL uses kombu's and Celery's own Sentinel
    transports for the broker and the result backend, with ``master`` as their
    ``master_name`` transport option (:mod:`swarm.store.sentinel`)."""
    celery_url = redis_url
    if celery_url.startswith("unix://"):
        celery_url = "redis+socket://" + celery_url[len("unix://"):]
    options: dict[str, Any] = {"visibility_timeout": VISIBILITY_TIMEOUT}
    if is_sentinel(celery_url):
        require_master(celery_url, master)
        options["master_name"] = master
    if app.conf.broker_url not in (None, celery_url) or \
            app.conf.broker_transport_options.get("master_name") != options.get("master_name"):
        # Pointed elsewhere after use (tests, a server restarted on another port): the
        # broker pool and the result backend of the old URL must not be reused.
        patches.reset_connections(app)
    app.conf.broker_url = celery_url
    app.conf.result_backend = celery_url
    app.conf.broker_transport_options = dict(options)
    app.conf.result_backend_transport_options = dict(options)
    if celery_url.startswith("rediss://") and "ssl_cert_reqs" not in celery_url:
        # Celery refuses rediss:// without a certificate policy; verify by default.
        app.conf.broker_use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        app.conf.redis_backend_use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    return app


def store_url() -> str:
    """The Redis URL the app points at, as swarm spells it (``unix://`` for a socket)."""
    return str(app.conf.broker_url or "").replace("redis+socket://", "unix://")


def store_master() -> str:
    """The master's name when the app points at sentinels, else ""."""
    return str(app.conf.broker_transport_options.get("master_name") or "")


if os.environ.get("SWARM_REDIS_URL"):
    configure(os.environ["SWARM_REDIS_URL"], os.environ.get("SWARM_REDIS_MASTER", ""))


def sandbox_summary() -> str:
    """Where this worker runs its children's commands, in one line (tried once)."""
    from swarm.agent import sandbox
    from swarm.config import Settings

    return sandbox.for_worker(Settings.from_env()).summary


class SandboxInfo(bootsteps.StartStopStep):  # type: ignore[misc]
    """Adds ``swarm_sandbox`` to the worker's stats (``celery inspect stats``, Flower's
    worker page); a StartStopStep, as only those are asked for their info."""

    def info(self, obj: object) -> dict[str, str]:
        return {"swarm_sandbox": sandbox_summary()}


app.steps["worker"].add(SandboxInfo)

#: Seconds between publishes of a worker's buffered task events (Flower's received,
#: started, succeeded): one message for all its children's, not one each.
EVENTS_EVERY = 0.2


class TaskEventsEvery(bootsteps.StartStopStep):  # type: ignore[misc]
    """Publishes the worker's task events every :data:`EVENTS_EVERY` seconds. Celery
    buffers them (with an event loop) but flushes at the loop's next tick, so nearly each
    event was a PUBLISH of its own (~3 a child)."""

    requires = ("celery.worker.consumer.events:Events",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.timer: Any = None

    def start(self, c: Any) -> None:  # again after each reconnection, with a new dispatcher
        if c.hub is None or c.event_dispatcher is None:
            return
        c.event_dispatcher.on_send_buffered = None
        if self.timer is None:
            self.timer = c.hub.call_repeatedly(EVENTS_EVERY, c._flush_events)

    def shutdown(self, c: Any) -> None:
        with contextlib.suppress(Exception):  # the last events, best effort
            c._flush_events()


app.steps["consumer"].add(TaskEventsEvery)


class _Heartbeat:
    """This worker's key in Redis while it runs (``swarm run`` checks that someone will run
    children); deleted at shutdown, not left to expire."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.key = ""
        self.sandbox_key = ""
        self.sandbox = ""
        self.redis: Any = None

    def start(self, sender: object, **_: object) -> None:
        from swarm.store import keys
        from swarm.store.connection import connect

        name = str(getattr(sender, "hostname", "worker"))
        self.key = keys.heartbeat("worker", name)
        self.sandbox_key = keys.worker_sandbox(name)
        self.sandbox = sandbox_summary()
        self.redis = connect(store_url(), master=store_master())
        threading.Thread(target=self.beat, name="swarm-heartbeat", daemon=True).start()

    def beat(self) -> None:
        from swarm.store import keys

        while not self.stopped.is_set():
            with contextlib.suppress(Exception):  # a Redis blip must not stop the heartbeat
                pipe = self.redis.pipeline(transaction=False)
                # The sandbox first: whoever sees the heartbeat may read it.
                pipe.set(self.sandbox_key, self.sandbox, ex=keys.HEARTBEAT_TTL)
                pipe.set(self.key, time.time(), ex=keys.HEARTBEAT_TTL)
                pipe.set(keys.worker_host(socket.gethostname()), self.key,
                         ex=keys.HOST_TTL)
                pipe.execute()
            self.stopped.wait(keys.HEARTBEAT_TTL / 3)

    def stop(self, sender: object, **_: object) -> None:
        self.stopped.set()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                self.redis.delete(self.key, self.sandbox_key)


_heartbeat = _Heartbeat()
worker_ready.connect(_heartbeat.start)
worker_shutdown.connect(_heartbeat.stop)
