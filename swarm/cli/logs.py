"""``swarm logs AGENT_ID``: an agent's conversation — its task, commands, outputs, answer."""

from __future__ import annotations

from typing import Any

import click
import redis

from swarm.cli.options import Abort, handle_errors, settings_from
from swarm.domain.records import AgentRecord
from swarm.report.conversation import call_line
from swarm.report.view import content_text
from swarm.store.connection import open_store
from swarm.store.ledger import Ledger
from swarm.store.reads import Reads
from swarm.store.sessions import RedisSessionStore

#: Lines of a command's output (or a long message) shown without --full: head and tail.
HEAD, TAIL = 10, 5
#: Characters of one output line shown without --full.
LINE_CAP = 300


def shorten(text: str, full: bool) -> str:
    """``text`` whole with ``full``, else its first and last lines with a marker between."""
    if full:
        return text
    lines = [ln if len(ln) <= LINE_CAP else ln[:LINE_CAP] + " ..." for ln in text.splitlines()]
    if len(lines) > HEAD + TAIL + 1:
        cut = len(lines) - HEAD - TAIL
        lines = [*lines[:HEAD], f"... {cut} lines cut (--full shows them) ...", *lines[-TAIL:]]
    return "\n".join(lines)


def resolve_agent(redis_: redis.Redis, given: str) -> AgentRecord | None:
    """The ledger entry of ``given``: an agent id, a swarm id (its root) or a unique prefix."""
    ledger = Ledger(redis_)
    record = ledger.agent(given)
    if record is not None:
        return record
    matches = Reads(redis_).agent_ids_like(given)
    if len(matches) > 1:
        shown = ", ".join(matches[:5])
        raise Abort(f"{given!r} matches {len(matches)} agents ({shown}...); give more of the id")
    return ledger.agent(matches[0]) if matches else None


def conversation_lines(messages: list[dict[str, Any]], full: bool) -> list[str]:
    """The conversation as text: commands, shortened outputs, thoughts and the answer."""
    out: list[str] = []
    answer_at = max((i for i, m in enumerate(messages)
                     if m.get("role") == "assistant" and not m.get("tool_calls")), default=-1)
    for i, message in enumerate(messages):
        role = message.get("role")
        text = content_text(message.get("content")).strip()
        if role == "system":
            if full:
                out += ["== system prompt", text]
        elif role == "user":
            out += ["== user", shorten(text, full)]
        elif role == "assistant":
            reasoning = str(message.get("reasoning_content") or "").strip()
            if reasoning:
                out += ["-- thinking", shorten(reasoning, full)]
            calls = message.get("tool_calls") or []
            if calls:
                if text:
                    out += ["-- said", shorten(text, full)]
                out += [shorten(call_line(c), full) for c in calls]
            else:
                out += ["== answer" if i == answer_at else "== assistant", text]
        elif role == "tool":
            out.append("\n".join("  " + ln for ln in shorten(text, full).splitlines()) or "  ")
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("agent_id")
@click.option("--full", is_flag=True, help="Show outputs and messages whole, and the system "
                                           "prompt.")
@handle_errors
def logs(agent_id: str, full: bool) -> None:
    """Print the conversation of AGENT_ID: its task, commands, their output, its answer.

    AGENT_ID is an id from `swarm status` (a unique prefix will do); a swarm id shows the
    root agent's conversation. Outputs are shortened to their first and last lines unless
    --full.
    """
    with open_store(settings_from()) as store:
        record = resolve_agent(store.redis, agent_id)
        session_id = record.session_id if record is not None else agent_id
        session = RedisSessionStore(store.redis, index=False).load(session_id)
        result: dict[str, Any] = {}
        if record is not None and record.run:
            run = Reads(store.redis).run(record.run, ["result"])
            result = run.result if run is not None else {}
    if record is None and session is None:
        raise Abort(f"no agent {agent_id!r}: `swarm status` lists the agents of the latest "
                    "swarm (ledger entries and sessions expire)")
    if record is not None:
        click.echo(f"agent {record.id}  {record.kind}  {record.state or '?'}  "
                   f"depth {record.depth}  swarm {record.swarm or '?'}  "
                   f"parent {record.parent or '-'}")
        if record.workspace:
            click.echo(f"workspace {record.workspace}")
    if session is None:
        click.echo(f"(no conversation stored for {agent_id}: it has not started, or its "
                   "session expired)")
    else:
        for line in conversation_lines(session.messages, full):
            click.echo(line)
    if isinstance(result, dict) and result.get("error"):
        click.echo(f"== error\n{result['error']}")
