"""The chaos campaign in its short mode (``python -m bench.chaos --short``), and its evidence
checks on hand-made evidence.

The campaign runs a real deployment over simulated machines (network namespaces, libfaketime)
with every fault kind once and checks the invariants from the journal, the model's log and
Redis; it skips, saying why, where namespaces are not allowed or faketime is missing. Its
workers sandbox commands as a deployment's do by default (``--sandbox auto``: bubblewrap)
where the sandbox works here, else run them unconfined (``--sandbox none``). The
other tests feed :mod:`bench.chaos_evidence` evidence with one known flaw each: a check that
cannot see a flaw would let the campaign pass with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from bench import chaos_evidence as ev
from bench.chaos_deploy import unavailable
from bench.hosts import HostSpec, faketime_library, faketime_reason, host_env
from swarm.agent import sandbox

ROOT = Path(__file__).resolve().parents[2]


def test_the_append_only_file_parser_reads_claims_settlements_and_skips_a_torn_tail() -> None:
    def resp(*args: bytes) -> bytes:
        return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)

    data = (resp(b"MULTI")
            + resp(b"HSET", b"swarm:run:r1", b"state", b"running", b"lease", b"tok1",
                   b"lease_until", b"105.5", b"running_since", b"100.5", b"used", b"0")
            + resp(b"HSET", b"swarm:agent:a1", b"state", b"running", b"host", b"h1")
            + resp(b"EXEC")
            + resp(b"HSET", b"swarm:run:r1", b"lease_until", b"108.0")
            + resp(b"MULTI")
            + resp(b"HSET", b"swarm:run:r1", b"state", b"done", b"result", b"{}",
                   b"settled", b"1", b"lease", b"")
            + resp(b"XADD", b"swarm:stream:settle", b"MAXLEN", b"~", b"100", b"109000-0",
                   b"run", b"r1")
            + resp(b"EXEC")
            + resp(b"HSET", b"swarm:run:r1", b"state")[:-3])  # killed mid-write
    marks = ev.fill_times(ev.marks(ev.resp_commands(data), lease=5))
    assert [(m.kind, m.time, m.token, m.host, m.state) for m in marks] == [
        ("claim", 100.5, "tok1", "h1", ""), ("renew", 103.0, "", "", ""),
        ("settle", 109.0, "", "", "done")]


def _timeline() -> dict[str, list[ev.Mark]]:
    return {"r1": [ev.Mark(100.0, "claim", "r1", "t1", "h1"),
                   ev.Mark(110.0, "claim", "r1", "t2", "h2"),
                   ev.Mark(120.0, "settle", "r1", state="done")]}


LIVES = [ev.Life("h1", 11, 0.0, 104.0), ev.Life("h2", 22, 0.0), ev.Life("h1", 33, 105.0)]


def test_a_journal_line_after_its_attempt_lost_the_run_is_a_zombie() -> None:
    ok = [ev.Line(0, 0, 0, 103.0, "h1", 11), ev.Line(0, 0, 1, 115.0, "h2", 22)]
    assert ev.zombies(ok, {(0, 0): "r1"}, _timeline(), LIVES) == []
    late = ev.Line(0, 0, 0, 111.0, "h1", 11)  # an orphan of the killed worker, after the takeover
    after = ev.Line(0, 0, 1, 121.0, "h2", 22)  # after the settlement
    found = ev.zombies([*ok, late, after], {(0, 0): "r1"}, _timeline(), LIVES)
    assert len(found) == 2
    assert str(late) in found[0].text and "held by ('h2', 22)" in found[0].text
    assert str(after) in found[1].text and "settled" in found[1].text
    # same host, another process: the restarted worker held it, not the dead one
    timeline = {"r1": [ev.Mark(100.0, "claim", "r1", "t1", "h1"),
                       ev.Mark(107.0, "claim", "r1", "t3", "h1")]}
    orphan = ev.Line(0, 0, 0, 108.0, "h1", 11)
    assert len(ev.zombies([orphan], {(0, 0): "r1"}, timeline, LIVES)) == 1


def test_a_run_settled_twice_or_never_is_a_violation() -> None:
    timeline = _timeline()
    timeline["r2"] = [*timeline["r1"], ev.Mark(121.0, "settle", "r2", state="done")]
    events = Counter({"a1": 1, "a2": 1})
    found = ev.settled_once(timeline, ["r1", "r2", "r3"], events, {"r1": "a1", "r2": "a2"})
    assert [v.run for v in found] == ["r2", "r3", "r3"]


def test_results_out_of_order_or_twice_are_violations() -> None:
    def request(*answers: str) -> dict[str, object]:
        return {"messages": [{"role": "assistant", "tool_calls": [{"id": "c0"}]},
                             *({"role": "tool", "content": json.dumps({"answer": a})}
                               for a in answers)]}

    assert ev.results_in_order([request("x", "y")], ["x", "y"], "p") == []
    assert len(ev.results_in_order([request("y", "x")], ["x", "y"], "p")) == 1
    assert len(ev.results_in_order([request("x", "x")], ["x", "y"], "p")) == 1
    assert len(ev.results_in_order([], ["x"], "p")) == 1


def test_a_session_with_an_unanswered_or_stray_tool_call_is_a_violation() -> None:
    good = [{"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [{"id": "1"}, {"id": "2"}]},
            {"role": "tool", "tool_call_id": "1"}, {"role": "tool", "tool_call_id": "2"},
            {"role": "assistant", "content": "done"}]
    assert ev.paired("a", json.dumps(good)) == []
    assert len(ev.paired("a", json.dumps(good[:3] + good[4:]))) == 1
    assert len(ev.paired("a", json.dumps([*good, {"role": "tool", "tool_call_id": "9"}]))) == 1
    assert len(ev.paired("a", None)) == 1


@pytest.mark.skipif(not faketime_library(), reason="libfaketime is not installed "
                    "(apt-get install faketime)")
def test_a_host_with_its_clock_ahead_runs_python_that_sleeps_and_waits() -> None:
    """The skewed host of the campaign: its Python processes sleep, wait with timeouts and
    run commands, with the wall clock (theirs and their commands') 30 s ahead and the
    monotonic clock left alone (libfaketime 0.9.10 failed ``time.sleep`` with EINVAL)."""
    probe = ("import queue, subprocess, threading, time; t = time.monotonic(); "
             "time.sleep(0.2); threading.Event().wait(0.05); q = queue.Queue()\n"
             "try: q.get(timeout=0.05)\nexcept queue.Empty: pass\n"
             "date = subprocess.run(['date', '+%s'], capture_output=True, text=True).stdout\n"
             "print(time.time(), date.strip(), time.monotonic() - t)")
    env = host_env(HostSpec("probe", clock_ahead=30.0), os.environ)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    wall, date, slept = (float(x) for x in done.stdout.split())
    now = time.time()
    assert 25 < wall - now < 35 and 25 < date - now < 35
    assert 0.29 < slept < 5
    assert faketime_reason(30.0) == ""


REASON = unavailable()


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(bool(REASON), reason=f"chaos campaign cannot run here: {REASON}")
def test_short_chaos_campaign_holds_every_invariant(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    out = tmp_path / "chaos.json"
    mode = "auto" if sandbox.choose("auto", worker=True).box is not None else "none"
    done = subprocess.run([sys.executable, "-m", "bench.chaos", "--short", "--sandbox", mode,
                           "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
                          check=False)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["violations"] == []
    assert result["sandbox"] == mode
    injected = {row[0]: int(row[1]) for row in result["rows"]}
    kinds = ["worker kill", "coordinator kill", "Redis kill", "partition", "model 429/500"]
    if not result["no_clock_ahead"]:  # libfaketime that Python's sleeps and waits survive
        kinds.append("clock ahead")
    for kind in kinds:
        assert injected.get(kind, 0) >= 1, (kind, result["rows"])
    assert "verdict (seed 17): HELD" in done.stdout
