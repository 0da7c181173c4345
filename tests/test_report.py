"""`swarm report`: the self-contained HTML page, checked as text, in a real headless
Chromium, and against a real small swarm (coordinator, worker, scripted model)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py
from click.testing import CliRunner

from swarm.cli import main
from swarm.report.display import Prices
from swarm.report.html import render_html
from swarm.report.view import SwarmReader
from swarm.store.ledger import Ledger
from swarm.store.mailbox import Mailbox
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import round_trips
from tests.test_watch import cli, put_agent, put_swarm, small_swarm, usage

CHROMIUM = "/usr/bin/chromium"
ROW_ID = re.compile(r'<div class=row id="agent-([^"]+)"')


def big_swarm(r: redis_py.Redis, swarm_id: str = "sbig000000001", n: int = 500) -> list[str]:
    """A root, 19 parents and their children: ``n`` agents over the last two minutes, some
    failed, some running."""
    t0 = time.time() - 120
    put_swarm(r, swarm_id, task="BIG <job> & more", state="running", created=t0)
    put_agent(r, swarm_id, swarm_id, state="parked", label="BIG root", session="sess-big",
              created=t0)
    ids = [swarm_id]
    parents = []
    for i in range(1, n):
        parent = parents[i % len(parents)] if i > 19 else swarm_id
        agent_id = f"a{i:015x}"
        state = "failed" if i % 97 == 0 else "running" if i % 13 == 0 else "done"
        put_agent(r, swarm_id, agent_id, parent=parent, depth=1 if i <= 19 else 2,
                  state=state, label=f"part {i} of the job <script>alert({i})</script>",
                  created=t0 + i * 0.2,
                  settled=min(t0 + i * 0.2 + 5 + i * 7 % 40, t0 + 119)
                  if state != "running" else None,
                  usage=usage(100 + i), result={"error": f"boom {i} <b>"} if state == "failed"
                  else {"answer": f"result {i}"} if state == "done" else None)
        ids.append(agent_id)
        if i <= 19:
            parents.append(agent_id)
    return ids


@pytest.mark.parametrize("n", [5, 500])
def test_reader_reads_a_swarm_in_three_round_trips(redis: redis_py.Redis,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   n: int) -> None:
    big_swarm(redis, n=n)
    trips = round_trips(monkeypatch)
    view = SwarmReader(redis).load("sbig000000001")
    assert view is not None and len(view.agents) == n
    assert len(trips) == 3, trips


def test_html_has_every_agent_failures_first_and_nothing_external(
        redis: redis_py.Redis) -> None:
    ids = big_swarm(redis)
    view = SwarmReader(redis).load("sbig000000001")
    assert view is not None
    page = render_html(view, Prices(0.5, None))
    assert ROW_ID.findall(page) == [a.id for a in view.agents]
    assert sorted(ROW_ID.findall(page)) == sorted(ids)
    assert page.index("Failures (5)") < page.index("<h2>Timeline")
    failures = page[page.index("Failures (5)"):page.index("<h2>Timeline")]
    assert re.findall(r'href="#agent-([^"]+)"', failures) == [
        f"a{i:015x}" for i in (97, 194, 291, 388, 485)]
    assert "boom 97 &lt;b&gt;" in failures
    # Labels and results are escaped; nothing is fetched from anywhere.
    assert "<script>alert" not in page and "&lt;script&gt;alert(5)" in page
    assert "BIG &lt;job&gt; &amp; more" in page
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page) and "<link" not in page
    assert page.count("<script>") == 1
    # Hover text: the task and the result or error.
    bar = re.search(f'id="agent-a{97:015x}".*?class="bar[^"]*" style="[^"]*" '
                    'title="([^"]*)"', page, re.S)
    assert bar is not None
    assert "task: part 97 of the job" in bar.group(1) and "error: boom 97" in bar.group(1)
    assert "~$" in page  # an input price alone gives a cost
    assert page.count('class="bar open"') == sum(1 for a in view.agents
                                                 if a.state in ("running", "parked"))
    assert len(page) < 1_500_000


def test_report_command_writes_a_file_or_stdout(redis: redis_py.Redis, redis_server: str,
                                                tmp_path: Path) -> None:
    swarm_id = small_swarm(redis, settled=True)
    target = tmp_path / "r.html"
    out = cli(redis_server, "report", "-o", str(target))
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith(f"wrote {target} (5 agents, 2 failed)")
    page = target.read_text()
    assert len(ROW_ID.findall(page)) == 5
    assert "result: ROOT-ANSWER all done" in page  # the root's answer, from its session
    piped = cli(redis_server, "report", swarm_id, "-o", "-")
    assert piped.exit_code == 0 and piped.stdout.startswith("<!DOCTYPE html>")
    bad = cli(redis_server, "report", "-o", str(tmp_path / "missing" / "r.html"))
    assert bad.exit_code == 1 and "cannot write the report" in bad.output


def test_report_goes_under_swarm_home_by_default_not_in_the_current_folder(
        redis: redis_py.Redis, redis_server: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In the current folder, the next `swarm demo` counted the report as a project file."""
    swarm_id = small_swarm(redis, settled=True)
    here = tmp_path / "project"
    here.mkdir()
    monkeypatch.chdir(here)
    home = tmp_path / "home"
    out = cli(redis_server, "report", swarm_id, SWARM_HOME=str(home))
    assert out.exit_code == 0, out.output
    target = home / "reports" / f"{swarm_id}.html"
    assert out.stdout.startswith(f"wrote {target} (5 agents, 2 failed)"), out.stdout
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert list(here.iterdir()) == []


