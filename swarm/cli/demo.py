"""``swarm demo``: a real fan-out on the local swarm, driven by a scripted model."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import click

from swarm.cli.main import handle_errors, interrupt_on_term, settings_from
from swarm.cli.run import run_job

MAX_FILES = 20
BANNER = """This is a demo. The model is SCRIPTED (swarm.testing.server), not a real LLM: it
hands each file to a child agent, each child counts its file with `wc`, and the root adds
the counts up. The swarm itself is real: an embedded Redis-compatible server, a coordinator
and Celery worker processes, started now and stopped at the end."""


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
    counts its lines and words, the root adds them up. The model is scripted."""
    from swarm.testing.scripts import demo_responder, demo_task
    from swarm.testing.server import ScriptedModelServer

    click.secho(BANNER, fg="yellow", err=True)
    folder = folder.resolve()
    files = pick_files(folder)
    if not files:
        folder = sample_folder()
        files = pick_files(folder)
        click.echo(f"(no files in the folder: using sample files in {folder})", err=True)
    interrupt_on_term()
    with ScriptedModelServer(responder=demo_responder(), latency=latency) as model:
        settings = settings_from().with_(base_url=model.base_url, model=model.models[0],
                                         yes=True, api_key="scripted-demo")
        flower = None
        if flower_port:
            flower = _start_flower(settings.home, flower_port)
        try:
            answer = run_job(settings, folder, demo_task([str(f) for f in files]),
                             workers=workers, new=True)
        finally:
            if flower is not None:
                flower.terminate()
                flower.wait(timeout=10)
    click.echo(answer)


def _start_flower(home: Path, port: int) -> subprocess.Popen[bytes]:
    click.echo(f"Flower: http://127.0.0.1:{port} (stops with the demo)", err=True)
    return subprocess.Popen([sys.executable, "-m", "swarm", "flower", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
