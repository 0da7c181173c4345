"""The thin Celery task of a schedule's firing, registered on the worker app."""

from __future__ import annotations

import functools

import redis
from celery import Task

from swarm.broker import names
from swarm.broker.app import app, store_master, store_url
from swarm.config import Settings
from swarm.schedules.store import fire
from swarm.store.connection import connect


@functools.cache
def _redis() -> redis.Redis:
    return connect(store_url(), master=store_master())


@app.task(name=names.SUBMIT_SCHEDULED, bind=True)
def submit_scheduled(self: Task, name: str) -> dict[str, str]:
    """Submit schedule ``name``'s job (an ordinary job: its root runs as ``swarm.agent.run``)."""
    return fire(_redis(), app, name, str(self.request.id or ""), Settings.from_env().home)
