"""The threads of swarm.agent.later: a box dies with the thread that started it, so the
threads that start boxes never end, whatever a job raises."""

from __future__ import annotations

import threading

from swarm.agent import later


def test_a_job_that_raises_anything_leaves_its_thread_running_the_next() -> None:
    threads = later.Threads(1, "test-later")
    seen: list[int] = []

    def fails() -> None:
        seen.append(threading.get_ident())
        raise SystemExit("a job that exits")

    threads.soon(fails)
    after = threads.submit(threading.get_ident)
    assert after.result(timeout=10) == seen[0]


def test_a_job_withdrawn_while_queued_does_not_run() -> None:
    threads = later.Threads(1, "test-later-cancel")
    gate = threading.Event()
    threads.soon(lambda: gate.wait(10))
    ran: list[bool] = []
    queued = threads.submit(lambda: ran.append(True))
    assert queued.cancel()
    gate.set()
    assert threads.submit(lambda: True).result(timeout=10)
    assert ran == []
