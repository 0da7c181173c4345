"""The page of ``swarm serve`` in a browser: a real N-agent swarm (default 500) watched
live, then opened again once settled.

A local swarm (embedded server, coordinator, ``--workers`` worker processes of
``--concurrency`` threads) runs one job submitted over the API (the app served by uvicorn
in this process): a root fanning out to ``--page-n`` children, each running ``--page-turns``
commands (the scripted model answers after ``--latency`` seconds). Headless Chromium
(Debian's, driven by Playwright) follows the job from its submission to its end, then a
fresh tab opens the settled swarm. Measured:

- per event: the page's handler (``window.swarmStats``: parse + the one row it changes),
  mean and worst; and the main thread's whole time during the live phase (Chrome's
  ``TaskDuration``: scripts, style, layout, paint, snapshot reads) divided by the events;
- per snapshot read (every second at most while events come): apply to the N rows, mean
  and worst;
- time to render the settled swarm: from opening the page to all N+1 rows in the DOM, and
  the part spent reading the snapshot and drawing it;
- opening an agent's panel (its conversation, result and diff).

Needs ``/usr/bin/chromium`` and playwright (``pip install -e '.[dev]'``); without them the
part says so and measures nothing.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import JobScript, log, new_tag
from swarm.broker.app import configure as celery_for
from swarm.config import Settings
from swarm.serve.app import create_app
from swarm.serve.auth import Authenticator
from swarm.serve.service import Service
from swarm.store.connection import connect
from swarm.testing.cluster import local_swarm
from swarm.testing.server import ScriptedModelServer

CHROMIUM = Path("/usr/bin/chromium")
TOKEN = "bench-page-token"


def missing() -> str:
    if not CHROMIUM.exists():
        return "no /usr/bin/chromium (apt-get install chromium)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return ""


def serve_app(url: str, home: Path, model: ScriptedModelServer, n: int
              ) -> tuple[str, Any, threading.Thread]:
    import uvicorn

    settings = Settings.from_env(env={
        "SWARM_HOME": str(home), "SWARM_BASE_URL": model.base_url,
        "SWARM_MODEL": model.models[0], "SWARM_MAX_CHILDREN": str(max(n, 1)),
        "SWARM_MAX_PARALLEL": str(max(n, 1)), "SWARM_RETRIES": "1"})
    client = connect(url)
    app = create_app(Service(client, celery_for(url), settings, home / "jobs",
                             Authenticator(client, TOKEN)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", server, thread


def wait_js(page: Any, expression: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {expression}")
        time.sleep(0.05)


def open_tab(browser: Any, base: str, hash_: str) -> tuple[Any, Any, Any]:
    """A tab of its own with the token in its sessionStorage, at ``hash_``; its CDP session."""
    context = browser.new_context(viewport={"width": 1500, "height": 900})
    context.add_init_script(f"sessionStorage.setItem('swarm-token', '{TOKEN}')")
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Performance.enable")
    page.goto(f"{base}/{hash_}")
    return context, page, cdp


#: Chrome's counters of the main thread's work (seconds), whole and in parts.
BUSY = ("TaskDuration", "ScriptDuration", "RecalcStyleDuration", "LayoutDuration")


def busy(cdp: Any) -> dict[str, float]:
    """Seconds the tab's main thread has worked: in all, in scripts, style, layout."""
    metrics = {m["name"]: float(m["value"])
               for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {name: metrics.get(name, 0.0) for name in BUSY}


def run(args: argparse.Namespace) -> dict[str, Any]:
    why = missing()
    if why:
        log(f"page: skipped: {why}")
        return {"skipped": why}
    from playwright.sync_api import sync_playwright

    n, turns = args.page_n, args.page_turns
    home = Path(tempfile.mkdtemp(prefix="bench-page-"))
    script = JobScript(new_tag(), n, turns, command="echo {i}.{k}")
    try:
        with ScriptedModelServer(latency=args.latency, responder=script) as model, \
                local_swarm(home, workers=args.workers, concurrency=args.concurrency,
                            timeout=60) as url, sync_playwright() as p:
            base, server, thread = serve_app(url, home, model, n)
            browser = p.chromium.launch(executable_path=str(CHROMIUM))
            try:
                created = httpx.post(f"{base}/v1/jobs", json={"task": script.root_task,
                                                               "approve": "all"},
                                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
                created.raise_for_status()
                job = created.json()["id"]
                started = time.perf_counter()
                context, page, cdp = open_tab(browser, base, f"#/job/{job}")
                before = busy(cdp)
                wait_js(page, "document.getElementById('conn').textContent === 'settled'",
                        timeout=max(600.0, n * 2.0))
                live_wall = time.perf_counter() - started
                after = busy(cdp)
                parts = {k: after[k] - before[k] for k in BUSY}
                main_thread = parts["TaskDuration"]
                wait_js(page, "[...document.querySelectorAll('#tree tbody .c-state')]"
                              f".filter(c => c.textContent === 'done').length === {n + 1}",
                        timeout=30)  # the last snapshot read, at most a second later
                live = page.evaluate("Object.assign({}, window.swarmStats)")
                rows = page.evaluate("document.querySelectorAll('#tree tbody tr').length")
                states = page.evaluate("[...document.querySelectorAll('#tree tbody .c-state')]"
                                       ".filter(c => c.textContent === 'done').length")
                context.close()
                log(f"page: the job settled after {live_wall:.1f} s; {live['events']} events")

                opened = []
                for _ in range(3):
                    began = time.perf_counter()
                    context, page, cdp = open_tab(browser, base, f"#/job/{job}")
                    wait_js(page, f"document.querySelectorAll('#tree tbody tr').length "
                                  f"=== {n + 1}", timeout=60)
                    wall = time.perf_counter() - began
                    first = page.evaluate("window.swarmStats.firstRenderMs")
                    kid = page.evaluate("document.querySelectorAll('#tree tbody tr')[1]"
                                        ".dataset.id")
                    began = time.perf_counter()
                    page.click(f'#tree tr[data-id="{kid}"]')
                    wait_js(page, "document.querySelector('#p-result').textContent"
                                  ".includes('\"state\"')", timeout=30)
                    panel = time.perf_counter() - began
                    opened.append({"wall_ms": wall * 1000, "snapshot_and_draw_ms": first,
                                   "panel_ms": panel * 1000})
                    context.close()
            finally:
                browser.close()
                server.should_exit = True
                thread.join(timeout=10)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    events = max(1, int(live["events"]))
    snapshots = max(1, int(live["snapshots"]))
    best = min(opened, key=lambda o: o["wall_ms"])
    return {
        "config": {"n": n, "turns": turns, "latency": args.latency, "workers": args.workers,
                   "concurrency": args.concurrency},
        "live": {"wall_s": live_wall, "events": live["events"], "rows": rows, "done": states,
                 "event_handler_ms_mean": live["eventMs"] / events,
                 "event_handler_ms_max": live["eventMaxMs"],
                 "main_thread_s": main_thread,
                 "script_s": parts["ScriptDuration"], "style_s": parts["RecalcStyleDuration"],
                 "layout_s": parts["LayoutDuration"],
                 "main_thread_ms_per_event": main_thread * 1000 / events,
                 "snapshots": live["snapshots"],
                 "snapshot_apply_ms_mean": live["snapshotMs"] / snapshots,
                 "snapshot_apply_ms_max": live["snapshotMaxMs"],
                 "reconnects": live["connects"] - 1},
        "opened": opened,
        "open_ms_best": best["wall_ms"],
    }


def report(out: dict[str, Any]) -> list[str]:
    if "skipped" in out:
        return ["8. The page in a browser: skipped: " + out["skipped"]]
    cfg, live = out["config"], out["live"]
    lines = [f"8. The page in a browser: a swarm of {cfg['n']} children x {cfg['turns']} "
             f"commands, model latency {cfg['latency']:g} s, watched live in headless "
             "Chromium, then opened again",
             f"  live: {live['events']} events in {live['wall_s']:.1f} s; rows {live['rows']} "
             f"({live['done']} done)",
             f"  per event: handler {live['event_handler_ms_mean']:.3f} ms mean, "
             f"{live['event_handler_ms_max']:.2f} ms worst; main thread in all "
             f"{live['main_thread_ms_per_event']:.2f} ms/event ({live['main_thread_s']:.2f} s: "
             f"script {live['script_s']:.2f} s, style {live['style_s']:.2f} s, layout "
             f"{live['layout_s']:.2f} s)",
             f"  per snapshot read ({live['snapshots']}): apply "
             f"{live['snapshot_apply_ms_mean']:.1f} ms mean, "
             f"{live['snapshot_apply_ms_max']:.1f} ms worst"]
    for i, o in enumerate(out["opened"], 1):
        lines.append(f"  open #{i}: {o['wall_ms']:.0f} ms to {cfg['n'] + 1} rows "
                     f"(snapshot read and drawn in {o['snapshot_and_draw_ms']:.0f} ms); "
                     f"an agent's panel in {o['panel_ms']:.0f} ms")
    return lines
