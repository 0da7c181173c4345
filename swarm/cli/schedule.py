"""``swarm schedule add/list/remove`` and ``swarm beat``: jobs on a cron schedule."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from swarm.cli.options import Abort, handle_errors, settings_from
from swarm.cli.serve import local_runtime, workers_option
from swarm.store.connection import Store, open_store

if TYPE_CHECKING:
    from swarm.schedules.store import ScheduleStore

CTX = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

APPROVE_HELP = ("all (default): every tool call of the job is approved, nobody is asked. "
                "ask: the approval policies (SWARM_APPROVAL) apply and requests wait in the "
                "queue for `swarm approve` or POST /v1/approvals; nobody may be watching when "
                "a schedule fires, so a request no one answers within SWARM_APPROVAL_TIMEOUT "
                "is denied.")


def schedules(store: Store) -> ScheduleStore:
    """The schedules on ``store`` (imports Celery and redbeat only when needed)."""
    from swarm.broker.app import configure
    from swarm.schedules.store import ScheduleStore, configure_redbeat

    return ScheduleStore(store.redis, configure_redbeat(configure(store.url, store.master),
                                                        store.url, store.master))


@click.group(context_settings=CTX)
def schedule() -> None:
    """Jobs on a cron schedule, fired by `swarm beat` (schedules are kept in Redis).

    A scheduled run is an ordinary job: `swarm status`, Flower and GET /v1/jobs/ID show
    it. Files `.swarm/schedules/NAME.toml` in an agent folder (fields cron, task,
    approve, workspace) are schedules too: see `swarm beat --folder`.
    """


@schedule.command("add", context_settings=CTX)
@click.argument("cron")
@click.argument("task")
@click.option("--name", default=None, help="Name to list and remove it by (default: from the "
                                           "task's first words).")
@click.option("--approve", type=click.Choice(["all", "ask"]), default="all", show_default=True,
              help=APPROVE_HELP)
@click.option("--workspace", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder the job works in (on the worker's machine; default: a fresh "
                   "folder under the worker's SWARM_HOME/jobs per run).")
@handle_errors
def schedule_add(cron: str, task: str, name: str | None, approve: str,
                 workspace: Path | None) -> None:
    """Run TASK as a job on CRON: five fields MINUTE HOUR DAY MONTH WEEKDAY in UTC
    ('0 3 * * *': 03:00 every day), @hourly/@daily/@weekly/@monthly/@yearly, or
    '@every N[s|m|h|d]'.

    The job gets the settings you gave here by a flag or SWARM_* variable (model,
    endpoint, limits, approval policies; never the API key, which the workers have).
    A task too large for the model's context is refused here, as `swarm run` refuses it.

    \b
      swarm schedule add '0 6 * * 1-5' 'summarise the new lines of /srv/logs/app.log' --name logs
    """
    from swarm.errors import RequestError
    from swarm.schedules.spec import Schedule, ScheduleError
    from swarm.serve.jobs import check_job_task, inherited_settings, model_context

    settings = settings_from()
    try:  # as the API does; the worker's agent checks again when the job runs
        check_job_task(task, model_context(settings), settings)
    except RequestError as exc:
        raise Abort(str(exc)) from None
    name = name or _name_of(task)
    item = Schedule(name=name, cron=cron, task=task, approve=approve,
                    workspace=str(workspace.expanduser().resolve()) if workspace else "",
                    settings=inherited_settings(settings))
    with open_store(settings) as store:
        found = schedules(store)
        try:
            found.add(item)
        except ScheduleError as exc:
            raise Abort(str(exc)) from None
        due = found.next_run(name)
        beat = found.beat_running()
    click.echo(name)
    click.echo(f"schedule {name} added; next run {_when(due)}", err=True)
    if not beat:
        click.echo("note: no `swarm beat` runs on this Redis right now; start one to fire it",
                   err=True)


@schedule.command("list", context_settings=CTX)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per schedule.")
@handle_errors
def schedule_list(as_json: bool) -> None:
    """The schedules: name, cron, approvals, next run, last job, source and task."""
    with open_store(settings_from()) as store:
        found = schedules(store)
        rows = [(s, found.next_run(s.name)) for s in found.all()]
    if not rows and not as_json:
        click.echo("no schedules; `swarm schedule add CRON TASK` adds one", err=True)
    for s, due in rows:
        if as_json:
            data = {k: v for k, v in s.to_dict().items() if k != "settings"}
            data["next_run"] = due.timestamp() if due else None
            click.echo(json.dumps(data, ensure_ascii=False))
            continue
        label = " ".join(s.task.split())[:60]
        click.echo(f"{s.name}  [{s.cron}]  approve={s.approve}  next {_when(due)}  "
                   f"last {s.last_job or '-'}  ({s.source})  {label}")


@schedule.command("remove", context_settings=CTX)
@click.argument("name")
@handle_errors
def schedule_remove(name: str) -> None:
    """Remove schedule NAME (jobs it started go on). A schedule from a folder's file comes
    back at the next sync unless the file is deleted."""
    with open_store(settings_from()) as store:
        if not schedules(store).remove(name):
            raise Abort(f"no schedule {name!r}; `swarm schedule list` shows them")
    click.echo(f"schedule {name} removed", err=True)


@click.command(context_settings=CTX)
@click.option("--folder", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None,
              help="Agent folder whose .swarm/schedules/*.toml files are schedules (name = "
                   "file name; fields cron, task, approve, workspace relative to the folder, "
                   "default the folder itself). Synced every few seconds: a new file adds a "
                   "schedule, an edit updates it, a deleted file removes it.")
@click.option("--max-interval", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Longest sleep of the beat loop, seconds: schedules added elsewhere are "
                   "seen this fast; a dead beat's lock passes to another after 5x this "
                   "(at least 5 s).")
@workers_option
@click.option("-l", "--loglevel", default="INFO", show_default=True)
@handle_errors
def beat(folder: Path | None, max_interval: float, workers: int | None, loglevel: str) -> None:
    """Fire schedules: Celery beat with the celery-redbeat scheduler (schedule in Redis).

    Run one or several (on any machines with SWARM_REDIS_URL): they share one lock, so a
    schedule fires once, and another takes over when the firing one stops. Each firing
    sends `swarm.job.submit(NAME)` to the workers, which submit an ordinary job.
    Approvals follow each schedule's --approve; with `ask` nobody may be watching.
    """
    from swarm.schedules.beat import report, run_beat, sync_forever
    from swarm.serve.jobs import inherited_settings

    settings = settings_from()
    with open_store(settings) as store, local_runtime(store, settings, workers):
        found = schedules(store)
        stop = threading.Event()
        if folder is not None:
            given = inherited_settings(settings)
            report(found.sync_folder(folder, given), lambda m: click.echo(m, err=True))
            threading.Thread(target=sync_forever, daemon=True, name="schedule-sync", args=(
                found, folder, given, stop, lambda m: click.echo(m, err=True))).start()
        click.echo(f"swarm beat on {store.masked_url}"
                   + (f", syncing {folder}" if folder else ""), err=True)
        try:
            run_beat(found.app, max_interval, loglevel)
        finally:
            stop.set()


def _name_of(task: str) -> str:
    words = "".join(c if c.isascii() and c.isalnum() else " " for c in task).split()[:4]
    return ("-".join(words).lower()[:40] or "job") + time.strftime("-%H%M%S")


def _when(due: object) -> str:
    if due is None:
        return "-"
    from datetime import datetime

    assert isinstance(due, datetime)
    return due.astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
