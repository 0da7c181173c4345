"""Schedules in Redis: definitions, their celery-redbeat entries, folder sync, firing."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import redis
from celery import Celery
from redbeat.schedulers import REDBEAT_SENTINEL_KEY, RedBeatConfig, RedBeatSchedulerEntry

from swarm.agent import agent_types
from swarm.broker import names
from swarm.mcp_client import config as mcp_config
from swarm.runtime.jobs import submit_job
from swarm.schedules.spec import Schedule, ScheduleError, folder_source, load_folder, parse_cron
from swarm.serve.jobs import jobs_root, new_job_folder
from swarm.store import keys
from swarm.store.ledger import Ledger
from swarm.store.sentinel import Sentinels, is_sentinel, require_master

log = logging.getLogger(__name__)


def configure_redbeat(app: Celery, url: str, master: str = "") -> Celery:
    """Point celery-redbeat of ``app`` at ``url`` under swarm's key prefix (sentinels
    through redbeat's own ``redis-sentinel://`` options, with ``master`` as the service
    name). Redbeat caches its configuration and client on the app, so both are rebuilt
    here."""
    options: dict[str, Any] = {"retry_period": 60, "socket_timeout": 30,
                               "socket_connect_timeout": 5, "health_check_interval": 30}
    if is_sentinel(url):
        require_master(url, master)
        target = Sentinels.parse(url)
        url = "redis-sentinel://"  # the sentinels are in the options: redbeat reads them there
        options = {"retry_period": 60, "socket_timeout": 30, "sentinels": list(target.hosts),
                   "service_name": master, "db": target.db, "password": target.password,
                   "username": target.username,
                   "sentinel_kwargs": {"socket_timeout": 5, "socket_connect_timeout": 5}}
    app.conf.update(redbeat_redis_url=url, redbeat_key_prefix=keys.REDBEAT_PREFIX,
                    redbeat_redis_options=options)
    app.redbeat_conf = RedBeatConfig(app)
    app.redbeat_redis = None
    setattr(app, REDBEAT_SENTINEL_KEY, None)  # a Sentinel redbeat kept from an earlier URL
    return app


@dataclass
class SyncResult:
    """What a folder sync changed, and the files it could not use (name -> why)."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)


