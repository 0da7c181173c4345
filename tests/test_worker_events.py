"""Celery events as swarm sends them, read back by Celery's own EventReceiver (as Flower is)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis as redis_py
from celery.contrib.testing.worker import start_worker

from swarm.broker.app import app, configure
from swarm.broker.events import BufferedEvents


class Tap:
    """Celery's EventReceiver in a thread, keeping every event it is given."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def close(self) -> None:
        """Stop consuming (within one receive timeout) before the server may go away."""
        self.stop = True
        self.thread.join(5)
        assert not self.thread.is_alive()

    def _run(self) -> None:
        with app.connection_for_read() as conn:
            receiver = app.events.Receiver(conn, handlers={"*": self.events.append})
            consume = receiver.itercapture(limit=None, timeout=0.2, wakeup=False)
            next(consume)  # the consumer is declared: events sent from now on arrive
            self.ready.set()
            while not self.stop:
                try:
                    next(consume)
                except (TimeoutError, OSError):
                    continue

    def wait_for(self, kind: str, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [e for e in self.events if e.get("type") == kind]
            if len(got) >= count:
                return got
            time.sleep(0.02)
        raise AssertionError(f"{kind}: {len([e for e in self.events if e.get('type') == kind])}"
                             f" of {count} events arrived: {self.events[-5:]}")


def test_buffered_progress_events_reach_a_receiver(redis: redis_py.Redis,
                                                   redis_server: str) -> None:
    configure(redis_server)
    tap = Tap()
    try:
        events = BufferedEvents(app)
        for turn in range(3):
            events.send("task-progress", hostname="w1@test", uuid="r1", agent="a1", turn=turn,
                        last="run_cli: echo hi")
        # Buffered until the flush: a marker sent after them, at once, arrives first. (Had
        # they been published, Redis would have taken their PUBLISH before the marker's.)
        with app.connection_for_write() as conn:
            app.events.Dispatcher(conn, hostname="marker@test", enabled=True).send(
                "task-marker", uuid="m")
        tap.wait_for("task-marker", 1)
        assert not [e for e in tap.events if e.get("type") == "task-progress"]
        events.flush()
        got = tap.wait_for("task-progress", 3)
        assert [e["turn"] for e in got] == [0, 1, 2]
        assert {(e["uuid"], e["hostname"], e["last"]) for e in got} == \
            {("r1", "w1@test", "run_cli: echo hi")}
    finally:
        tap.close()


@app.task(name="tests.worker_events.noop", ignore_result=True)  # type: ignore[untyped-decorator]
def noop() -> None:
    """A task whose events (received, started, succeeded) are all there is to it."""


def publishes(redis_: redis_py.Redis) -> int:
    return int(redis_.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))


def test_a_workers_task_events_go_out_together_not_one_publish_each(
        redis: redis_py.Redis, redis_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    configure(redis_server)
    monkeypatch.setitem(app.conf, "task_send_sent_event", False)  # the worker's events only
    tap = Tap()
    try:
        with start_worker(app, pool="threads", concurrency=8, perform_ping_check=False,
                          loglevel="WARNING", shutdown_timeout=10):
            before = publishes(redis)
            for _ in range(20):
                noop.delay()
            tap.wait_for("task-succeeded", 20)
            sent = publishes(redis) - before
        got = [e for e in tap.events if e.get("type", "").startswith("task-")]
        assert len(got) >= 60  # received, started, succeeded: 3 a task
        # Flushed every 0.2 s: a few messages (3-4 seen; 26 when each tick flushed).
        assert sent <= 10, f"{sent} publishes for {len(got)} task events"
    finally:
        tap.close()
