"""The root agent's side of berserk mode, in the user's terminal.

The root creates its swarm the first time its model calls ``agent``, makes sure a
coordinator and workers are there (starting local ones on the embedded default),
parks while the children work — showing their progress — and carries on when the
coordinator wakes it with their results.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.agent.loop import Agent
from swarm.config import Settings
from swarm.domain.approval import ApprovalRequest, Decision
from swarm.domain.session import Session
from swarm.errors import Cancelled, Parked
from swarm.runtime.local import LocalCluster, alive, wait_for
from swarm.runtime.seed import Seeds
from swarm.runtime.spawner import RedisSpawner
from swarm.store.approvals import ApprovalQueue
from swarm.store.connection import Store
from swarm.store.ledger import Ledger, new_swarm_id
from swarm.store.sessions import RedisSessionStore
from swarm.store.snapshots import SnapshotStore
from swarm.text import plural

#: What the children inherit from the root's settings (never secrets).
INHERITED = ("model", "base_url", "yes", "max_turns", "approval", "max_depth", "max_children",
             "max_parallel", "token_budget", "child_timeout", "command_timeout",
             "command_timeout_max", "output_cap", "context_length", "stream", "approval_timeout",
             "snapshot_max", "snapshot_swarm_max")
#: Seconds to wait for a deployment's coordinator and workers to answer.
ANSWER_TIMEOUT = 5.0


@dataclass
class RootSwarm:
    """Berserk mode for one root agent; use :meth:`spawner` when building the agent."""

    settings: Settings
    store: Store
    workers: int | None = None
    """Local worker processes to start; None: 1 on the embedded default, 0 otherwise."""
    on_event: Callable[[dict[str, str]], None] = lambda event: None
    ask: Callable[[ApprovalRequest], Decision] | None = None
    """Puts a child's approval request to the person at this terminal (None: nobody)."""
    swarm_id: str = ""
    cluster: LocalCluster | None = None
    session: Session | None = None
    task: str = ""
    detached: bool = False
    """The root left while its children go on (``swarm attach`` picks it up)."""
    model_id: str = ""
    """The model the root resolved; children use the same one."""
    _last_event: str = field(default="0-0", init=False)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.store.redis)
        self.seeds = Seeds(SnapshotStore(self.store.redis), self.settings.home,
                           socket.gethostname(), self.settings.snapshot_max,
                           self.settings.snapshot_swarm_max)

    def spawner(self, store: Store, session: Session) -> RedisSpawner:
        self.session = session
        self.swarm_id = self.swarm_id or new_swarm_id()
        workspace = Path(session.workspace)
        return RedisSpawner(self.ledger, self.swarm_id, self.swarm_id,
                            ensure_swarm=self.ensure,
                            seeder=lambda: self.seeds.take(workspace, self.swarm_id),
                            host=self.seeds.host)

    def ensure(self) -> None:
        """Create the swarm in the ledger and make sure someone will run its children."""
        assert self.session is not None
        inherited = self.inherited()
        if not self.ledger.swarm(self.swarm_id):
            self.ledger.create_swarm(self.swarm_id, self.swarm_id, self.session.workspace,
                                     self.task, inherited, socket.gethostname(), self.session.id)
        self.ensure_runtime()

    def ensure_runtime(self) -> None:
        """Make sure a coordinator and workers serve this Redis (start local ones if asked)."""
        redis_ = self.store.redis
        if self.workers is None:
            # Embedded default: start local processes unless some already serve this Redis.
            running = alive(redis_, "coordinator") and alive(redis_, "worker")
            workers = 1 if self.store.embedded and not running else 0
        else:
            workers = self.workers
        if workers:
            self.cluster = LocalCluster(self.store.url, self.settings.home, workers,
                                        self.settings.max_parallel).start()
            wait_for(redis_, 30.0, self.cluster.procs)
        else:
            wait_for(redis_, ANSWER_TIMEOUT)

    def inherited(self) -> dict[str, Any]:
        """The root's settings its children use: those the user gave (flags, environment),
        never defaults, so a deployment's own settings apply to everything else."""
        given = {name: getattr(self.settings, name) for name in INHERITED
                 if name in self.settings.explicit}
        if self.model_id:
            given["model"] = self.model_id
        return given

    def run(self, agent: Agent, task: str, sessions: RedisSessionStore) -> str:
        """``agent.run(task)``, parking and resuming as often as the model goes berserk."""
        self.task = task
        self.model_id = agent.model.model
        try:
            return agent.run(task)
        except Parked as parked:
            return self.carry_on(agent, parked.request_id, sessions)

    def attach(self, agent: Agent, sessions: RedisSessionStore) -> str:
        """Take over a root whose terminal went away: wait for its children, then finish."""
        self.model_id = agent.model.model
        self.ensure_runtime()
        if agent.session.parked:
            return self.carry_on(agent, agent.session.parked, sessions)
        last = agent.messages[-1] if agent.messages else {}
        if last.get("role") == "assistant" and not last.get("tool_calls"):
            return str(last.get("content") or "")
        try:
            return agent.resume()
        except Parked as parked:
            return self.carry_on(agent, parked.request_id, sessions)

    def carry_on(self, agent: Agent, request_id: str, sessions: RedisSessionStore) -> str:
        """Wait for the request's children, resume, and repeat until an answer."""
        while True:
            self.wait(request_id)
            loaded = sessions.load(agent.session.id)
            assert loaded is not None, "the root session vanished while it was parked"
            # The children's work comes home (branches, files) before the root goes on.
            if self.seeds.bring_home(loaded, Path(loaded.workspace), self.swarm_id):
                sessions.save(loaded)
            agent.session = loaded
            try:
                return agent.resume()
            except Parked as parked:
                request_id = parked.request_id

    def wait(self, request_id: str) -> None:
        """Block until the coordinator wakes this root for ``request_id``; relay progress,
        put the children's approval requests to the person, stop on ``swarm cancel``."""
        queue = ApprovalQueue(self.store.redis, self.swarm_id)
        asked: set[str] = set()
        while True:
            woken = self.ledger.wait_woken(self.swarm_id, timeout=0.5)
            self.relay_events()
            # Checked even when woken: a cancel settles the children fast enough for the
            # join to wake the root before it looked; a cancelled root does not go on.
            if self.ledger.is_cancelled(self.swarm_id):
                raise Cancelled(f"swarm {self.swarm_id} was cancelled")
            if woken == request_id:
                return
            if self.ask is not None:
                for pending in queue.pending():
                    if pending.id in asked:
                        continue
                    asked.add(pending.id)
                    decision = self.ask(ApprovalRequest(
                        pending.tool, {}, pending.summary, pending.reason, pending.agent))
                    queue.answer(pending.id, decision)

    def relay_events(self) -> None:
        for entry_id, fields in self.ledger.events_since(self.swarm_id, self._last_event):
            self._last_event = entry_id
            self.on_event(fields)

    def on_interrupt(self) -> str:
        """The root was interrupted while it had children: on the embedded default they
        are cancelled (their workers stop with this process); on a deployment they keep
        going. Returns a note for the user."""
        if not self.session or not self.ledger.swarm(self.swarm_id):
            return ""
        if self.store.embedded:
            self.ledger.cancel(self.swarm_id, "the root was interrupted")
            return "; its children were cancelled"
        self.detached = True
        return (f"; its children keep running: `swarm attach {self.swarm_id}` collects the "
                "answer, `swarm cancel` stops them")

    def finish(self, state: str) -> None:
        if self.detached:
            state = "detached"
        if self.session is not None and self.ledger.swarm(self.swarm_id):
            self.ledger.finish_swarm(self.swarm_id, state, root_id=self.swarm_id)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def describe(event: dict[str, Any]) -> str:
    """One plain line for a progress event."""
    who = event.get("agent", "?")
    kind = event.get("kind", "")
    if kind == "tool":
        return f"[{who}] {event.get('text', '')}"
    if kind == "queued":
        return f"[{who}] queued at depth {event.get('depth', '?')} by {event.get('parent', '?')}"
    if kind == "settled":
        return f"[{who}] {event.get('state', '')}"
    if kind in ("spawn", "dispatched", "joined"):
        count = str(event.get("children", ""))
        children = plural(int(count), "child", "children") if count.isdigit() else "children"
        return f"[{who}] {kind} {children}"
    return f"[{who}] {kind}"

