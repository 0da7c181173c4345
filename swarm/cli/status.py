"""``swarm status`` and ``swarm top``: a swarm's agents as a tree, once or live."""

from __future__ import annotations

import contextlib
import json
import sys

import click
import redis
from rich.console import Console

from swarm.cli.options import Abort, handle_errors, settings_from
from swarm.report.display import Prices, first_line, fmt_duration, fmt_tokens
from swarm.report.view import AgentView, SwarmReader, SwarmView
from swarm.runtime.local import alive
from swarm.store import keys
from swarm.store.connection import open_store
from swarm.text import plural

STATE_COLOR = {"running": "yellow", "parked": "blue", "done": "green", "failed": "red",
               "timed_out": "red", "cancelled": "magenta", "refused": "red"}


def prices_from_env() -> Prices:
    """``SWARM_PRICE_INPUT`` / ``SWARM_PRICE_OUTPUT``, or a clear error."""
    try:
        return Prices.from_env()
    except ValueError as exc:
        raise Abort(str(exc)) from None


def load_view(reader: SwarmReader, swarm_id: str | None, *,
              root_answer: bool = False) -> SwarmView:
    """The view of ``swarm_id``, or of the latest swarm when None; Abort if absent."""
    swarm_id = swarm_id or reader.latest()
    if not swarm_id:
        raise Abort("no swarm yet: a swarm starts when an agent first calls the agent tool")
    view = reader.load(swarm_id, root_answer=root_answer)
    if view is None:
        raise Abort(f"no swarm {swarm_id!r} in this Redis (ledger entries expire after 7 "
                    "days); `swarm status` with no id shows the latest")
    return view


def _state(state: str, color: bool) -> str:
    text = f"{state:<9}"
    return click.style(text, fg=STATE_COLOR.get(state)) if color else text


def agent_line(agent: AgentView, now: float, color: bool = False) -> str:
    """One agent: state, depth, elapsed, turns, tokens, then (indented as in the tree) its
    id, label and what it did last (or its error)."""
    doing = agent.doing()
    if agent.landing in ("conflict", "failed", "kept"):
        doing = f"work {'not landed: ' if agent.landing != 'kept' else ''}{agent.landing}" \
            + (f"; {doing}" if doing else "")
    elif agent.landing == "landed":
        doing = "landed" + (f"; {doing}" if doing else "")
    return (f"{_state(agent.state, color)} d{agent.depth}  "
            f"{fmt_duration(agent.elapsed(now)):>7}  {agent.turns or '-':>3} "
            f"{'turn ' if agent.turns == 1 else 'turns'}  "
            f"{fmt_tokens(agent.tokens) if agent.tokens else '-':>6} tok  "
            f"{'  ' * agent.level}{agent.id}{f' [{agent.type}]' if agent.type else ''}  "
            f"{agent.label[:50]}"
            + (f"  | {doing[:100]}" if doing else ""))


def tree_lines(view: SwarmView, color: bool = False) -> list[str]:
    """Failures first (with their error), then every agent as an indented tree."""
    lines: list[str] = []
    failures = view.failures()
    if failures:
        lines.append(f"failures ({len(failures)}):")
        for agent in failures:
            lines.append(f"  {agent.id}  {_state(agent.state, color).rstrip()}  "
                         f"{agent.label[:50]}: {first_line(agent.error, 300) or '(no error)'}")
        lines.append("agents:")
    lines.extend(agent_line(a, view.taken, color) for a in view.agents)
    return lines


def worker_sandboxes(redis_: redis.Redis, workers: list[str]) -> dict[str, list[str]]:
    """Live workers by where they run commands (what each reports with its heartbeat)."""
    found: dict[str, list[str]] = {}
    lines = redis_.mget([keys.worker_sandbox(w) for w in workers]) if workers else []
    for name, line in zip(workers, lines, strict=True):
        found.setdefault(str(line or "not reported (an older worker)"), []).append(name)
    return found


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("swarm_id", required=False)
@click.option("--json", "as_json", is_flag=True,
              help="Every agent as JSON (id, parent, state, depth, type, usage, timings, "
                   "error), and the totals (per agent type too).")
@handle_errors
def status(swarm_id: str | None, as_json: bool) -> None:
    """Show the agents of SWARM_ID (default: the latest swarm) as a tree.

    Failures come first with their error; each agent shows its state, depth, elapsed time,
    turns, tokens and last command. With declared agent types, the tokens per type come
    after the summary. SWARM_PRICE_INPUT / SWARM_PRICE_OUTPUT (dollars per million tokens)
    add an estimated cost.
    """
    prices = prices_from_env()
    with open_store(settings_from()) as store:
        view = load_view(SwarmReader(store.redis), swarm_id)
        workers, coordinators = alive(store.redis, "worker"), alive(store.redis, "coordinator")
        boxes = worker_sandboxes(store.redis, workers)
    if as_json:
        click.echo(json.dumps(view.to_json(prices), indent=2, ensure_ascii=False))
        return
    color = sys.stdout.isatty()
    click.echo(view.summary(prices))
    for line in view.type_lines(prices):
        click.echo(line)
    click.echo(f"  {view.info.get('workspace', '')}  task: "
               f"{first_line(view.info.get('task', ''), 80)}")
    click.echo(f"  {plural(len(workers), 'worker')}, "
               f"{plural(len(coordinators), 'coordinator')} alive; "
               "Flower: `swarm flower` (http://127.0.0.1:5555); `swarm logs AGENT_ID` shows "
               "a conversation")
    for line in tree_lines(view, color):
        click.echo(line)
    for summary, names in boxes.items():
        click.echo(f"sandbox of {', '.join(names)}: {summary}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("swarm_id", required=False)
@click.option("--interval", type=click.FloatRange(min=0.1), default=0.5, show_default=True,
              help="Seconds between reads of the ledger.")
@handle_errors
def top(swarm_id: str | None, interval: float) -> None:
    """Watch SWARM_ID (default: the latest swarm) live until it settles or Ctrl-C.

    On a terminal: the live tree of `swarm run`. Piped: its progress events as plain
    lines, then a summary line.
    """
    from swarm.cli.live import LiveTree

    prices = prices_from_env()
    with open_store(settings_from()) as store:
        reader = SwarmReader(store.redis)
        view = load_view(reader, swarm_id)
        live = LiveTree(store.redis, view.swarm_id, console=Console(), prices=prices)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a user leaves top
            live.follow(interval)
