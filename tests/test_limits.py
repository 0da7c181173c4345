"""A running child's limits (:class:`swarm.workers.limits.Control`) one at a time: a cancel,
the wall time and its wrap-up note, the swarm's token budget and its count, a lost lease.
The real server, a real supervisor and agent, the scripted model over HTTP (never called)."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest
import redis as redis_py

from swarm.config import Settings
from swarm.errors import BudgetExceeded, Cancelled, LeaseLost, TimedOut
from swarm.store.ledger import Ledger
from swarm.testing.server import ScriptedModelServer
from swarm.workers.limits import Control
from swarm.workers.supervisor import Supervisor, Watched
from tests.helpers import make_agent


def control(redis: redis_py.Redis, *, cancelled: bool = False, spent: int = 0,
            started: float = 0.0, **settings: int) -> Control:
    """A child of swarm s1 whose run began ``started`` seconds ago."""
    watched = Watched("r1", "a1", "tok", limit=3600.0, start=time.monotonic() - started)
    return Control(redis, "s1", watched, Settings(**settings), Supervisor(redis, 30.0),
                   cancelled=cancelled, spent=spent)


def test_a_child_cancelled_while_queued_stops_before_its_first_step(
        model_server: ScriptedModelServer, redis: redis_py.Redis, tmp_path: Path) -> None:
    agent = make_agent(model_server, tmp_path)
    assert not control(redis).cancelled()
    limits = control(redis, cancelled=True)
    assert limits.cancelled()
    with pytest.raises(Cancelled, match="swarm cancel"):
        limits.before_step(agent)


def test_a_child_past_its_wall_time_stops_naming_the_setting(
        model_server: ScriptedModelServer, redis: redis_py.Redis, tmp_path: Path) -> None:
    limits = control(redis, child_timeout=5)
    limits.watched.timed_out = True  # what the supervisor does at the deadline
    limits.event.set()
    assert limits.timed_out
    with pytest.raises(TimedOut, match=r"limit of 5 s .*SWARM_CHILD_TIMEOUT"):
        limits.before_step(make_agent(model_server, tmp_path))


def test_a_lost_lease_outranks_the_other_reasons_to_stop(
        model_server: ScriptedModelServer, redis: redis_py.Redis, tmp_path: Path) -> None:
    limits = control(redis)
    limits.check_lease()  # still held: nothing happens
    limits.watched.lease_lost = limits.watched.timed_out = True
    limits.event.set()
    with pytest.raises(LeaseLost, match="r1: this worker lost its lease"):
        limits.check_lease()
    with pytest.raises(LeaseLost):
        limits.before_step(make_agent(model_server, tmp_path))


def test_the_wrap_up_note_comes_once_at_four_fifths_of_the_wall_time(
        model_server: ScriptedModelServer, redis: redis_py.Redis, tmp_path: Path) -> None:
    agent = make_agent(model_server, tmp_path)
    before = len(agent.messages)
    control(redis, child_timeout=100, started=79).before_step(agent)
    assert len(agent.messages) == before  # 79 s of 100: not yet
    limits = control(redis, child_timeout=100, started=80.2)
    limits.before_step(agent)
    limits.before_step(agent)
    assert len(agent.messages) == before + 1
    note = agent.messages[-1]
    assert note["role"] == "user"
    assert "most of your wall time (80 of 100 s)" in note["content"], note


def test_the_budget_counts_what_the_swarm_spent_before_and_stops_at_its_total(
        model_server: ScriptedModelServer, redis: redis_py.Redis, tmp_path: Path) -> None:
    agent = make_agent(model_server, tmp_path)
    Ledger(redis).spend("s1", 90)
    limits = control(redis, token_budget=100, spent=90)
    limits.before_step(agent)  # 90 of 100
    limits.count(9)
    assert limits.tokens == 99 and Ledger(redis).counters("s1")["tokens"] == 99
    limits.before_step(agent)
    limits.count(1)  # exactly the budget: stop
    with pytest.raises(BudgetExceeded, match="used 100 tokens of its budget of 100 "
                                             r"\(SWARM_TOKEN_BUDGET\)"):
        limits.before_step(agent)


def test_without_a_budget_tokens_are_counted_with_the_next_flush(
        model_server: ScriptedModelServer, redis: redis_py.Redis, tmp_path: Path) -> None:
    limits = control(redis, spent=10**9)  # no budget: what was spent before stops nothing
    assert limits.tokens == 0
    limits.before_step(make_agent(model_server, tmp_path))
    limits.count(7)
    assert "tokens" not in Ledger(redis).counters("s1")  # not yet written
    limits.supervisor.flush()
    assert Ledger(redis).counters("s1")["tokens"] == 7


def test_a_token_count_redis_refuses_is_logged_and_the_child_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gone = redis_py.Redis(port=port, socket_connect_timeout=0.5)
    limits = control(gone, token_budget=100, spent=40)
    with caplog.at_level(logging.WARNING, logger="swarm.workers.limits"):
        limits.count(5)
    assert limits.tokens == 40
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("token count not recorded: ") and str(port) in said  # and why
