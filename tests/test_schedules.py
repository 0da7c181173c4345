"""Schedules: add/list/remove, folder files synced, a firing submits a job, and Celery beat
(celery-redbeat) really fires on time against a real swarm; two beats do not double-fire."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from itertools import pairwise
from pathlib import Path

import pytest
import redis as redis_lib
from celery import Celery
from click.testing import CliRunner
from redbeat import RedBeatSchedulerEntry

from swarm.broker.app import QUEUE
from swarm.cli import main
from swarm.runtime.jobs import job_state
from swarm.schedules.spec import Schedule, ScheduleError, load_folder, parse_cron
from swarm.schedules.store import ScheduleStore, configure_redbeat, fire
from swarm.store import keys
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask
from swarm.testing.server import Reply, ScriptedModelServer

PLANTED = "sk-planted-schedule-31f0"


def app_for(url: str) -> Celery:
    """A Celery app of its own per Redis (the process-wide one caches its broker pool)."""
    app = Celery("swarm-schedule-test", set_as_current=False)
    app.conf.update(broker_url=url, task_default_queue=QUEUE, task_serializer="json",
                    accept_content=["json"])
    return configure_redbeat(app, url)


@pytest.fixture
def store(redis: redis_lib.Redis, redis_server: str) -> ScheduleStore:
    return ScheduleStore(redis, app_for(redis_server))


def cli(url: str, *args: str, **env: str) -> tuple[int, str, str]:
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    result = CliRunner().invoke(main, list(args), env={**base, "SWARM_REDIS_URL": url, **env})
    return result.exit_code, result.stdout, result.stderr


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / ".swarm" / "schedules" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_cron_expressions() -> None:
    assert str(parse_cron("@every 2s").run_every.total_seconds()) == "2.0"
    assert parse_cron("@daily") == parse_cron("0 0 * * *")
    assert parse_cron("*/15 9-17 * * 1-5").hour == set(range(9, 18))
    for bad, says in [("61 * * * *", "bad minute field"), ("* * *", "five fields"),
                      ("@every 0s", "at least 1 second"), ("@sometimes", "five fields"),
                      ("* * * * mon-xyz", "bad day of week")]:
        with pytest.raises(ScheduleError, match=says):
            parse_cron(bad)


def test_add_list_and_remove(redis: redis_lib.Redis, redis_server: str) -> None:
    code, out, err = cli(redis_server, "schedule", "add", "0 3 * * *", "tidy the logs",
                         "--name", "tidy", "--approve", "ask",
                         SWARM_MAX_DEPTH="2", SWARM_API_KEY=PLANTED)
    assert code == 0, err
    assert out.strip() == "tidy" and "next run" in err and "no `swarm beat` runs" in err
    stored = json.loads(redis.hget(keys.schedules(), "tidy") or "")
    assert stored["cron"] == "0 3 * * *" and stored["approve"] == "ask"
    assert stored["settings"] == {"max_depth": 2} and stored["source"] == "cli"
    assert redis.zscore(f"{keys.REDBEAT_PREFIX}:schedule", f"{keys.REDBEAT_PREFIX}tidy")
    dump = json.dumps([redis.hgetall(k) for k in redis.scan_iter(match=f"{keys.PREFIX}*")
                       if redis.type(k) == "hash"])
    assert PLANTED not in dump  # the key stays with the workers

    code, out, _ = cli(redis_server, "schedule", "add", "@every 10m", "second one")
    assert code == 0 and out.strip().startswith("second-one-")
    code, _, err = cli(redis_server, "schedule", "add", "* * * * *", "again", "--name", "tidy")
    assert code == 1 and "exists" in err
    for args, says in [(["61 * * * *", "x"], "bad minute field"),
                       (["* * * * *", "x", "--name", "no/slash"], "schedule name"),
                       (["* * * * *", "x", "--approve", "maybe"], "'maybe' is not one of")]:
        code, _, err = cli(redis_server, "schedule", "add", *args)
        assert code != 0 and says in err, err

    code, out, _ = cli(redis_server, "schedule", "list")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("tidy  [0 3 * * *]  approve=ask  next ")
    listed = [json.loads(line) for line in cli(redis_server, "schedule", "list", "--json")[1]
              .splitlines()]
    tidy = next(item for item in listed if item["name"] == "tidy")
    assert tidy["next_run"] > time.time() and "settings" not in tidy

    assert cli(redis_server, "schedule", "remove", "tidy")[0] == 0
    assert not redis.hexists(keys.schedules(), "tidy")
    assert not redis.exists(f"{keys.REDBEAT_PREFIX}tidy")
    code, _, err = cli(redis_server, "schedule", "remove", "tidy")
    assert code == 1 and "no schedule 'tidy'" in err


def test_a_task_too_large_for_the_model_is_not_scheduled(
        redis: redis_lib.Redis, redis_server: str, model_server: ScriptedModelServer) -> None:
    code, _, err = cli(redis_server, "schedule", "add", "@daily", "q" * 100_000,
                       "--name", "huge", SWARM_BASE_URL=model_server.base_url,
                       SWARM_MODEL=model_server.models[0])
    assert code == 1, err
    assert "about 25,000 tokens" in err and "32,768 tokens" in err
    assert not redis.hexists(keys.schedules(), "huge") and model_server.requests == []


def test_folder_files_are_synced(store: ScheduleStore, tmp_path: Path) -> None:
    folder = tmp_path / "agent"
    nightly = write(folder, "nightly", 'cron = "0 2 * * *"\ntask = "check the backups"\n')
    write(folder, "broken", 'cron = "0 2 * * *"\ntask = "x"\ncolour = "red"\n')
    write(folder, "badcron", 'cron = "every day"\ntask = "x"\n')
    write(folder, "unparsable", "cron = \n")
    first = store.sync_folder(folder, {"model": "m"})
    assert first.added == ["nightly"] and not first.updated and not first.removed
    assert set(first.problems) == {"broken.toml", "badcron.toml", "unparsable.toml"}
    assert "unknown field(s) colour" in first.problems["broken.toml"]
    got = store.get("nightly")
    assert got is not None and got.workspace == str(folder.resolve())
    assert got.approve == "all" and got.settings == {"model": "m"}
    assert store.next_run("nightly") is not None

    assert store.sync_folder(folder, {"model": "m"}).added == []  # nothing changed
    nightly.write_text('cron = "30 2 * * *"\ntask = "check the backups"\napprove = "ask"\n'
                       'workspace = "sub"\n')
    second = store.sync_folder(folder, {"model": "m"})
    assert second.updated == ["nightly"]
    got = store.get("nightly")
    assert got is not None and got.cron == "30 2 * * *" and got.approve == "ask"
    assert got.workspace == str((folder / "sub").resolve())

    store.add(Schedule(name="clash", cron="@hourly", task="from the cli"))
    write(folder, "clash", 'cron = "@daily"\ntask = "from a file"\n')
    third = store.sync_folder(folder, {})
    assert "exists from cli" in third.problems["clash.toml"]
    assert (store.get("clash") or Schedule("", "", "")).task == "from the cli"

    nightly.unlink()
    assert store.sync_folder(folder, {}).removed == ["nightly"]
    assert store.get("nightly") is None and store.next_run("nightly") is None
    assert [s.name for s in store.all()] == ["clash"]
    assert load_folder(tmp_path / "empty", {}) == ([], {})


def test_a_firing_submits_an_ordinary_job(store: ScheduleStore, redis: redis_lib.Redis,
                                          tmp_path: Path) -> None:
    store.add(Schedule(name="report", cron="@every 1h", task="write the report",
                       approve="ask", settings={"max_turns": 3}))
    done = fire(redis, store.app, "report", "task-1", tmp_path)
    job = done["job"]
    swarm = Ledger(redis).swarm(job)
    assert swarm["source"] == "schedule:report" and swarm["task"] == "write the report"
    assert json.loads(swarm["settings"]) == {"max_turns": 3, "yes": False}
    assert Path(swarm["workspace"]).parent == tmp_path / "jobs"
    assert job_state(Ledger(redis), job)["state"] == "queued"
    assert redis.llen(QUEUE) == 1  # the root went to the workers
    assert (store.get("report") or Schedule("", "", "")).last_job == job
    assert fire(redis, store.app, "report", "task-1", tmp_path)["state"] == "duplicate"
    store.remove("report")
    assert fire(redis, store.app, "report", "task-2", tmp_path)["state"] == "removed"
    assert redis.zcard(keys.swarms_index()) == 1


# -- beat, for real -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("beat-home")
    with local_swarm(home, concurrency=8) as url:
        yield url, home


def start_beat(url: str, home: Path, folder: Path, model: ScriptedModelServer,
               log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "OPENAI_"))}
    env.update(SWARM_REDIS_URL=url, SWARM_HOME=str(home), SWARM_BASE_URL=model.base_url,
               SWARM_MODEL=model.models[0])
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "swarm", "beat", "--folder", str(folder), "--max-interval",
             "0.5", "--workers", "0", "-l", "INFO"], env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)


def scheduled_jobs(client: redis_lib.Redis, name: str) -> list[tuple[float, str]]:
    ledger = Ledger(client)
    out = []
    for job, created in client.zrange(keys.swarms_index(), 0, -1, withscores=True):
        if ledger.swarm(job).get("source") == f"schedule:{name}":
            out.append((created, job))
    return sorted(out)


@pytest.mark.slow
def test_beat_fires_on_time_once_with_two_beats(cluster: tuple[str, Path], tmp_path: Path
                                               ) -> None:
    url, home = cluster
    client = connect(url)
    folder = tmp_path / "agent"
    write(folder, "tick", 'cron = "@every 1s"\ntask = "TICKJOB say tick"\n')
    log = tmp_path / "beat.log"
    with ScriptedModelServer(responder=ByTask({"TICKJOB": [Reply(content="tick")]})) as model:
        beats = [start_beat(url, home, folder, model, log) for _ in range(2)]
        try:
            deadline = time.monotonic() + 20
            while len(scheduled_jobs(client, "tick")) < 4:
                assert all(b.poll() is None for b in beats), log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            first = scheduled_jobs(client, "tick")[0][1]
            while job_state(Ledger(client), first)["state"] in ("queued", "running"):
                assert time.monotonic() < deadline + 10
                time.sleep(0.1)
        finally:
            for b in beats:
                b.send_signal(signal.SIGTERM)
            for b in beats:
                b.wait(timeout=15)
    jobs = scheduled_jobs(client, "tick")
    # Every second, once: two beats share redbeat's lock, so no two firings come together.
    gaps = [b[0] - a[0] for a, b in pairwise(jobs)]
    assert all(gap > 0.6 for gap in gaps), gaps
    state = job_state(Ledger(client), first)
    assert state["state"] == "done" and state["answer"] == "tick", state
    assert Ledger(client).swarm(first)["workspace"] == str(folder.resolve())
    # An ordinary job: `swarm status` shows it.
    code, out, _ = cli(url, "status", "--json", first, SWARM_HOME=str(home))
    assert code == 0 and json.loads(out)["agents"][0]["id"] == first
    text = log.read_text()
    assert "schedules added: tick" in text
    assert not client.exists(f"{keys.REDBEAT_PREFIX}:lock")  # released on SIGTERM


def test_the_next_run_is_the_cron_time_to_the_second(store: ScheduleStore,
                                                     redis_server: str) -> None:
    """'0 7 * * *' was reported as 06:59:59: redbeat's due_at adds the time left from now
    to the last run, early by the time since (hours, a day after it was added)."""
    code, _, err = cli(redis_server, "schedule", "add", "0 7 * * *", "at seven", "--name",
                       "seven")
    assert code == 0, err
    due = store.next_run("seven")
    assert due is not None and (due.hour, due.minute, due.second, due.microsecond) == \
        (7, 0, 0, 0), due
    assert f"next run {due.astimezone():%Y-%m-%d %H:%M:%S %Z}" in err, err

    store.add(Schedule(name="every", cron="@every 10m", task="x"))
    entry = RedBeatSchedulerEntry.from_key(f"{keys.REDBEAT_PREFIX}every", app=store.app)
    ran = store.app.now() - timedelta(minutes=4)  # as beat records a firing
    entry.reschedule(ran)
    assert store.next_run("every") == ran + timedelta(minutes=10)
