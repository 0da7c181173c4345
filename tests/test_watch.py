"""Watching a swarm: the tree, `swarm status` / `top` / `logs`, and the live view, from a
ledger written by hand into the real test Redis."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import redis as redis_py
from click.testing import CliRunner, Result
from rich.console import Console

from swarm.cli import main
from swarm.cli.live import LiveTree
from swarm.cli.render import TerminalView
from swarm.report.display import Prices
from swarm.report.view import AgentView, SwarmReader, build_tree, visible_rows
from swarm.store import keys
from tests.helpers import wait_until

T0 = 1_700_000_000.0


# -- a ledger written by hand ------------------------------------------------------------------

def put_swarm(r: redis_py.Redis, swarm_id: str, *, state: str = "running",
              task: str = "ROOT do the big job", created: float = T0,
              settled: float | None = None) -> None:
    r.hset(keys.swarm(swarm_id), mapping={
        "id": swarm_id, "root": swarm_id, "workspace": "/tmp/ws", "task": task,
        "settings": json.dumps({"max_depth": 3}), "created": created, "state": state,
        **({"settled": settled} if settled else {})})
    r.zadd(keys.swarms_index(), {swarm_id: created})


def put_agent(r: redis_py.Redis, swarm_id: str, agent_id: str, *, parent: str = "",
              state: str = "done", label: str = "", created: float = T0,
              settled: float | None = None, usage: dict[str, int] | None = None,
              last: str = "", turns: int = 0, result: dict[str, Any] | None = None,
              message: str = "", depth: int | None = None,
              session: str = "") -> None:
    run = "r" + agent_id[1:] if parent else ""
    record: dict[str, Any] = {
        "id": agent_id, "swarm": swarm_id, "parent": parent,
        "depth": depth if depth is not None else (0 if not parent else 1),
        "kind": "child" if parent else "root", "state": state, "label": label or agent_id,
        "created": created, "host": "h", "workspace": f"/tmp/ws/{agent_id}"}
    for name, value in (("settled", settled), ("last", last), ("turns", turns),
                        ("session", session), ("run", run)):
        if value:
            record[name] = value
    if usage is not None:
        record["usage"] = json.dumps(usage)
    r.hset(keys.agent(agent_id), mapping=record)
    r.zadd(keys.swarm_agents(swarm_id), {agent_id: created})
    if run:
        r.hset(keys.run(run), mapping={
            "agent": agent_id, "message": message or label, "state": state,
            "result": json.dumps(result) if result else ""})


def put_session(r: redis_py.Redis, session_id: str, messages: list[dict[str, Any]],
                usage: dict[str, int] | None = None, turns: int = 0) -> None:
    meta = {"id": session_id, "workspace": "/tmp/ws", "created": T0, "updated": T0,
            "usage": usage or {}, "turns": turns, "parked": ""}
    r.hset(keys.session(session_id), mapping={"meta": json.dumps(meta),
                                              "messages": json.dumps(messages)})


def usage(total: int) -> dict[str, int]:
    return {"prompt_tokens": total * 3 // 4, "completion_tokens": total - total * 3 // 4,
            "total_tokens": total}


def small_swarm(r: redis_py.Redis, swarm_id: str = "s0000000000a1", settled: bool = False) -> str:
    """A root with four children: done, failed, running (with a grandchild queued)."""
    put_swarm(r, swarm_id, state="done" if settled else "running",
              settled=T0 + 30 if settled else None)
    put_agent(r, swarm_id, swarm_id, state="done" if settled else "parked",
              label="ROOT do the big job", session="sess-root",
              settled=T0 + 30 if settled else None)
    put_session(r, "sess-root", [
        {"role": "system", "content": "SYSTEM PROMPT"},
        {"role": "user", "content": "ROOT do the big job"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function",
             "function": {"name": "agent", "arguments": json.dumps({"message": "KID one"})}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "{\"state\": \"done\"}"},
        {"role": "assistant", "content": "ROOT-ANSWER all done"}], usage=usage(1000), turns=2)
    put_agent(r, swarm_id, "a000000000000001", parent=swarm_id, label="KID one",
              created=T0 + 1, settled=T0 + 5, usage=usage(2000), turns=2,
              result={"answer": "one is fine"})
    put_agent(r, swarm_id, "a000000000000002", parent=swarm_id, label="KID two breaks",
              state="failed", created=T0 + 1, settled=T0 + 9, usage=usage(500),
              result={"error": "ModelError: the endpoint said 500\nsecond line"})
    put_agent(r, swarm_id, "a000000000000003", parent=swarm_id, label="KID three works",
              state="done" if settled else "running", created=T0 + 2,
              settled=T0 + 20 if settled else None, last="run_cli: pytest -x tests/")
    put_session(r, "a000000000000003", [], usage=usage(300), turns=4)
    put_agent(r, swarm_id, "a000000000000004", parent="a000000000000003", depth=2,
              label="GRANDKID waits", state="cancelled" if settled else "queued",
              created=T0 + 3, settled=T0 + 20 if settled else None)
    return swarm_id


def cli(redis_server: str, *args: str, **env: str) -> Result:
    base = {"SWARM_REDIS_URL": redis_server, "SWARM_PRICE_INPUT": "", "SWARM_PRICE_OUTPUT": ""}
    return CliRunner().invoke(main, list(args), env={**base, **env})


# -- the tree ----------------------------------------------------------------------------------

def view(agent_id: str, parent: str = "", created: float = 0.0, state: str = "done") -> AgentView:
    return AgentView(id=agent_id, parent=parent, created=created, state=state)


def test_tree_puts_children_under_parents_in_creation_order() -> None:
    agents = [view("c2", "r", 3), view("g1", "c1", 4), view("r", "", 0), view("c1", "r", 1),
              view("orphan", "gone", 2)]
    tree = build_tree(agents)
    assert [(a.id, a.level) for a in tree] == [
        ("r", 0), ("c1", 1), ("g1", 2), ("c2", 1), ("orphan", 0)]
    assert [c.id for c in tree[0].children] == ["c1", "c2"]


def test_visible_rows_keep_the_working_and_failed_and_fold_the_rest() -> None:
    agents = [view("r", state="parked")]
    agents += [view(f"d{i:03d}", "r", i) for i in range(100)]
    agents += [view("run1", "r", 200, "running"), view("bad1", "r", 201, "failed")]
    rows = visible_rows(build_tree(agents), 10)
    shown = [r.agent.id for r in rows if r.agent is not None]
    assert shown == ["r", "run1", "bad1"]
    notes = [r.note for r in rows if r.agent is None]
    assert notes == ["... 100 more: 100 done"]
    # Everything shows when it fits.
    assert len(visible_rows(build_tree(agents[:5]), 10)) == 5
    # A cap smaller than the working set still holds, with a note at the end.
    many = [view("r", state="parked"), *(view(f"w{i}", "r", i, "running") for i in range(50))]
    capped = visible_rows(build_tree(many), 8)
    assert len(capped) == 8 and capped[-1].agent is None and "44 more agents" in capped[-1].note


def test_snapshot_reads_usage_errors_and_cost(redis: redis_py.Redis) -> None:
    swarm_id = small_swarm(redis)
    snap = SwarmReader(redis).load(swarm_id, root_answer=True)
    assert snap is not None
    by_id = {a.id: a for a in snap.agents}
    assert [a.id for a in snap.agents] == [swarm_id, "a000000000000001", "a000000000000002",
                                           "a000000000000003", "a000000000000004"]
    root = by_id[swarm_id]
    assert root.tokens == 1000 and root.turns == 2  # from its session (key in `session`)
    assert root.task == "ROOT do the big job" and root.answer == ""  # not settled yet
    assert by_id["a000000000000003"].tokens == 300  # live count from the running session
    assert by_id["a000000000000003"].turns == 4
    assert by_id["a000000000000002"].error.startswith("ModelError: the endpoint said 500")
    assert by_id["a000000000000001"].answer == "one is fine"
    assert by_id["a000000000000004"].level == 2
    assert snap.counts() == {"parked": 1, "done": 1, "failed": 1, "running": 1, "queued": 1}
    assert snap.usage()["total_tokens"] == 3800
    assert snap.summary(Prices()).startswith(
        f"swarm {swarm_id} running · 5 agents: 1 running, 1 parked, 1 queued, 1 failed, 1 done"
        " · 3.8k tokens · ")
    priced = Prices.from_env({"SWARM_PRICE_INPUT": "2", "SWARM_PRICE_OUTPUT": "10"})
    cost = priced.cost(snap.usage())
    assert cost == pytest.approx((2850 * 2 + 950 * 10) / 1e6)
    assert "~$0.0152" in snap.summary(priced)
    with pytest.raises(ValueError, match="SWARM_PRICE_OUTPUT='cheap' is not a price"):
        Prices.from_env({"SWARM_PRICE_OUTPUT": "cheap"})


def test_a_model_priced_by_name_costs_its_own_price_and_others_the_default() -> None:
    prices = Prices.from_env({"SWARM_PRICE_INPUT": "2", "SWARM_PRICE_OUTPUT": "10",
                              "SWARM_PRICES": "small=0.1/0.4, org/big:v2=5/20"})
    usage = {"prompt_tokens": 1000, "completion_tokens": 100}
    assert prices.cost(usage, "small") == pytest.approx((1000 * 0.1 + 100 * 0.4) / 1e6)
    assert prices.cost(usage, "org/big:v2") == pytest.approx((1000 * 5 + 100 * 20) / 1e6)
    assert prices.cost(usage, "other") == pytest.approx((1000 * 2 + 100 * 10) / 1e6)
    only_named = Prices.from_env({"SWARM_PRICES": "small=0.1/0.4"})
    assert only_named.configured and only_named.cost(usage, "other") is None
    for bad in ("small", "small=0.1", "=1/2", "small=x/1"):
        with pytest.raises(ValueError, match="SWARM_PRICES"):
            Prices.from_env({"SWARM_PRICES": bad})


def test_reader_reads_a_settled_run_once(redis: redis_py.Redis) -> None:
    swarm_id = small_swarm(redis)
    reader = SwarmReader(redis)
    reader.load(swarm_id)
    redis.delete(keys.run("r000000000000002"))  # settled runs never change: not read again
    snap = reader.load(swarm_id)
    assert snap is not None
    failed = next(a for a in snap.agents if a.state == "failed")
    assert failed.error.startswith("ModelError")


# -- swarm status ------------------------------------------------------------------------------

def test_status_lists_failures_first_then_the_tree(redis: redis_py.Redis,
                                                   redis_server: str) -> None:
    swarm_id = small_swarm(redis)
    out = cli(redis_server, "status")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"swarm {swarm_id} running · 5 agents")
    assert lines[3] == "failures (1):"
    assert "a000000000000002  failed  KID two breaks: ModelError: the endpoint said 500" in (
        lines[4])
    tree = lines[lines.index("agents:") + 1:]
    assert len(tree) == 5
    assert tree[0].startswith("parked    d0") and f"tok  {swarm_id}  ROOT" in tree[0]
    assert tree[3].startswith("running   d1") and "pytest -x tests/" in tree[3]
    assert "4 turns" in tree[3] and "300 tok    a000000000000003  KID three" in tree[3]
    assert tree[4].startswith("queued    d2") and "tok      a000000000000004  GRANDKID" in (
        tree[4])


def test_status_json_has_every_agent_for_scripts(redis: redis_py.Redis,
                                                 redis_server: str) -> None:
    swarm_id = small_swarm(redis, settled=True)
    out = cli(redis_server, "status", "--json", swarm_id, SWARM_PRICE_INPUT="1")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["swarm"]["id"] == swarm_id and data["swarm"]["settings"] == {"max_depth": 3}
    assert data["totals"]["agents"] == 5 and data["totals"]["wall"] == 30.0
    assert data["totals"]["cost"] == pytest.approx(2850 / 1e6)
    agents = {a["id"]: a for a in data["agents"]}
    failed = agents["a000000000000002"]
    assert failed["parent"] == swarm_id and failed["depth"] == 1 and failed["state"] == "failed"
    assert failed["usage"] == usage(500)
    assert failed["created"] == T0 + 1 and failed["settled"] == T0 + 9
    assert failed["elapsed"] == 8.0
    assert failed["error"].startswith("ModelError")
    assert agents[swarm_id]["parent"] is None and agents[swarm_id]["session"] == "sess-root"
    assert agents["a000000000000004"]["depth"] == 2
    assert set(failed) >= {"id", "parent", "state", "depth", "usage", "created", "settled",
                           "elapsed", "turns", "error", "answer", "label", "last"}


def test_status_errors_are_clear(redis: redis_py.Redis, redis_server: str) -> None:
    out = cli(redis_server, "status")
    assert out.exit_code == 1 and "no swarm yet" in out.output
    small_swarm(redis)
    out = cli(redis_server, "status", "snope")
    assert out.exit_code == 1 and "no swarm 'snope'" in out.output
    out = cli(redis_server, "status", SWARM_PRICE_INPUT="lots")
    assert out.exit_code == 1 and "SWARM_PRICE_INPUT='lots' is not a price" in out.output
    assert "Traceback" not in out.output


# -- swarm logs --------------------------------------------------------------------------------

def test_logs_prints_commands_outputs_and_answer(redis: redis_py.Redis,
                                                 redis_server: str) -> None:
    swarm_id = small_swarm(redis)
    output = "\n".join(f"line {i}" for i in range(100))
    put_session(redis, "a000000000000001", [
        {"role": "system", "content": "SYSTEM PROMPT"},
        {"role": "user", "content": "KID one: count the lines"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "hmm, wc",
         "tool_calls": [{"id": "t1", "type": "function", "function": {
             "name": "run_cli", "arguments": json.dumps({"command": "seq 100 | wc -l"})}}]},
        {"role": "tool", "tool_call_id": "t1", "content": output},
        {"role": "assistant", "content": "there are 100 lines"}])
    out = cli(redis_server, "logs", "a000000000000001")
    assert out.exit_code == 0, out.output
    text = out.stdout
    assert text.startswith(f"agent a000000000000001  child  done  depth 1  swarm {swarm_id}")
    assert "SYSTEM PROMPT" not in text
    assert "== user\nKID one: count the lines" in text
    assert "-- thinking\nhmm, wc" in text and "-- said\nlet me look" in text
    assert "$ seq 100 | wc -l" in text
    assert "  line 9\n" in text and "  line 50\n" not in text and "  line 99" in text
    assert "85 lines cut (--full shows them)" in text
    assert text.rstrip().endswith("== answer\nthere are 100 lines")
    full = cli(redis_server, "logs", "--full", "a000000000000001").stdout
    assert "SYSTEM PROMPT" in full and "  line 50\n" in full
    # A swarm id shows its root, whose session is keyed by its workspace.
    root = cli(redis_server, "logs", swarm_id)
    assert root.exit_code == 0 and "> agent: KID one" in root.stdout
    assert "== answer\nROOT-ANSWER all done" in root.stdout
    # A failed child: its error comes last, even without a conversation.
    failed = cli(redis_server, "logs", "a000000000000002")
    assert "(no conversation stored" in failed.stdout
    assert failed.stdout.rstrip().endswith("== error\nModelError: the endpoint said 500\n"
                                           "second line")
    # Prefixes: unique works, ambiguous says so.
    assert "ROOT-ANSWER" in cli(redis_server, "logs", swarm_id[:-2]).stdout
    ambiguous = cli(redis_server, "logs", "a00000")
    assert ambiguous.exit_code == 1 and "matches 4 agents" in ambiguous.output
    missing = cli(redis_server, "logs", "zzz")
    assert missing.exit_code == 1 and "no agent 'zzz'" in missing.output


# -- the live view -----------------------------------------------------------------------------

def test_live_tree_falls_back_to_plain_lines_when_not_a_tty(redis: redis_py.Redis) -> None:
    swarm_id = small_swarm(redis)
    err = io.StringIO()
    live = TerminalView(err=err).swarm_view(redis, swarm_id)
    assert not live.enabled
    live.on_swarm_event({"kind": "queued", "agent": "a1", "parent": swarm_id, "depth": "1"})
    live.on_swarm_event({"kind": "tool", "agent": "a1", "text": "run_cli: ls"})
    live.on_swarm_event({"kind": "settled", "agent": "a1", "state": "done"})
    live.close()
    assert err.getvalue().splitlines() == [
        f"[a1] queued at depth 1 by {swarm_id}", "[a1] run_cli: ls", "[a1] done"]
    assert live.loads == 0  # plain lines never read the ledger
    # Built directly, a non-terminal console also means plain lines.
    out = io.StringIO()
    plain = LiveTree(redis, swarm_id, console=Console(file=out))
    plain.on_swarm_event({"kind": "settled", "agent": "a2", "state": "failed"})
    assert out.getvalue() == "[a2] failed\n" and not plain.enabled


def terminal(out: io.StringIO) -> Console:
    """A console that takes ``out`` for a terminal (rich draws the live view on it)."""
    return Console(file=out, force_terminal=True, width=160, height=30, color_system=None)


def draws(screen: str, swarm_id: str) -> int:
    """How many times the tree was drawn on ``screen`` (each draw starts with its summary)."""
    return screen.count(f"swarm {swarm_id} running · ")


def test_live_tree_on_a_terminal_reads_the_ledger_once_for_a_burst_of_events(
        redis: redis_py.Redis) -> None:
    swarm_id = small_swarm(redis)
    out = io.StringIO()
    # No tick of the view's own comes during the test: every read below is an event's doing.
    live = LiveTree(redis, swarm_id, console=terminal(out), prices=Prices(1.0, 2.0),
                    interval=3600)
    assert live.enabled
    for i in range(3000):  # a burst of events: no Redis round trip each
        live.on_swarm_event({"kind": "tool", "agent": "a000000000000003", "text": f"x {i}"})
    assert live.loads == 0 and draws(out.getvalue(), swarm_id) == 0
    live.on_swarm_event({"kind": "joined", "agent": swarm_id, "children": "4"})  # root wakes
    assert live.loads == 1  # the final tree: one read for the whole burst
    screen = out.getvalue()
    assert draws(screen, swarm_id) >= 1
    assert f"swarm {swarm_id} running · 5 agents" in screen and "~$" in screen
    assert "s00000000 ROOT do the big job" in screen and "a00000000 KID one" in screen
    assert "error: ModelError: the endpoint said 500" in screen
    assert "run_cli: pytest -x tests/" in screen and "GRANDKID waits" in screen
    # Paused: what the root prints next is not drawn over (a live display redraws itself
    # below everything printed while it runs).
    live.console.print("ROOT ANSWER")
    assert out.getvalue().endswith("ROOT ANSWER\n")
    live.close()


def test_live_tree_on_a_terminal_redraws_on_its_own_until_the_root_wakes(
        redis: redis_py.Redis) -> None:
    swarm_id = small_swarm(redis)
    out = io.StringIO()
    live = LiveTree(redis, swarm_id, console=terminal(out), interval=0.05)

    def doing(command: str) -> None:
        """The running child's last command, as its worker writes it to the ledger."""
        put_agent(redis, swarm_id, "a000000000000003", parent=swarm_id, state="running",
                  label="KID three works", created=T0 + 2, last=f"run_cli: {command}")

    def shown(text: str, after: str = "") -> bool:
        """Whether ``text`` was drawn (after the last ``after`` printed, if given)."""
        screen = out.getvalue()
        return text in (screen.rpartition(after)[2] if after else screen)

    # The first event starts the display; its own thread reads the ledger and draws.
    live.on_swarm_event({"kind": "tool", "agent": "a000000000000003", "text": "x"})
    wait_until(lambda: shown("GRANDKID waits"), "the first draw of the tree")
    doing("make CHANGED-ONE")  # a change, then its event: the next tick reads and draws it
    live.on_swarm_event({"kind": "tool", "agent": "a000000000000003", "text": "make"})
    wait_until(lambda: shown("run_cli: make CHANGED-ONE"), "the change an event announced")
    doing("make CHANGED-TWO")  # a change with no event: read within IDLE_RELOAD anyway
    wait_until(lambda: shown("run_cli: make CHANGED-TWO"), "a change no event announced")

    live.on_swarm_event({"kind": "joined", "agent": swarm_id, "children": "4"})  # root wakes
    live.console.print("ROOT ANSWER")  # paused: the root's own output is not drawn over
    assert out.getvalue().endswith("ROOT ANSWER\n")

    doing("make CHANGED-THREE")  # a new event restarts the display, below the root's output
    live.on_swarm_event({"kind": "tool", "agent": "a000000000000003", "text": "again"})
    wait_until(lambda: shown("run_cli: make CHANGED-THREE", after="ROOT ANSWER"),
               "the tree drawn again after a new event")
    live.close()
    live.close()  # idempotent
    live.console.print("THE END")  # closed: nothing draws over what comes next
    assert out.getvalue().endswith("THE END\n")