def chromium_dom(page: Path, tmp_path: Path, screenshot: Path | None = None) -> str:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install chromium` to check the report "
                    "in a real browser")
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}"]
    if screenshot is not None:
        subprocess.run([*base, f"--screenshot={screenshot}", "--window-size=1400,900",
                        f"file://{page}"], capture_output=True, timeout=60, check=False)
    done = subprocess.run([*base, "--dump-dom", f"file://{page}"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_report_in_headless_chromium(redis: redis_py.Redis, tmp_path: Path) -> None:
    ids = big_swarm(redis)
    view = SwarmReader(redis).load("sbig000000001")
    assert view is not None
    page = tmp_path / "report.html"
    page.write_text(render_html(view, Prices()))
    shot = Path(os.environ.get("SWARM_REPORT_SCREENSHOT", tmp_path / "report.png"))
    dom = chromium_dom(page, tmp_path, shot)
    assert 'data-ready="500"' in dom  # the script ran without an error and saw every row
    assert "500 of 500 agents shown" in dom
    timeline = dom[dom.index('class="gantt"'):]
    assert sorted(re.findall(r'id="agent-([^"]+)"', timeline)) == sorted(ids)
    assert shot.stat().st_size > 10_000


# -- against a real swarm ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("report-home")
    with local_swarm(home, concurrency=8) as url:
        yield url, home


@pytest.mark.slow
def test_status_logs_and_report_of_a_real_swarm(cluster: tuple[str, Path],
                                                tmp_path: Path) -> None:
    url, home = cluster
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def summarise(request: dict[str, Any]) -> Reply:
        return Reply(content=" | ".join(
            json.loads(t)["state"] for t in tool_results(request)))

    responder = ByTask({
        "WATCHED-ROOT": [Reply(tool_calls=[
            ToolCall("agent", {"message": "WATCHED-KID one"}, id="k1"),
            ToolCall("agent", {"message": "WATCHED-KID two"}, id="k2"),
            ToolCall("agent", {"message": "WATCHED-BAD three", "output_schema": schema},
                     id="k3")]), summarise],
        "WATCHED-KID": [Reply(tool_calls=[ToolCall("run_cli", {"command": "seq 40"})]),
                        Reply(content="kid finished")],
        "WATCHED-BAD": [Reply(content="not json")],
    })
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    with ScriptedModelServer(responder=responder) as model:
        env.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url, SWARM_HOME=str(home),
                   SWARM_RETRIES="1")
        run = CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C", str(tmp_path),
                                        "WATCHED-ROOT go"], env=env, catch_exceptions=False)
    assert run.exit_code == 0, run.stderr
    assert run.stdout.strip() == "done | done | failed"
    # Not a terminal: the progress went to stderr as plain lines.
    assert re.search(r"^\[a[0-9a-f]{15}\] done$", run.stderr, re.M), run.stderr

    status = CliRunner().invoke(main, ["status", "--json"], env=env)
    assert status.exit_code == 0, status.output
    data = json.loads(status.stdout)
    agents = data["agents"]
    swarm_id = data["swarm"]["id"]
    assert data["swarm"]["state"] == "done" and agents[0]["id"] == swarm_id
    assert [a["depth"] for a in agents] == [0, 1, 1, 1]
    assert [a["parent"] for a in agents] == [None, swarm_id, swarm_id, swarm_id]
    by_label = {a["label"]: a for a in agents[1:]}
    bad = by_label["WATCHED-BAD three"]
    assert bad["state"] == "failed" and "did not match output_schema" in bad["error"]
    kid = by_label["WATCHED-KID one"]
    assert kid["state"] == "done" and kid["answer"] == "kid finished"
    assert kid["usage"]["total_tokens"] > 0 and kid["turns"] >= 2
    assert kid["last"] == "run_cli: seq 40"
    assert 0 < kid["elapsed"] < 60 and kid["settled"] >= kid["created"]
    assert agents[0]["usage"]["total_tokens"] > 0  # the root's, from its session
    assert data["totals"]["states"] == {"done": 3, "failed": 1}

    plain = CliRunner().invoke(main, ["status"], env=env).stdout
    assert plain.splitlines()[3] == "failures (1):" and bad["id"] in plain.splitlines()[4]

    logs = CliRunner().invoke(main, ["logs", kid["id"]], env=env)
    assert logs.exit_code == 0, logs.output
    assert "$ seq 40" in logs.stdout and "  1\n" in logs.stdout and "  40" in logs.stdout
    assert "lines cut (--full shows them)" in logs.stdout
    assert logs.stdout.rstrip().endswith("== answer\nkid finished")
    root_logs = CliRunner().invoke(main, ["logs", swarm_id], env=env).stdout
    assert "> agent: WATCHED-KID one" in root_logs
    assert root_logs.rstrip().endswith("== answer\ndone | done | failed")

    target = tmp_path / "report.html"
    report = CliRunner().invoke(main, ["report", "-o", str(target)], env=env)
    assert report.exit_code == 0, report.output
    page = target.read_text()
    assert ROW_ID.findall(page) == [a["id"] for a in agents]
    assert "Failures (1)" in page and "result: kid finished" in page
    if shutil.which(CHROMIUM):
        dom = chromium_dom(target, tmp_path)
        assert all(f'id="agent-{a["id"]}"' in dom for a in agents)


def test_the_report_shows_the_messages_people_sent_its_agents(redis: redis_py.Redis) -> None:
    swarm_id = small_swarm(redis)
    kid = next(a.id for a in Ledger(redis).agents(swarm_id) if a.state == "running")
    Mailbox(redis, kid).send("<i>use</i> the PAPAYA folder")
    snapshot = SwarmReader(redis).load(swarm_id, root_answer=True)
    assert snapshot is not None
    page = render_html(snapshot, Prices(None, None))
    assert "Messages sent to agents (1)" in page
    section = page[page.index("Messages sent to agents"):page.index("<h2>Timeline")]
    assert f"#agent-{kid}" in section
    assert "&lt;i&gt;use&lt;/i&gt; the PAPAYA folder" in section and "<i>use" not in page
    assert "told: &lt;i&gt;use" in page  # in its bar's hover text too
