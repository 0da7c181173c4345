"""``swarm status``: the tree of a swarm's agents from the ledger."""

from __future__ import annotations

import json
import time

import click

from swarm.cli.main import Abort, handle_errors, settings_from
from swarm.store.connection import open_store
from swarm.store.ledger import Ledger
from swarm.workers.local import alive


def _elapsed(agent: dict[str, str]) -> str:
    start = float(agent.get("started") or agent.get("created") or 0)
    end = float(agent.get("settled") or 0) or time.time()
    return f"{max(0.0, end - start):.1f}s" if start else "-"


def _tokens(agent: dict[str, str]) -> int:
    try:
        return int(json.loads(agent.get("usage") or "{}").get("total_tokens", 0))
    except (ValueError, AttributeError):
        return 0


def tree_lines(agents: list[dict[str, str]]) -> list[str]:
    """The agents as an indented tree, children under their parents in creation order."""
    children: dict[str, list[dict[str, str]]] = {}
    for a in agents:
        children.setdefault(a.get("parent", ""), []).append(a)
    lines: list[str] = []

    def walk(agent: dict[str, str], indent: int) -> None:
        last = agent.get("last", "")
        lines.append(
            f"{'  ' * indent}{agent['id']}  {agent.get('state', '?'):<9} depth "
            f"{agent.get('depth', '?')}  {_elapsed(agent):>7}  {_tokens(agent):>7} tok  "
            f"{agent.get('label', '')[:50]}" + (f"  | {last[:60]}" if last else ""))
        for child in children.get(agent["id"], []):
            walk(child, indent + 1)

    for root in children.get("", []):
        walk(root, 0)
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("swarm_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Every agent as JSON, for scripts.")
@handle_errors
def status(swarm_id: str | None, as_json: bool) -> None:
    """Show the agents of SWARM_ID (default: the latest swarm) as a tree."""
    settings = settings_from()
    with open_store(settings) as store:
        ledger = Ledger(store.redis)
        swarm_id = swarm_id or ledger.latest_swarm()
        if not swarm_id:
            raise Abort("no swarm yet: a swarm starts when an agent first calls the agent tool")
        info = ledger.swarm(swarm_id)
        if not info:
            raise Abort(f"no swarm {swarm_id!r} (it may have expired)")
        agents = ledger.agents(swarm_id)
        workers, coordinators = alive(store.redis, "worker"), alive(store.redis, "coordinator")
    if as_json:
        click.echo(json.dumps({"swarm": info, "agents": agents}, indent=2))
        return
    counts: dict[str, int] = {}
    for a in agents:
        counts[a.get("state", "?")] = counts.get(a.get("state", "?"), 0) + 1
    click.echo(f"swarm {swarm_id}  {info.get('state', '?')}  {info.get('workspace', '')}")
    click.echo("  " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) +
               f"  | {len(workers)} worker(s), {len(coordinators)} coordinator(s) alive; "
               "Flower: `swarm flower` (http://127.0.0.1:5555)")
    for line in tree_lines(agents):
        click.echo(line)
