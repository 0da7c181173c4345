"""Cancelling an agent and its whole subtree.

``swarm cancel ID`` flags the agent and every descendant; workers see the flag within a
second (between steps, and while a command runs, whose process group they kill) and
settle the agent as ``cancelled``; queued children are settled when they are claimed,
and new spawns of a cancelled parent are refused. The parents receive ``cancelled``
results as usual.
"""

from __future__ import annotations

import time

from swarm.store import keys
from swarm.store.ledger import SETTLED, Ledger


def subtree(agents: list[dict[str, str]], agent_id: str) -> list[str]:
    """``agent_id`` and all its descendants, parents before children."""
    children: dict[str, list[str]] = {}
    for a in agents:
        children.setdefault(a.get("parent", ""), []).append(a["id"])
    out, todo = [], [agent_id]
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def cancel(ledger: Ledger, agent_id: str, reason: str = "cancelled by swarm cancel"
           ) -> list[str]:
    """Flag ``agent_id`` (an agent or a swarm id) and its subtree; returns the ids flagged
    that had not settled yet. Idempotent."""
    record = ledger.agent(agent_id)
    if not record:
        return []
    swarm_id = record["swarm"]
    agents = ledger.agents(swarm_id)
    states = {a["id"]: a.get("state", "") for a in agents}
    ids = subtree(agents, agent_id)
    with ledger.redis.pipeline() as pipe:
        for aid in ids:
            pipe.set(keys.cancel(aid), reason, ex=keys.LEDGER_TTL)
        pipe.xadd(keys.events(swarm_id), {"kind": "cancel", "agent": agent_id,
                                          "text": reason, "ts": f"{time.time():.3f}"},
                  maxlen=keys.EVENTS_MAXLEN, approximate=True)
        pipe.execute()
    # Children held back by the in-flight limit would wait for a slot just to stop:
    # settle them now (settling is idempotent, so a race with a release is harmless).
    for agent in agents:
        if agent["id"] in ids and agent.get("state") == "waiting" and agent.get("run"):
            run = ledger.run(agent["run"])
            if run is not None:
                ledger.redis.lrem(keys.swarm_waiting(swarm_id), 0, run.id)
                ledger.settle(run, swarm_id, "cancelled", {"error": reason}, {})
    return [aid for aid in ids if states.get(aid) not in SETTLED]
