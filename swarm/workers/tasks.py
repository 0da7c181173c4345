"""Thin Celery tasks: they take ids, run one step of the swarm, and never wait on other tasks."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Any

from celery import Task

from swarm.config import Settings
from swarm.store.connection import connect
from swarm.workers.app import app
from swarm.workers.child import ChildRunner

log = logging.getLogger(__name__)

#: Progress events buffered between flushes before they are sent anyway.
BUFFER_LIMIT = 1000


@functools.cache
def runner() -> ChildRunner:
    """The process's runner, built on first use from the worker's environment."""
    settings = Settings.from_env()
    url = settings.redis_url or os.environ.get("SWARM_REDIS_URL", "")
    child_runner = ChildRunner(settings, connect(url))
    child_runner.supervisor.flush_hooks.append(_events.flush)
    return child_runner


class _Events:
    """One Celery event dispatcher per worker process for the children's progress events
    (Flower's task-progress), instead of a dispatcher and a pooled producer per event.

    Events are buffered and published as one ``task.multi`` message (a list, which Celery's
    and Flower's event receivers take apart) when the supervisor flushes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dispatcher: Any = None
        self._url = ""

    def send(self, task: Task, kind: str, **fields: Any) -> None:
        """Send one event for ``task``; best effort (a failure is logged, not raised)."""
        with self._lock:
            try:
                if self._dispatcher is None or self._url != app.conf.broker_url:
                    self._close()
                    self._url = str(app.conf.broker_url)
                    self._dispatcher = app.events.Dispatcher(
                        app.connection_for_write(), hostname=task.request.hostname,
                        enabled=True, buffer_while_offline=False, buffer_group={"task"},
                        buffer_limit=BUFFER_LIMIT)
                self._dispatcher.send(kind, uuid=task.request.id, **fields)
            except Exception as exc:  # progress must never stop a child
                log.debug("progress event not sent: %s", exc)
                self._close()

    def flush(self) -> None:
        """Publish the buffered events (one message)."""
        with self._lock:
            if self._dispatcher is None:
                return
            try:
                self._dispatcher.flush(errors=False)
            except Exception as exc:
                log.debug("progress events not sent: %s", exc)
                self._close()

    def _close(self) -> None:
        if self._dispatcher is not None:
            with contextlib.suppress(Exception):
                self._dispatcher.connection.close()
        self._dispatcher = None


_events = _Events()


def _progress(task: Task) -> Any:
    def send(kind: str, **fields: Any) -> None:
        _events.send(task, kind, **fields)
    return send


@app.task(name="swarm.agent.run", bind=True)
def run_agent(self: Task, run_id: str) -> dict[str, Any]:
    """Run a child for one ``agent`` call (the run id is the task id)."""
    return runner().run(run_id, send=_progress(self),
                        traceparent=str(self.request.get("traceparent") or ""))


@app.task(name="swarm.agent.resume", bind=True)
def resume_agent(self: Task, run_id: str) -> dict[str, Any]:
    """Carry on a parked child once its own children have settled."""
    return runner().run(run_id, resume=True, send=_progress(self))
