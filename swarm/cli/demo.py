"""``swarm demo``: a real fan-out on a local swarm, driven by a scripted model."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from swarm.cli.options import Abort, handle_errors, interrupt_on_term, settings_from
from swarm.cli.run import run_job
from swarm.store.connection import mask_url
from swarm.text import plural

MAX_FILES = 20
DEMO_KEY = "scripted-demo"
BANNER = """This is a demo. The model is SCRIPTED, not a real LLM: swarm.testing.server on
{url} hands each file to a child agent, each child counts its file with `wc`,
and the root adds the counts up. The swarm itself is real: the embedded Redis-compatible
server of SWARM_HOME ({home}), with a coordinator and {workers} started now
and stopped at the end."""
REMOTE = """swarm demo runs on a local swarm, but SWARM_REDIS_URL is set
({url}): its children would go to that deployment's workers, which cannot
reach the demo's scripted model on this machine's 127.0.0.1 (and keep their own
SWARM_BASE_URL). Run it without:
  env -u SWARM_REDIS_URL swarm demo
To see a fan-out on the deployment itself, see "Try it with the scripted model" in
docs/deploy.md."""


def pick_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return files[:MAX_FILES]


def sample_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    for i in range(1, 6):
        (folder / f"sample-{i}.txt").write_text("a few words on a line\n" * (i * 3))
    return folder


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-C", "--folder", type=click.Path(file_okay=False, exists=True, path_type=Path),
              default=".", show_default=True, help="Folder whose files are counted.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Local worker processes.")
@click.option("--latency", type=float, default=0.2, show_default=True,
              help="Seconds the scripted model takes per answer.")
@click.option("--flower", "flower_port", type=int, default=None, metavar="PORT",
              help="Also start Flower on this port to watch the tasks.")
@handle_errors
def demo(folder: Path, workers: int, latency: float, flower_port: int | None) -> None:
    """See a swarm at work without a model endpoint: one child agent per file of FOLDER
    counts its lines and words, the root adds them up. The model is scripted.

    It runs on the embedded server of SWARM_HOME with its own coordinator and workers,
    never on a deployment (it refuses while SWARM_REDIS_URL is set). Exits 1 when a child
    did not finish (failed, refused, cancelled, timed out).
    """
    from swarm.testing.scripts import DemoTally, demo_responder, demo_task
    from swarm.testing.server import ScriptedModelServer

    settings = settings_from()
    if not settings.embedded:
        raise Abort(REMOTE.format(url=mask_url(settings.redis_url)))
    folder = folder.resolve()
    files = pick_files(folder)
    note = ""
    if not files:
        folder = sample_folder()
        files = pick_files(folder)
        note = f"(no files in the folder: using sample files in {folder})"
    interrupt_on_term()
    tally = DemoTally()
    with ScriptedModelServer(responder=demo_responder(tally), latency=latency) as model, \
            _scripted_endpoint(model.base_url, model.models[0]):
        click.secho(BANNER.format(url=model.base_url, home=settings.home,
                                  workers=plural(workers, "worker process", "worker processes")),
                    fg="yellow", err=True)
        if note:
            click.echo(note, err=True)
        settings = settings.with_(base_url=model.base_url, model=model.models[0], yes=True,
                                  api_key=DEMO_KEY)
        flower = None
        if flower_port:
            flower = _start_flower(flower_port)
        try:
            # Relative: each child counts its copy of the file in its own workspace (a
            # child's box shows no folder of its parent's).
            answer = run_job(settings, folder,
                             demo_task([str(f.relative_to(folder)) for f in files]),
                             workers=workers, new=True)
        finally:
            if flower is not None:
                flower.terminate()
                flower.wait(timeout=10)
    click.echo(answer)
    if tally.unfinished:
        states = ", ".join(f"{n} {state}" for state, n in tally.unfinished.items())
        raise Abort(f"{plural(sum(tally.unfinished.values()), 'child', 'children')} of "
                    f"{tally.files} did not finish ({states}); `swarm status` shows why")


@contextmanager
def _scripted_endpoint(base_url: str, model: str) -> Iterator[None]:
    """Give the local workers (started with this process's environment) the scripted model:
    a worker whose environment names an endpoint keeps it, so a user's SWARM_BASE_URL would
    send the demo's children to a real model."""
    changes = {"SWARM_BASE_URL": base_url, "SWARM_MODEL": model, "SWARM_API_KEY": DEMO_KEY}
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _start_flower(port: int) -> subprocess.Popen[bytes]:
    click.echo(f"Flower: http://127.0.0.1:{port} (stops with the demo)", err=True)
    return subprocess.Popen([sys.executable, "-m", "swarm", "flower", "--address", "127.0.0.1",
                             "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
