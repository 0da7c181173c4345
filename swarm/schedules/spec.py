"""What a schedule is: a name, a cron expression, a task, an approval policy, a folder."""

from __future__ import annotations

import re
import time
import tomllib
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery.schedules import crontab, schedule

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
APPROVE = ("all", "ask")
ALIASES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
           "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
           "@hourly": "0 * * * *"}
EVERY = re.compile(r"^@every\s+([0-9]{1,7})\s*(s|m|h|d)?$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
CRON_HELP = ("five fields MINUTE HOUR DAY MONTH WEEKDAY in UTC (e.g. '0 3 * * *', "
             "'*/15 * * * 1-5'), an alias (@hourly, @daily, @weekly, @monthly, @yearly) "
             "or '@every N[s|m|h|d]'")
FIELDS = ("cron", "task", "approve", "workspace")


class ScheduleError(ValueError):
    """A schedule that cannot be; the message says what to fix."""


def parse_cron(text: str) -> crontab | schedule:
    """The Celery schedule of ``text``; :class:`ScheduleError` when it is not one."""
    spec = " ".join(str(text).split())
    every = EVERY.match(spec)
    if every:
        seconds = int(every[1]) * UNITS[every[2] or "s"]
        if seconds < 1:
            raise ScheduleError(f"{text!r}: the interval must be at least 1 second")
        return schedule(timedelta(seconds=seconds))
    parts = ALIASES.get(spec, spec).split(" ")
    if len(parts) != 5:
        raise ScheduleError(f"{text!r} is not a schedule: use {CRON_HELP}")
    names = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    for name, value in zip(names, parts, strict=True):
        try:
            crontab(**{name: value})
        except Exception as exc:  # celery raises ValueError or its ParseException
            raise ScheduleError(f"{text!r}: bad {name.replace('_', ' ')} field "
                                f"{value!r} ({exc}); use {CRON_HELP}") from None
    return crontab(**dict(zip(names, parts, strict=True)))


@dataclass
class Schedule:
    """One schedule. ``source`` is ``cli`` or ``folder:DIR`` (synced from DIR's files)."""

    name: str
    cron: str
    task: str
    approve: str = "all"
    workspace: str = ""
    source: str = "cli"
    settings: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    last_job: str = ""
    last_fired: float = 0.0

    def validate(self) -> Schedule:
        if not NAME.match(self.name):
            raise ScheduleError(f"schedule name {self.name!r} must be 1-64 letters, digits or "
                                "_.- (starting with a letter or digit)")
        parse_cron(self.cron)
        if not self.task.strip():
            raise ScheduleError(f"schedule {self.name!r} has an empty task")
        if self.approve not in APPROVE:
            raise ScheduleError(f"schedule {self.name!r}: approve must be 'all' or 'ask', "
                                f"not {self.approve!r}")
        return self

    def same_as(self, other: Schedule) -> bool:
        """True when ``other`` fires the same job at the same times (a sync keeps its clock)."""
        return all(getattr(self, f) == getattr(other, f) for f in (*FIELDS, "settings"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def folder_source(folder: Path) -> str:
    return f"folder:{folder.resolve()}"


def load_folder(folder: Path, settings: dict[str, Any]
                ) -> tuple[list[Schedule], dict[str, str]]:
    """The schedules of ``folder/.swarm/schedules/*.toml`` (name = file stem), and the
    problems of the files that are not valid schedules (file name -> why)."""
    found: list[Schedule] = []
    problems: dict[str, str] = {}
    directory = folder / ".swarm" / "schedules"
    for path in sorted(directory.glob("*.toml")) if directory.is_dir() else []:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
            unknown = sorted(set(data) - set(FIELDS))
            if unknown:
                raise ScheduleError(f"unknown field(s) {', '.join(unknown)}; the fields are "
                                    f"{', '.join(FIELDS)}")
            for name in ("cron", "task"):
                if not isinstance(data.get(name), str):
                    raise ScheduleError(f"{name} must be a string")
            for name in ("approve", "workspace"):
                if name in data and not isinstance(data[name], str):
                    raise ScheduleError(f"{name} must be a string")
            workspace = (folder / data["workspace"]).resolve() if data.get("workspace") \
                else folder.resolve()
            found.append(Schedule(
                name=path.stem, cron=data["cron"], task=data["task"],
                approve=data.get("approve", "all"), workspace=str(workspace),
                source=folder_source(folder), settings=settings).validate())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ScheduleError) as exc:
            problems[path.name] = str(exc)
    return found, problems
