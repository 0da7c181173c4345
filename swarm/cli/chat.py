"""``swarm chat``: talk with the agent in this folder's conversation."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from swarm.agent.approval import TerminalApprover
from swarm.agent.loop import Agent
from swarm.agent.protocols import Spawner
from swarm.cli.options import Abort, agent_options, handle_errors, interrupt_on_term, settings_from
from swarm.cli.render import TerminalView
from swarm.domain.session import Session
from swarm.errors import (
    Interrupted,
    LimitReached,
    ModelError,
    RuntimeUnavailable,
    TaskTooLarge,
)
from swarm.runtime.build import local_agent
from swarm.runtime.root import RootSwarm
from swarm.store.connection import Outage, Store
from swarm.store.sessions import RedisSessionStore


def _enable_history(path: Path) -> None:
    try:
        import readline
    except ImportError:  # not on every platform; chat works without it
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)
    import atexit

    atexit.register(lambda: readline.write_history_file(path))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@agent_options
@handle_errors
def chat(yes: bool | None, model: str | None, base_url: str | None, new: bool,
         max_turns: int | None, child_max_turns: int | None, workspace: Path) -> None:
    """Chat with the agent in the workspace; the conversation is kept per folder.

    Ctrl-C stops the current answer or command and returns to the prompt; Ctrl-D exits.
    Type /new to start over, /exit to leave. A message too large for the model's context
    is refused before it is sent (the conversation goes on): put the material in a file in
    the workspace and ask the agent to read it.
    """
    settings = settings_from(yes=yes, model=model, base_url=base_url, max_turns=max_turns,
                             child_max_turns=child_max_turns)
    if not workspace.is_dir():
        raise Abort(f"workspace {workspace} does not exist")
    interrupt_on_term()
    _enable_history(settings.home / "chat_history")
    view = TerminalView.for_settings(settings, stream_answer=True)
    roots: list[RootSwarm] = []
    approver = TerminalApprover()

    def spawner(store: Store, session: Session, outage: Outage) -> Spawner:
        roots.append(RootSwarm(settings, store, on_event=view.on_swarm_event,
                               notice=view.on_notice, outage=outage,
                               ask=lambda request: approver(request).decision))
        return roots[0].spawner(store, session)

    with local_agent(settings, workspace, approver=approver, observer=view,
                     new=new, spawner=spawner) as local:
        agent, root = local.agent, roots[0]
        if local.unconfined:
            view.on_notice(local.unconfined)
        try:
            _loop(agent, root, local.sessions, view, local.resumed)
        finally:
            root.finish("done")
            root.close()


def _loop(agent: Agent, root: RootSwarm, sessions: RedisSessionStore, view: TerminalView,
          resumed: bool) -> None:
    """Read a line, answer it, until /exit or Ctrl-D."""
    if resumed:
        click.secho(f"(resuming this folder's conversation: {len(agent.messages)} "
                    "messages; /new starts over)", dim=True, err=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            click.echo(err=True)
            return
        except KeyboardInterrupt:
            click.echo(err=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/new":
            agent.session.messages.clear()
            agent.save()
            click.secho("(new conversation)", dim=True, err=True)
            continue
        try:
            answer = root.run(agent, text, sessions)
            if not view.stream_answer:
                click.echo(answer)
        except (Interrupted, KeyboardInterrupt):
            click.secho("\n(interrupted)", dim=True, err=True)
        except LimitReached as exc:
            click.secho(str(exc), fg="yellow", err=True)
        except (ModelError, RuntimeUnavailable, TaskTooLarge) as exc:
            click.secho(f"{type(exc).__name__}: {exc}", fg="red", err=True)
        click.echo(err=True)
        bar = view.context_bar()
        if bar:
            click.echo(bar, err=True)
