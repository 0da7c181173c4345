"""``swarm sessions``: list and clear the conversations kept in Redis."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from swarm.cli.options import Abort, handle_errors, settings_from
from swarm.store import keys
from swarm.store.connection import open_store
from swarm.store.sessions import RedisSessionStore
from swarm.text import plural


def _ago(ts: float) -> str:
    secs = max(0, int(time.time() - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit} ago"
    return f"{secs}s ago"


@click.group(invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
@handle_errors
def sessions(ctx: click.Context, as_json: bool) -> None:
    """List conversations (one per folder), newest first; * marks the current folder."""
    if ctx.invoked_subcommand is not None:
        return
    settings = settings_from()
    here = keys.session_id_for(str(Path.cwd().resolve()))
    with open_store(settings) as store:
        repo = RedisSessionStore(store.redis, ttl=settings.session_ttl)
        rows = [(s, repo.size_bytes(s.id)) for s in repo.list()]
    if as_json:
        click.echo(json.dumps([
            {"id": s.id, "workspace": s.workspace, "messages": len(s.messages), "bytes": size,
             "turns": s.turns, "updated": s.updated, "usage": s.usage, "current": s.id == here}
            for s, size in rows], indent=2))
        return
    if not rows:
        click.echo("no sessions", err=True)
        return
    for s, size in rows:
        mark = "*" if s.id == here else " "
        click.echo(f"{mark} {s.workspace}  {plural(len(s.messages), 'message')}, "
                   f"{size / 1024:.1f} KiB, "
                   f"{s.usage.get('total_tokens', 0)} tokens, {_ago(s.updated)}")


@sessions.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--here", is_flag=True, help="Clear only the current folder's conversation.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@handle_errors
def clear(here: bool, yes: bool) -> None:
    """Delete every conversation (or only this folder's with --here)."""
    settings = settings_from()
    what = "this folder's conversation" if here else "every conversation"
    if not yes and not click.confirm(f"Delete {what}?", default=False, err=True):
        raise Abort("nothing deleted")
    with open_store(settings) as store:
        repo = RedisSessionStore(store.redis, ttl=settings.session_ttl)
        if here:
            n = int(repo.delete(keys.session_id_for(str(Path.cwd().resolve()))))
        else:
            n = repo.clear()
    click.echo(f"deleted {plural(n, 'session')}", err=True)
