"""The ``swarm`` group: every subcommand, registered in one place."""

from __future__ import annotations

import logging

import click

from swarm import __version__
from swarm.cli import (
    chat,
    control,
    demo,
    logs,
    report,
    run,
    runtime,
    schedule,
    serve,
    sessions,
    status,
)
from swarm.cli.options import CONTEXT


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug) to stderr.")
def main(verbose: int) -> None:
    """swarm: a shell agent over any OpenAI-compatible API.

    Set SWARM_BASE_URL, SWARM_MODEL and SWARM_API_KEY (or OPENAI_* / EVA_*), then
    `swarm run "task"` works in the current folder. State lives in Redis: with no
    SWARM_REDIS_URL an embedded server is started under SWARM_HOME (~/.swarm).
    """
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


main.add_command(run.run)
main.add_command(run.attach)
main.add_command(chat.chat)
main.add_command(sessions.sessions)
main.add_command(status.status)
for command in (status.top, logs.logs, report.report):
    main.add_command(command)
main.add_command(runtime.worker)
main.add_command(runtime.coordinator)
main.add_command(runtime.flower)
main.add_command(demo.demo)
main.add_command(control.cancel)
main.add_command(control.approve)
main.add_command(serve.serve)
main.add_command(serve.token)
main.add_command(serve.mcp)
main.add_command(schedule.schedule)
main.add_command(schedule.beat)
