"""``swarm beat``: Celery beat with the celery-redbeat scheduler, plus a folder sync."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery

from swarm.schedules.store import ScheduleStore, SyncResult

log = logging.getLogger(__name__)

#: Seconds between two syncs of a ``--folder``'s schedule files.
SYNC_EVERY = 5.0


def report(result: SyncResult, say: Callable[[str], None]) -> None:
    for verb, names in (("added", result.added), ("updated", result.updated),
                        ("removed", result.removed)):
        if names:
            say(f"schedules {verb}: {', '.join(names)}")
    for file, problem in result.problems.items():
        say(f"schedule file {file} is not used: {problem}")


def sync_forever(store: ScheduleStore, folder: Path, settings: dict[str, Any],
                 stop: threading.Event, say: Callable[[str], None]) -> None:
    """Sync ``folder``'s files every :data:`SYNC_EVERY` seconds until ``stop``; a file's
    problem is reported once until it changes."""
    told: dict[str, str] = {}
    while not stop.wait(SYNC_EVERY):
        try:
            result = store.sync_folder(folder, settings)
        except Exception as exc:  # a Redis blip must not end the sync
            log.warning("schedule folder sync failed: %s", exc)
            continue
        fresh = {f: p for f, p in result.problems.items() if told.get(f) != p}
        told = dict(result.problems)
        result.problems = fresh
        report(result, say)


def run_beat(app: Celery, max_interval: float, loglevel: str) -> None:
    """Run beat in this process until SIGINT/SIGTERM; ``app`` must be configured for
    redbeat (:func:`swarm.schedules.store.configure_redbeat`). Only the beat holding
    redbeat's lock fires; the others wait to take over."""
    from celery.apps.beat import Beat
    from redbeat.schedulers import RedBeatConfig

    # redbeat renews its lock for int(timeout) seconds: keep it a whole number, >= 5.
    app.conf.redbeat_lock_timeout = max(5, int(5 * max_interval))
    app.redbeat_conf = RedBeatConfig(app)
    Beat(app=app, scheduler="redbeat.RedBeatScheduler", max_interval=max_interval,
         loglevel=loglevel, quiet=True).run()
