"""The chaos campaign's zombie check (:func:`bench.chaos_evidence.zombies`): a command's
line counts against the worker that held its run when it was written."""

from __future__ import annotations

from bench.chaos_evidence import Life, Line, Mark, zombies

HOST = "chaos-b"
RUN = "r1"


def check(line: Line, lives: list[Life]) -> list[str]:
    timeline = {RUN: [Mark(100.0, "claim", RUN, host=HOST)]}
    return [v.invariant for v in zombies([line], {(2, 10): RUN}, timeline, lives)]


def test_a_line_orphaned_as_its_holder_was_killed_is_the_holders() -> None:
    """Its box was orphaned for the few ms it outlives its killed worker: not a zombie."""
    lives = [Life(HOST, 7, 90.0, ended=104.7)]
    assert check(Line(2, 10, 4, 104.6, HOST, 1), lives) == []


def test_a_line_orphaned_while_its_holder_lives_is_a_zombie() -> None:
    """An orphaned box (its worker gone) ran a command while another worker held the run."""
    lives = [Life(HOST, 6, 50.0, ended=95.0), Life(HOST, 7, 96.0)]
    assert check(Line(2, 10, 4, 104.6, HOST, 1), lives) == ["zombie"]


def test_a_line_of_another_worker_than_the_holder_is_a_zombie() -> None:
    lives = [Life(HOST, 7, 96.0), Life(HOST, 8, 50.0)]  # the claim's is the first alive
    assert check(Line(2, 10, 4, 104.6, HOST, 8), lives) == ["zombie"]
    assert check(Line(2, 10, 4, 104.6, HOST, 7), lives) == []