class ScheduleStore:
    """The schedules of one Redis; ``app`` must have gone through :func:`configure_redbeat`."""

    def __init__(self, redis_: redis.Redis, app: Celery) -> None:
        self.redis = redis_
        self.app = app

    def get(self, name: str) -> Schedule | None:
        raw = self.redis.hget(keys.schedules(), name)
        return Schedule.from_dict(json.loads(cast(str, raw))) if raw else None

    def all(self) -> list[Schedule]:
        rows = cast("dict[str, str]", self.redis.hgetall(keys.schedules()))
        return sorted((Schedule.from_dict(json.loads(raw)) for raw in rows.values()),
                      key=lambda s: s.name)

    def add(self, schedule: Schedule, replace: bool = False) -> Schedule:
        """Store ``schedule`` and its redbeat entry; it first fires at its next time."""
        schedule.validate()
        raw = json.dumps(schedule.to_dict(), ensure_ascii=False)
        if replace:
            self.redis.hset(keys.schedules(), schedule.name, raw)
        elif not self.redis.hsetnx(keys.schedules(), schedule.name, raw):
            raise ScheduleError(f"a schedule named {schedule.name!r} exists; remove it first "
                                "(`swarm schedule remove`) or pick another --name")
        self._entry(schedule.name).delete()  # a fresh clock: no catch-up of old firings
        RedBeatSchedulerEntry(schedule.name, names.SUBMIT_SCHEDULED, parse_cron(schedule.cron),
                              args=[schedule.name], app=self.app,
                              last_run_at=self.app.now()).save()
        return schedule

    def remove(self, name: str) -> bool:
        """Delete a schedule and its entry; False when there was none."""
        existed = bool(self.redis.hdel(keys.schedules(), name))
        self._entry(name).delete()
        return existed

    def next_run(self, name: str) -> datetime | None:
        """When schedule ``name`` fires next (now, when that is overdue); None when there
        is no such schedule or it never fires again. Not redbeat's ``due_at``: that adds
        the time left from now to the last run, early by the time since (06:59:59 for
        07:00 at once, hours early the day after)."""
        try:
            entry = RedBeatSchedulerEntry.from_key(self._entry(name).key, app=self.app)
        except KeyError:
            return None
        now: datetime = self.app.now()
        if entry.last_run_at is None:
            return now
        entry.schedule.nowfun = lambda: now  # one "now" for the estimate and the sum
        left = entry.schedule.remaining_estimate(entry.last_run_at)
        return None if left is None else now + max(left, timedelta(0))

    def beat_running(self) -> bool:
        """True while some ``swarm beat`` holds redbeat's lock on this Redis."""
        return bool(self.redis.exists(self.app.redbeat_conf.lock_key))

    def sync_folder(self, folder: Path, settings: dict[str, Any]) -> SyncResult:
        """Make the schedules from ``folder`` match its ``.swarm/schedules/*.toml`` files:
        add new ones, update changed ones, remove those whose file is gone. A file that is
        not a valid schedule is reported and keeps the schedule it had."""
        found, problems = load_folder(folder, settings)
        result = SyncResult(problems=problems)
        source = folder_source(folder)
        current = {s.name: s for s in self.all()}
        for schedule in found:
            old = current.get(schedule.name)
            if old is not None and old.source != source:
                result.problems[f"{schedule.name}.toml"] = (
                    f"a schedule named {schedule.name!r} exists from {old.source}; rename the "
                    "file or remove the other one")
                continue
            if old is not None and old.same_as(schedule):
                continue
            if old is not None:
                schedule.created, schedule.last_job = old.created, old.last_job
                schedule.last_fired = old.last_fired
            self.add(schedule, replace=True)
            (result.updated if old is not None else result.added).append(schedule.name)
        keep = {s.name for s in found} | {Path(f).stem for f in problems}
        for name, old in current.items():
            if old.source == source and name not in keep and self.remove(name):
                result.removed.append(name)
        return result

    def _entry(self, name: str) -> RedBeatSchedulerEntry:
        return RedBeatSchedulerEntry(name, names.SUBMIT_SCHEDULED, parse_cron("@every 1d"),
                                     app=self.app)


def fire(redis_: redis.Redis, app: Celery, name: str, fire_id: str, home: Path
         ) -> dict[str, str]:
    """Submit the job of schedule ``name`` (the body of ``swarm.job.submit``). A firing
    delivered twice (same ``fire_id``, the Celery task id) submits one job."""
    raw = redis_.hget(keys.schedules(), name)
    if not raw:
        log.warning("schedule %s fired but is gone; no job", name)
        return {"schedule": name, "state": "removed"}
    schedule = Schedule.from_dict(json.loads(cast(str, raw)))
    if fire_id and not redis_.set(keys.schedule_fire(fire_id), "1", nx=True,
                                  ex=keys.SCHEDULE_FIRE_TTL):
        return {"schedule": name, "state": "duplicate"}
    root = None if schedule.workspace else jobs_root(home).resolve()
    workspace = new_job_folder(root) if root is not None else Path(schedule.workspace)
    settings = {**schedule.settings, "yes": schedule.approve == "all"}
    # Fired on a worker: its own SWARM_HOME/mcp.json (no box sees it), never the files of a
    # folder earlier firings' commands wrote.
    job_id = submit_job(Ledger(redis_), app, schedule.task, workspace, settings,
                        source=f"schedule:{name}", jobs_root=root,
                        mcp=mcp_config.load(None, home), types=agent_types.load(None, home))
    schedule.last_job, schedule.last_fired = job_id, time.time()
    if redis_.hexists(keys.schedules(), name):  # not removed meanwhile
        redis_.hset(keys.schedules(), name, json.dumps(schedule.to_dict(), ensure_ascii=False))
    log.info("schedule %s fired: job %s", name, job_id)
    return {"schedule": name, "job": job_id}
