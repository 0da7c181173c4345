"""What the ``swarm`` commands share: options, settings, errors and signals."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from swarm.config import Settings
from swarm.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Abort(click.ClickException):
    """A user-facing failure (exit 1); subclasses set another ``exit_code``."""


def agent_options(fn: F) -> F:
    """Options of commands that run an agent; each also reads its SWARM_* variable."""
    options = [
        click.option("-y", "--yes", is_flag=True, default=None, envvar="SWARM_YES",
                     help="Approve every tool call without asking. [env: SWARM_YES]"),
        click.option("--model", envvar="SWARM_MODEL",
                     help="Model id (falls back to OPENAI_MODEL, EVA_MODEL_NAME; if unset and "
                          "the endpoint lists one model, that one). [env: SWARM_MODEL]"),
        click.option("--base-url", envvar="SWARM_BASE_URL",
                     help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080/v1 (falls "
                          "back to OPENAI_BASE_URL, EVA_BASE_URL). [env: SWARM_BASE_URL]"),
        click.option("--new", is_flag=True,
                     help="Start a new conversation instead of resuming this folder's."),
        click.option("--max-turns", type=click.IntRange(min=0), envvar="SWARM_MAX_TURNS",
                     help="Stop cleanly after N model calls (default 200; 0 = no cap); a "
                          "child stops there too if it is lower. [env: SWARM_MAX_TURNS]"),
        click.option("--child-max-turns", type=click.IntRange(min=0),
                     envvar="SWARM_CHILD_MAX_TURNS",
                     help="Stop each child agent after N model calls (default 50; 0 = no "
                          "cap). [env: SWARM_CHILD_MAX_TURNS]"),
        click.option("-C", "--workspace", type=click.Path(file_okay=False, path_type=Path),
                     default=".", show_default=True,
                     help="Folder to work in; each folder has its own conversation."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def settings_from(**flags: Any) -> Settings:
    """Settings from the environment with the given CLI flags on top."""
    try:
        return Settings.from_env(**flags)
    except ConfigError as exc:
        raise Abort(str(exc)) from None


def interrupt_on_term() -> None:
    """Make SIGTERM and SIGHUP (a closed terminal) act like Ctrl-C, so the same cleanup
    runs: the command's process group is killed, the session saved, servers stopped."""
    import signal
    import threading

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (tests drive the CLI from threads)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def handle_errors(fn: F) -> F:
    """Turn expected errors into clean messages instead of tracebacks."""
    from swarm.errors import SwarmError

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SwarmError as exc:
            raise Abort(f"{type(exc).__name__}: {exc}") from None

    return wrapper  # type: ignore[return-value]
