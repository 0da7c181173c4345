"""The page of ``swarm serve`` in a real headless browser (Playwright driving Debian's
Chromium): a real ``swarm serve`` process on a module's local swarm (embedded server,
coordinator, worker processes), jobs answered by the scripted model.

The fan-out test takes two screenshots (the live tree; an agent's panel). With
``SWARM_SCREENSHOTS=docs/img`` it writes them where the README shows them
(page-tree.png, page-agent.png); otherwise into its temporary folder, so a test run
leaves the repository as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarm.agent.loop import FROM_A_PERSON
from swarm.serve.auth import TokenStore
from swarm.store.connection import connect
from swarm.testing.cluster import local_swarm
from swarm.testing.responders import default_responder, message_text
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall
from tests.helpers import wait_until
from tests.test_serve_process import free_port

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parent.parent
ADMIN = "page-admin-token-7c21"

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium at "
                       "/usr/bin/chromium (apt-get install chromium; ./scripts/check does "
                       "on CI)"),
    pytest.mark.skipif(sync_playwright is None, reason="needs playwright (pip install -e "
                       "'.[dev]')"),
]


class Serve:
    """A real ``swarm serve`` process on the module's swarm; stop and start it again on
    the same port."""

    def __init__(self, url: str, home: Path, model: ScriptedModelServer) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
        # run_cli asks (jobs with approve=ask); the agent tool never does.
        self.env.update(SWARM_HOME=str(home), SWARM_REDIS_URL=url, SWARM_SERVE_TOKEN=ADMIN,
                        SWARM_BASE_URL=model.base_url, SWARM_MODEL=model.models[0],
                        SWARM_APPROVAL="run_cli=always,agent=never")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / f"serve-{self.port}.log"

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "swarm", "serve", "--port", str(self.port),
                 "--workers", "0", "--log-level", "warning"], env=self.env, cwd=ROOT,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        proc = self.proc

        def answers() -> bool:
            assert proc.poll() is None, f"swarm serve exited: {self.log.read_text()[-2000:]}"
            try:
                return httpx.get(f"{self.base}/v1/jobs?limit=1", timeout=2.0,
                                 headers={"Authorization": f"Bearer {ADMIN}"}).is_success
            except httpx.TransportError:
                return False

        wait_until(answers, "swarm serve to answer", timeout=60, every=0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def submit(self, task: str, token: str = ADMIN, approve: str = "all") -> str:
        got = httpx.post(f"{self.base}/v1/jobs", json={"task": task, "approve": approve},
                         headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert got.status_code == 201, got.text
        return str(got.json()["id"])

    def job(self, job: str) -> dict[str, Any]:
        got = httpx.get(f"{self.base}/v1/jobs/{job}", timeout=10,
                        headers={"Authorization": f"Bearer {ADMIN}"})
        return dict(got.json())


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("page-home")
    with local_swarm(home, concurrency=8) as url:
        yield url, home


@pytest.fixture(scope="module")
def model(swarm: tuple[str, Path]) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture(scope="module")
def serve(swarm: tuple[str, Path], model: ScriptedModelServer) -> Iterator[Serve]:
    server = Serve(swarm[0], swarm[1], model)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1500, "height": 900})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error"
           and "Content Security Policy" in m.text else None)
    try:
        yield tab
    finally:
        context.close()
    assert not errors, errors  # no script error, no CSP violation


def log_in(page: Page, serve: Serve, token: str = ADMIN, hash_: str = "") -> None:
    page.goto(f"{serve.base}/{hash_}")
    page.fill("#token", token)
    page.click("#login-form button")
    page.wait_for_selector("#login", state="hidden")


def wait_js(page: Page, expression: str, timeout: float = 30) -> Any:
    """Wait until ``expression`` is true in the page (``wait_for_function`` would build its
    predicate with eval, which the page's CSP refuses)."""
    return wait_until(lambda: page.evaluate(expression), expression, timeout=timeout,
                      every=0.05)


def row(page: Page, agent: str) -> str:
    return f'#tree tr[data-id="{agent}"]'


def children_of(serve: Serve, job: str) -> list[str]:
    return [a["id"] for a in serve.job(job)["agents"] if a["depth"] == 1]


# -- the tests ---------------------------------------------------------------------------------


def test_a_fan_out_appears_and_settles_live_and_an_agent_shows_its_work(
        page: Page, serve: Serve, swarm: tuple[str, Path], tmp_path: Path) -> None:
    shots = Path(os.environ.get("SWARM_SCREENSHOTS") or tmp_path)
    folder = swarm[1] / "jobs" / "fan-out"  # inside the jobs root: its files seed the children
    folder.mkdir(parents=True)
    (folder / "README.md").write_text("the children's work lands here\n")
    log_in(page, serve)
    # Submitted from the page, which then follows the job: the children appear as they
    # are queued and settle without the page being loaded again.
    page.fill("#task", 'fan out 3: `sleep 2; echo hello > "$(mktemp -p . out-XXXX)"; ls`')
    page.select_option("#approve", "all")
    page.fill("#workspace", "fan-out")
    page.click("#submit-form button[type=submit]")
    wait_js(page, "location.hash.startsWith('#/job/')")
    job = page.evaluate("location.hash").rsplit("/", 1)[1]
    page.evaluate("window.sameDocument = true")
    wait_js(page, "document.querySelectorAll('#tree tbody tr').length === 4")
    running = page.locator("#tree tbody .c-state", has_text="running")
    running.first.wait_for()  # seen at work, live
    assert "live" in page.inner_text("#conn")
    wait_js(page, "document.getElementById('summary').textContent.includes('4 agents') && "
                  "[...document.querySelectorAll('#tree .label')].every(l => l.textContent)")
    page.screenshot(path=str(shots / "page-tree.png"))
    wait_js(page,
        "[...document.querySelectorAll('#tree tbody .c-state')].every(c => "
        "c.textContent === 'done')", timeout=60)
    assert page.evaluate("window.sameDocument") is True  # never loaded again
    assert page.evaluate("window.swarmStats.events") > 0
    kids = children_of(serve, job)
    assert len(kids) == 3
    for kid in kids:
        assert page.inner_text(f"{row(page, kid)} .c-landing") == "landed"
        assert page.inner_text(f"{row(page, kid)} .c-depth") == "1"
    wait_js(page, "document.getElementById('conn').textContent === 'settled'")
    assert "done" in page.inner_text("#summary")
    assert page.inner_text("#failures") == ""
    # An agent's panel: its command and output, its result, the diff of its work.
    page.click(row(page, kids[0]))
    page.wait_for_selector("#p-diff .add")
    conversation = page.inner_text("#p-conv")
    assert '$ sleep 2; echo hello > "$(mktemp -p . out-XXXX)"; ls' in conversation
    assert "out-" in page.inner_text("#p-conv .out")
    assert '"state": "done"' in page.inner_text("#p-result")
    assert "+hello" in page.inner_text("#p-diff")
    assert "1 file changed" in page.inner_text("#p-stat")
    page.screenshot(path=str(shots / "page-agent.png"))


def test_an_approval_answered_on_the_page_runs_the_childs_command(
        page: Page, serve: Serve) -> None:
    job = serve.submit("fan out 1: `echo approved-by-page`", approve="ask")
    log_in(page, serve, hash_=f"#/job/{job}")
    approval = page.locator("#approvals .approval")
    approval.wait_for(timeout=60_000)
    assert "echo approved-by-page" in approval.inner_text()
    (kid,) = children_of(serve, job)
    assert approval.locator(".mono").inner_text() == kid
    approval.locator("button.answer-approve").click()
    page.wait_for_selector("#approvals .approval", state="detached")
    wait_js(page,
        f"document.querySelector('#tree tr[data-id=\"{kid}\"] .c-state')"
        ".textContent === 'done'", timeout=60)
    page.click(row(page, kid))
    wait_js(page,
        "document.querySelector('#p-conv .out') && "
        "document.querySelector('#p-conv .out').textContent.includes('approved-by-page')")
    assert serve.job(job)["state"] in ("running", "done")


def test_cancel_from_the_page_stops_the_agent_and_its_subtree(page: Page, serve: Serve) -> None:
    job = serve.submit("fan out 1: `sleep 120`")
    log_in(page, serve, hash_=f"#/job/{job}")
    kid = wait_until(lambda: children_of(serve, job), "the child", timeout=60)[0]
    wait_js(page,
        f"(document.querySelector('#tree tr[data-id=\"{kid}\"] .c-last') || {{}})"
        ".textContent.includes('sleep 120')", timeout=60)
    page.click(row(page, kid))
    page.click("#p-cancel")
    assert page.inner_text("#p-cancel-sure") == "Cancel 1 active agent now"
    page.click("#p-cancel-sure")
    wait_js(page,
        f"document.querySelector('#tree tr[data-id=\"{kid}\"] .c-state')"
        ".textContent === 'cancelled'", timeout=30)
    # Failures first, as in swarm status (from the next read of the snapshot).
    wait_js(page, f"document.getElementById('failures').textContent.includes('{kid}')")
    wait_until(lambda: serve.job(job)["state"] == "done", "the root to go on", timeout=60)


def test_a_command_printing_markup_shows_it_as_text_and_runs_no_script(
        page: Page, serve: Serve) -> None:
    markup = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2><b>bold</b>"
    job = serve.submit(f"<i>task</i> run `printf '%s\\n' '{markup}'`")
    log_in(page, serve, hash_=f"#/job/{job}/{job}")
    wait_js(page,
        "document.querySelector('#p-conv .out') && "
        "document.querySelector('#p-conv .out').textContent.includes('</script>')",
        timeout=60)
    assert markup in page.inner_text("#p-conv .out")
    assert "<i>task</i>" in page.inner_text("#summary")
    assert "<i>task</i>" in page.inner_text("#p-task")
    assert page.evaluate("window.pwned") is None
    assert page.locator("#swarm script, #swarm img, #swarm b, #swarm i").count() == 0
    headers = httpx.get(f"{serve.base}/", timeout=10).headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "unsafe-inline" not in headers["content-security-policy"]


def test_a_token_scoped_to_another_users_jobs_sees_none_of_them(
        page: Page, serve: Serve, swarm: tuple[str, Path]) -> None:
    tokens = TokenStore(connect(swarm[0]))
    alice, _ = tokens.create("alice-page")
    bob, _ = tokens.create("bob-page")
    job = serve.submit("run `echo alice-only`", token=alice)
    log_in(page, serve, token=bob)
    page.wait_for_selector("#jobs-empty", state="visible")
    assert page.locator("#job-list tbody tr").count() == 0
    page.goto(f"{serve.base}/#/job/{job}")
    wait_js(page, "document.getElementById('swarm-error').textContent !== ''")
    assert f"No job {job}" in page.inner_text("#swarm-error")
    assert page.locator("#tree tbody tr").count() == 0
    # The same page with the owner's token sees it: it is the scope that hid it.
    page.click("#logout")
    log_in(page, serve, token=alice, hash_="#/")
    page.wait_for_selector(f'#job-list tr[data-id="{job}"]')
    assert page.locator("#job-list tbody tr").count() == 1


def test_the_page_follows_a_job_across_a_restart_of_swarm_serve(
        page: Page, serve: Serve) -> None:
    job = serve.submit("fan out 2: `sleep 6; echo after-restart`")
    log_in(page, serve, hash_=f"#/job/{job}")
    wait_js(page, "document.querySelectorAll('#tree tbody tr').length === 3",
           timeout=60)
    # The tree may come from the snapshot before the stream answers: wait for the stream.
    wait_js(page, "window.swarmStats.connects === 1")
    serve.stop()
    wait_js(page, "document.getElementById('conn').textContent"
                           ".startsWith('disconnected')")
    serve.start()
    wait_js(page, "window.swarmStats.connects >= 2", timeout=60)
    wait_js(page, "document.getElementById('conn').textContent === 'settled'",
           timeout=60)
    states = page.eval_on_selector_all("#tree tbody .c-state", "cs => cs.map(c => c.textContent)")
    assert states == ["done", "done", "done"], states


def test_a_message_sent_from_the_page_reaches_a_running_child(
        page: Page, serve: Serve, model: ScriptedModelServer) -> None:
    sent = threading.Event()

    def held(request: dict[str, Any]) -> Reply:  # its first call waits for the message
        sent.wait(60)
        return Reply(tool_calls=[ToolCall("run_cli", {"command": "echo ok"})])

    def heard(request: dict[str, Any]) -> Reply:
        users = [m for m in request["messages"] if m.get("role") == "user"]
        return Reply(content="kid heard: " + message_text(users[-1]))

    model.responder = ByTask({
        "PAGESAYJOB": [Reply(tool_calls=[ToolCall("agent", {"message": "PAGESAYKID"})]),
                       lambda r: Reply(content=json.loads(tool_results(r)[0])["answer"])],
        "PAGESAYKID": [held, heard]})
    try:
        job = serve.submit("PAGESAYJOB go")
        kid = wait_until(lambda: children_of(serve, job), "the child", timeout=60)[0]
        log_in(page, serve, hash_=f"#/job/{job}/{kid}")
        page.wait_for_selector("#p-say", state="visible")
        text = "<b>use</b> the PAPAYA folder"
        page.fill("#p-say-text", text)
        page.click("#p-say-send")
        wait_js(page, "document.getElementById('p-say-msg').textContent.startsWith('sent')")
        sent.set()
        said = FROM_A_PERSON.format(text=text)
        wait_until(lambda: serve.job(job)["state"] == "done", "the job", timeout=60)
        assert serve.job(job)["answer"] == f"kid heard: {said}"
        # The panel shows it in the conversation, as text.
        wait_js(page, "[...document.querySelectorAll('#p-conv .k-user')].some(e => "
                      "e.textContent.includes('PAPAYA'))", timeout=30)
        assert page.locator("#p-conv b").count() == 0
        wait_js(page, "document.getElementById('p-say').hidden")  # settled: no more
    finally:
        model.responder = default_responder
