"""``swarm run TASK``: one job, non-interactive; the answer alone on stdout."""

from __future__ import annotations

from pathlib import Path

import click

from swarm.agent.approval import TerminalApprover
from swarm.agent.build import local_agent
from swarm.cli.main import Abort, agent_options, handle_errors, settings_from
from swarm.cli.render import TerminalView
from swarm.errors import Interrupted, TurnLimitReached

EXIT_TURN_LIMIT = 3
EXIT_INTERRUPTED = 130


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("task", nargs=-1, required=True)
@agent_options
@handle_errors
def run(task: tuple[str, ...], yes: bool | None, model: str | None, base_url: str | None,
        new: bool, max_turns: int | None, workspace: Path) -> None:
    """Run TASK in the workspace until the model answers, then print the answer on stdout.

    Thinking, commands and their output go to stderr, so `answer=$(swarm run "...")` gets
    the answer alone. Commands the safety reviewer does not pass as read-only are asked
    about on the terminal (closed stdin denies); --yes approves everything.

    Exit codes: 0 answered, 1 error, 3 stopped at --max-turns, 130 interrupted.
    """
    settings = settings_from(yes=yes, model=model, base_url=base_url, max_turns=max_turns)
    if not workspace.is_dir():
        raise Abort(f"workspace {workspace} does not exist; create it or pass -C to another")
    view = TerminalView()
    text = " ".join(task)
    with local_agent(settings, workspace, approver=TerminalApprover(), observer=view,
                     new=new) as local:
        if local.repaired:
            view.on_notice("the last run stopped mid-step; its unfinished tool calls were "
                           "marked interrupted")
        try:
            answer = local.agent.run(text)
        except TurnLimitReached as exc:
            raise Abort(str(exc), EXIT_TURN_LIMIT) from None
        except (Interrupted, KeyboardInterrupt):
            raise Abort("interrupted; the session is saved", EXIT_INTERRUPTED) from None
    click.echo(answer)
