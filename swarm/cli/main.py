"""The ``swarm`` group: every subcommand, registered in one place.

A subcommand's module is imported when that subcommand runs (or ``--help`` lists them
all): ``swarm run`` never pays for the imports of ``swarm serve`` or ``swarm worker``
(Celery, FastAPI), so it reaches its first model request sooner.
"""

from __future__ import annotations

import importlib
import logging

import click

from swarm import __version__
from swarm.cli.options import CONTEXT

#: Subcommand name -> (module under swarm.cli, attribute).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "run"),
    "attach": ("run", "attach"),
    "chat": ("chat", "chat"),
    "sessions": ("sessions", "sessions"),
    "status": ("status", "status"),
    "top": ("status", "top"),
    "logs": ("logs", "logs"),
    "land": ("land", "land"),
    "report": ("report", "report"),
    "worker": ("runtime", "worker"),
    "coordinator": ("runtime", "coordinator"),
    "flower": ("runtime", "flower"),
    "demo": ("demo", "demo"),
    "cancel": ("control", "cancel"),
    "approve": ("control", "approve"),
    "say": ("control", "say"),
    "serve": ("serve", "serve"),
    "token": ("serve", "token"),
    "mcp": ("serve", "mcp"),
    "schedule": ("schedule", "schedule"),
    "beat": ("schedule", "beat"),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported by name, when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module = importlib.import_module(f"swarm.cli.{target[0]}")
        command: click.Command = getattr(module, target[1])
        return command

    def all_commands(self) -> dict[str, click.Command]:
        """Every subcommand by name (imports them all)."""
        ctx = click.Context(self)
        found = {name: self.get_command(ctx, name) for name in self.list_commands(ctx)}
        return {name: command for name, command in found.items() if command is not None}


@click.group(cls=LazyGroup, context_settings=CONTEXT)
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
