"""``swarm cancel``, ``swarm approve`` and ``swarm say``: act on a running swarm from any
terminal."""

from __future__ import annotations

import click

from swarm.cli.options import Abort, handle_errors, settings_from
from swarm.errors import RequestError
from swarm.store.approvals import ApprovalQueue, closed_because, outcome
from swarm.store.connection import open_store
from swarm.store.ledger import Ledger
from swarm.store.mailbox import Mailbox
from swarm.text import plural

CTX = {"help_option_names": ["-h", "--help"]}


@click.command(context_settings=CTX)
@click.argument("agent_id", required=False)
@handle_errors
def cancel(agent_id: str | None) -> None:
    """Cancel AGENT_ID (an agent, or a swarm id for the whole swarm; default: the latest
    swarm) and every agent under it. Running commands are killed; parents get `cancelled`
    results."""
    settings = settings_from()
    with open_store(settings) as store:
        ledger = Ledger(store.redis)
        target = agent_id or ledger.latest_swarm()
        if not target or not ledger.agent(target):
            raise Abort(f"no agent or swarm {target!r}; `swarm status` lists them")
        active = ledger.cancel(target)
    were = "was" if len(active) == 1 else "were"
    click.echo(f"cancelling {target}: {plural(len(active), 'agent')} still active {were} flagged; "
               "they stop within seconds", err=True)


@click.command(context_settings=CTX)
@click.argument("approval_id", required=False)
@click.option("--swarm", "swarm_id", help="The swarm (default: the latest).")
@click.option("--deny", "decision", flag_value="deny", help="Deny the request.")
@click.option("--always", "decision", flag_value="always",
              help="Approve, and approve this tool for the rest of the swarm.")
@click.option("--yes", "decision", flag_value="approve", default=True,
              help="Approve the request (the default).")
@handle_errors
def approve(approval_id: str | None, swarm_id: str | None, decision: str) -> None:
    """Answer a child's approval request; with no APPROVAL_ID, list the pending ones."""
    settings = settings_from()
    with open_store(settings) as store:
        ledger = Ledger(store.redis)
        swarm_id = swarm_id or ledger.latest_swarm()
        if not swarm_id:
            raise Abort("no swarm yet")
        queue = ApprovalQueue(store.redis, swarm_id)
        if approval_id is None:
            pending = queue.pending()
            if not pending:
                click.echo(f"no approval pending in swarm {swarm_id}", err=True)
            for p in pending:
                click.echo(f"{p.id}  agent {p.agent}  {p.tool}: {p.summary}"
                           + (f"  ({p.reason})" if p.reason else ""))
            return
        if not queue.answer(approval_id, decision):  # type: ignore[arg-type]
            how = outcome(store.redis, approval_id)
            if how is not None:
                raise Abort(f"request {approval_id!r} is not pending: {closed_because(how)}")
            raise Abort(f"no pending request {approval_id!r} in swarm {swarm_id} (another "
                        "swarm? pass --swarm)")
    click.echo(f"{approval_id}: {decision}", err=True)


@click.command(context_settings=CTX)
@click.argument("agent_id")
@click.argument("message", nargs=-1)
@click.option("-f", "--message-file", metavar="FILE",
              help="Read the message from FILE (UTF-8; - for stdin), after MESSAGE's words if "
                   "any.")
@handle_errors
def say(agent_id: str, message: tuple[str, ...], message_file: str | None) -> None:
    """Send MESSAGE to the running agent AGENT_ID (an id from `swarm status`; a swarm id
    for its root, in a terminal or a job).

    \b
      swarm say 3f2a9c1d0e7b "skip the tests folder, it is generated"
      swarm say 3f2a9c1d0e7b -f notes.md

    The agent reads it at its next turn boundary (after the command or model call in
    flight; a parent waiting for its children, after their results), as a user message
    `[message from a person, ...]`. It shows in `swarm logs` and in the swarm's events.
    A settled agent refuses it. A `-` among the words (or -f -) reads stdin; a message
    has at most 262,144 characters.
    """
    from swarm.cli.run import read_task_file

    dashes = message.count("-")
    if dashes + (message_file is not None) > 1:
        raise click.UsageError("give the message's text once: -f FILE or - (stdin), not both")
    source = message_file if message_file is not None else ("-" if dashes else None)
    parts = [" ".join(w for w in message if w != "-")]
    if source is not None:
        parts.append(read_task_file(source, "message", "--message-file").rstrip("\r\n"))
    text = "\n\n".join(p for p in parts if p.strip())
    if not text.strip():
        raise click.UsageError("the message is empty: give it as words (swarm say AGENT_ID "
                               "\"...\"), -f FILE or - (stdin)")
    with open_store(settings_from()) as store:
        try:
            Mailbox(store.redis, agent_id).send(text, "cli")
        except RequestError as exc:
            raise Abort(str(exc)) from None
    click.echo(f"told {agent_id} ({plural(len(text), 'character')}); it reads it at its next "
               "turn", err=True)