# -- swarm top ---------------------------------------------------------------------------------

def test_top_piped_prints_events_until_the_swarm_settles(redis: redis_py.Redis,
                                                         redis_server: str) -> None:
    swarm_id = small_swarm(redis, settled=True)
    for fields in ({"kind": "queued", "agent": "a000000000000001", "parent": swarm_id,
                    "depth": "1"},
                   {"kind": "tool", "agent": "a000000000000001", "text": "run_cli: ls"},
                   {"kind": "settled", "agent": "a000000000000001", "state": "done"}):
        redis.xadd(keys.events(swarm_id), fields)  # type: ignore[arg-type]
    out = cli(redis_server, "top")
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines() == [
        f"[a000000000000001] queued at depth 1 by {swarm_id}",
        "[a000000000000001] run_cli: ls", "[a000000000000001] done",
        f"swarm {swarm_id} done · 5 agents: 1 failed, 1 cancelled, 3 done · 3.8k tokens · "
        "30.0s wall"]


@pytest.mark.parametrize(("command", "first"), [
    ("status", "Show the agents of SWARM_ID"), ("top", "Watch SWARM_ID"),
    ("logs", "Print the conversation of AGENT_ID"), ("report", "Write SWARM_ID")])
def test_help(command: str, first: str) -> None:
    out = CliRunner().invoke(main, [command, "-h"])
    assert out.exit_code == 0 and first in out.stdout
