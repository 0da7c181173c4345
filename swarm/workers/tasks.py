"""Thin Celery tasks: they take ids, run one step of the swarm, and never wait on other tasks."""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import Task

from swarm.broker import names
from swarm.broker.app import app, store_master, store_url
from swarm.broker.events import BufferedEvents
from swarm.config import Settings
from swarm.store.connection import connect
from swarm.workers.child import ChildRunner

log = logging.getLogger(__name__)


@functools.cache
def runner() -> ChildRunner:
    """The process's runner, built on first use from the worker's environment."""
    settings = Settings.from_env()
    # A local worker of the embedded default has no SWARM_REDIS_URL: the app knows the URL.
    url = settings.redis_url or store_url()
    master = settings.redis_master if settings.redis_url else store_master()
    child_runner = ChildRunner(settings, connect(url, master=master))
    child_runner.supervisor.flush_hooks.append(_events.flush)
    return child_runner


_events = BufferedEvents(app)


def _progress(task: Task) -> Any:
    def send(kind: str, **fields: Any) -> None:
        _events.send(kind, hostname=task.request.hostname, uuid=task.request.id, **fields)
    return send


@app.task(name=names.RUN, bind=True, ignore_result=True)
def run_agent(self: Task, run_id: str) -> dict[str, Any]:
    """Run a child for one ``agent`` call (the run id is the task id)."""
    return runner().run(run_id, send=_progress(self),
                        traceparent=str(self.request.get("traceparent") or ""))


@app.task(name=names.RESUME, bind=True, ignore_result=True)
def resume_agent(self: Task, run_id: str) -> dict[str, Any]:
    """Carry on a parked child once its own children have settled."""
    return runner().run(run_id, resume=True, send=_progress(self))
