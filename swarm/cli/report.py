"""``swarm report``: a swarm as one self-contained HTML page (timeline, totals, failures)."""

from __future__ import annotations

from pathlib import Path

import click

from swarm.cli.options import Abort, handle_errors, settings_from
from swarm.cli.status import load_view, prices_from_env
from swarm.report.html import render_html
from swarm.report.view import SwarmReader
from swarm.store.connection import open_store
from swarm.text import plural


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("swarm_id", required=False)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="File to write ('-' for stdout). Default: SWARM_HOME/reports/SWARM_ID.html.")
@handle_errors
def report(swarm_id: str | None, output: Path | None) -> None:
    """Write SWARM_ID (default: the latest swarm) as one HTML page to open in a browser,
    by default as SWARM_HOME/reports/SWARM_ID.html (not in the current folder, where the
    next job would take it for one of the project's files); it prints the path.

    The page needs no network: a timeline of every agent from spawn to settle coloured
    by state (hover a bar for its task and result or error), the totals, and the
    failures first. SWARM_PRICE_INPUT / SWARM_PRICE_OUTPUT add an estimated cost.
    """
    prices = prices_from_env()
    settings = settings_from()
    with open_store(settings) as store:
        view = load_view(SwarmReader(store.redis), swarm_id, root_answer=True)
    page = render_html(view, prices)
    if output is not None and str(output) == "-":
        click.echo(page)
        return
    path = output or settings.home / "reports" / f"{view.swarm_id}.html"
    try:
        if output is None:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise Abort(f"cannot write the report to {path}: {exc.strerror or exc}") from None
    click.echo(f"wrote {path} ({plural(len(view.agents), 'agent')}, "
               f"{len(view.failures())} failed): open it in a browser")
