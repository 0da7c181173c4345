"""Celery events sent in batches: many events, one ``task.multi`` message.

Celery's and Flower's event receivers take a list body apart, so buffered task events
cost one publish per flush instead of one per event. Used for the children's progress
(``task-progress``, flushed by the worker's supervisor) and for the coordinator's
``task-sent`` events (flushed after each batch of dispatched runs). A worker's own task
events (received, started, succeeded) are Celery's, buffered by it and published every
0.2 s (:class:`swarm.broker.app.TaskEventsEvery`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from celery import Celery

log = logging.getLogger(__name__)

#: Events buffered between flushes before they are sent anyway.
BUFFER_LIMIT = 1000


class BufferedEvents:
    """One Celery event dispatcher for a process, buffering ``task-*`` events; best effort
    (a failure is logged at debug level and the dispatcher rebuilt on the next event)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._dispatcher: Any = None
        self._url = ""

    def send(self, kind: str, hostname: str | None = None, **fields: Any) -> None:
        """Buffer one event. ``hostname`` names the sender (default: this process's Celery
        name); it is taken when the dispatcher is built, by the first event after a start
        or a failure, so every event of one process must give the same."""
        with self._lock:
            try:
                if self._dispatcher is None or self._url != self.app.conf.broker_url:
                    self._close()
                    self._url = str(self.app.conf.broker_url)
                    self._dispatcher = self.app.events.Dispatcher(
                        self.app.connection_for_write(), hostname=hostname, enabled=True,
                        buffer_while_offline=False, buffer_group={"task"},
                        buffer_limit=BUFFER_LIMIT)
                self._dispatcher.send(kind, **fields)
            except Exception as exc:  # events must never stop the work they describe
                log.debug("event %s not sent: %s", kind, exc)
                self._close()

    def flush(self) -> None:
        """Publish the buffered events (one message)."""
        with self._lock:
            if self._dispatcher is None:
                return
            try:
                self._dispatcher.flush(errors=False)
            except Exception as exc:
                log.debug("events not sent: %s", exc)
                self._close()

    def _close(self) -> None:
        if self._dispatcher is not None:
            with contextlib.suppress(Exception):
                self._dispatcher.connection.close()
        self._dispatcher = None


class SentEvents:
    """Stands in for Celery's event dispatcher in ``send_task(event_dispatcher=...)``: the
    ``task-sent`` event of each message is kept, and :meth:`flush` hands them all to a
    :class:`BufferedEvents` as one message."""

    def __init__(self, events: BufferedEvents) -> None:
        self.events = events
        self._kept: list[tuple[str, dict[str, Any]]] = []
        self._names: dict[str, str] = {}

    def name(self, task_id: str, shadow: str) -> None:
        """Send ``task_id``'s event under its ``shadow`` name. Celery names a task-sent
        event after the task; the worker's task-received after the shadow. Sent late, the
        task-sent event can reach Flower after task-received and would rename the task."""
        self._names[task_id] = shadow

    def publish(self, type: str, fields: dict[str, Any], producer: Any = None,
                **_: Any) -> None:
        event = {"timestamp": time.time(), **fields}
        if event.get("uuid") in self._names:
            event["name"] = self._names[event["uuid"]]
        self._kept.append((type, event))

    def flush(self) -> None:
        kept, self._kept = self._kept, []
        self._names.clear()
        for kind, fields in kept:
            self.events.send(kind, **fields)
        self.events.flush()
