"""The root agent's side of berserk mode, in the user's terminal.

The root creates its swarm the first time its model calls ``agent``, makes sure a
coordinator and workers are there (on the embedded default, local ones, which ``swarm
run`` starts in the background as it starts: :meth:`RootSwarm.prestart`), parks while the
children work — showing their progress — and carries on when the coordinator wakes it
with their results.

Over 400 lines because it is one object's life (:class:`RootSwarm`: create the swarm, start
its runtime, park, wait showing progress, bring the children's work home, finish), whose
steps share its state.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import redis

from swarm import faults
from swarm.agent import sandbox
from swarm.agent.agent_types import AgentTypes
from swarm.agent.loop import Agent
from swarm.config import Settings
from swarm.domain.approval import ApprovalRequest, Decision
from swarm.domain.history import repair
from swarm.domain.records import AgentRecord, RootEnd, RootStart, usage_since
from swarm.domain.session import Session
from swarm.errors import BudgetExceeded, Cancelled, Parked
from swarm.mcp_client.config import McpConfig
from swarm.runtime.local import LocalCluster, alive, shared, wait_for
from swarm.runtime.spawner import RedisSpawner, limits_of
from swarm.store import keys
from swarm.store.approvals import ApprovalQueue
from swarm.store.connection import Outage, Store
from swarm.store.ledger import Ledger, new_swarm_id
from swarm.store.mailbox import Mailbox
from swarm.store.sessions import RedisSessionStore
from swarm.store.snapshots import SnapshotStore
from swarm.text import plural
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming, sweep
from swarm.workspace.seed import Seeds

#: What the children inherit from the root's settings (never secrets).
INHERITED = ("model", "base_url", "yes", "max_turns", "child_max_turns", "repeat_limit",
             "approval", "max_depth", "max_children", "max_parallel", "token_budget",
             "child_timeout", "command_timeout", "command_timeout_max", "output_cap",
             "context_length", "stream", "approval_timeout", "mcp_start_timeout",
             "snapshot_max", "snapshot_swarm_max", "answer_max", "call_timeout")
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
    notice: Callable[[str], None] = lambda text: None
    """Shows the person a one-line notice (Redis went away, and came back)."""
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
    mcp: McpConfig = field(default_factory=McpConfig)
    """The root's MCP servers, recorded with the swarm for its children (as configured:
    ``${VAR}`` references, never their values)."""
    types: AgentTypes = field(default_factory=AgentTypes)
    """The agent types its children may be, recorded with the swarm (read from its folder
    as it started, never again)."""
    start: RootStart | None = field(default=None, init=False)
    """Its folder's session as this run began (the swarm's figures are what it adds)."""
    _last_event: str = field(default="0-0", init=False)
    tree: g.WorkTree | None = field(default=None, init=False)
    """The git work tree of the root's folder, found before its commands ran."""
    landings: list[homecoming.Landing] = field(default_factory=list, init=False)
    """What each homecoming of its children's work did (:meth:`landed`)."""
    _told_unboxed: bool = field(default=False, init=False)
    _counted: int | None = field(default=None, init=False)
    """The root's tokens (its session's) counted in the swarm's so far (None: not counting:
    no token budget)."""
    _agent: Agent | None = field(default=None, init=False)
    outage: Outage = field(kw_only=True)
    """Rides out a Redis restart in its reads and writes: the one of its session's saves
    and lock (:attr:`~swarm.runtime.build.LocalRun.outage`)."""

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.store.redis)
        self.seeds = Seeds(SnapshotStore(self.store.redis), self.settings.home,
                           socket.gethostname(), self.settings.snapshot_max,
                           self.settings.snapshot_swarm_max)

    def spawner(self, store: Store, session: Session) -> RedisSpawner:
        self.session = session
        self.start = RootStart(dict(session.usage), session.turns, session.created)
        self.swarm_id = self.swarm_id or new_swarm_id()
        workspace = Path(session.workspace)
        # Its repository is found now, before its commands run, and kept.
        self.tree = self.seeds.pinned(f"root:{session.id}", workspace)
        # Each step is safe to repeat: the swarm is created once, a snapshot stored once.
        return RedisSpawner(self.ledger, self.swarm_id, self.swarm_id,
                            ensure_swarm=lambda: self.outage.ride(self.ensure),
                            seeder=lambda: self.outage.ride(lambda: self.seeds.take(
                                workspace, self.swarm_id, tree_of=self.tree)),
                            host=self.seeds.host, outage=self.outage,
                            limits=limits_of(self.settings))

    def ensure(self) -> None:
        """Create the swarm in the ledger and make sure someone will run its children."""
        assert self.session is not None
        inherited = self.inherited()
        if not self.ledger.swarm(self.swarm_id):
            self.ledger.create_swarm(self.swarm_id, self.swarm_id, self.session.workspace,
                                     self.task, inherited, socket.gethostname(), self.session.id,
                                     mcp=self.mcp.to_json(), types=self.types.to_json(),
                                     start=self.start,
                                     unconfined=self.unconfined)
        self.ensure_runtime()
        # What swarms that ended long ago left in SWARM_HOME and the repository's refs.
        sweep.soon(self.settings.home, self.store.redis, (Path(self.session.workspace),))

    def local_workers(self) -> int:
        """Local worker processes this root needs: ``workers`` if given; else, on the
        embedded default, 1 unless a coordinator and a worker already serve this Redis
        (another run's own local processes do not count: they stop with it)."""
        if self.workers is not None:
            return self.workers
        if not self.store.embedded:
            return 0
        redis_ = self.store.redis
        running = shared(alive(redis_, "coordinator")) and shared(alive(redis_, "worker"))
        return 0 if running else 1

    @property
    def unconfined(self) -> bool:
        """It runs its commands unconfined (no ``SWARM_SANDBOX`` given) on its own embedded
        server: its local workers run its children unconfined too where they cannot box
        them (a deployment's workers never do)."""
        return self.store.embedded and "sandbox" not in self.settings.explicit

    def prestart(self) -> None:
        """Start the local coordinator and workers now, in the background, if this root
        would need them: they boot while the model thinks, and are ready (or nearly) when
        it first calls ``agent``. A job that never does lets them go at the end."""
        if self.cluster is None and (workers := self.local_workers()):
            self.cluster = LocalCluster(self.store.url, self.settings.home, workers,
                                        self.settings.max_parallel,
                                        embedded=self.store.embedded,
                                        master=self.store.master,
                                        fallback=self.unconfined).start()

    def ensure_runtime(self) -> None:
        """Make sure a coordinator and workers serve this Redis (start local ones if asked)."""
        self.prestart()
        if self.cluster is not None:
            wait_for(self.store.redis, 30.0, self.cluster.procs, self.cluster.names)
            self.tell_unboxed()
        else:
            wait_for(self.store.redis, ANSWER_TIMEOUT)

    def tell_unboxed(self) -> None:
        """Say once, not for each child, that its local workers run its children unconfined
        (they cannot box them here), and why."""
        assert self.cluster is not None
        names = [name for kind, name in self.cluster.names if kind == "worker"]
        if self._told_unboxed or not self.cluster.fallback or not names:
            return
        said = self.store.redis.mget([keys.worker_sandbox(name) for name in names])
        why = sandbox.unboxed(str(s) for s in said if s)
        if why:
            self._told_unboxed = True
            self.notice("no sandbox on this machine, so the root and its local children run "
                        f"commands unconfined: {why}")

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
        if agent.mcp is not None:
            self.mcp = agent.mcp.config
        if agent.types is not None:
            self.types = agent.types
        self.limit(agent)
        self.listen(agent)
        try:
            return agent.run(task)
        except Parked as parked:
            return self.carry_on(agent, parked.request_id, sessions)

    def attach(self, agent: Agent, sessions: RedisSessionStore) -> str:
        """Take over a root whose terminal went away: wait for its children, then finish."""
        self.model_id = agent.model.model
        self.limit(agent)
        self.listen(agent)
        self.ensure_runtime()
        parked = agent.session.parked
        if parked and self.outage.ride(partial(self.ledger.request, parked)) is not None:
            return self.carry_on(agent, parked, sessions)
        if parked:  # its terminal went between saving it parked and parking: answer the calls
            agent.session.messages = repair(agent.session.messages)
            agent.session.parked = ""
            agent.save()
        last = agent.messages[-1] if agent.messages else {}
        if last.get("role") == "assistant" and not last.get("tool_calls"):
            return str(last.get("content") or "")
        try:
            return agent.resume()
        except Parked as parked:
            return self.carry_on(agent, parked.request_id, sessions)

    def listen(self, agent: Agent) -> None:
        """Give the root its mailbox: its agent id is its swarm's (``swarm say SWARM_ID``),
        and land the work of background children's results it takes (``agent_join``)."""
        agent.mailbox = Mailbox(self.store.redis, self.swarm_id, self.outage)
        if isinstance(agent.spawner, RedisSpawner):
            agent.spawner.lander = partial(self.land_taken, agent)
            if isinstance(agent.store, RedisSessionStore):
                agent.spawner.sessions = agent.store

    def land_taken(self, agent: Agent, session: Session) -> None:
        landing = self.outage.ride(partial(self.bring_home, agent, session))
        if landing is not None:
            self.outage.ride(partial(self.ledger.landed, self.swarm_id, dict(landing.children)))
            self.landings.append(landing)

    def limit(self, agent: Agent) -> None:
        """Count the root's tokens in its swarm's and stop it before a model call once the
        swarm (the root, and every child) has used ``SWARM_TOKEN_BUDGET``."""
        if not self.settings.token_budget or agent.before_step == self.before_step:
            return
        if self._counted is None:
            self._counted = agent.session.usage.get("total_tokens", 0)
        self._agent, agent.before_step = agent, self.before_step

    def before_step(self, agent: Agent) -> None:
        spent = self.outage.ride(partial(self.count, agent.session))
        budget = self.settings.token_budget
        if spent >= budget:
            raise BudgetExceeded(f"the swarm used {spent} tokens of its budget of {budget} "
                                 "(SWARM_TOKEN_BUDGET)")

    def count(self, session: Session) -> int:
        """Add the root's tokens since the last count to its swarm's; returns the swarm's.
        Safe to repeat: tokens are taken as counted before they are sent (a count lost
        with Redis is not sent again, never twice)."""
        used = session.usage.get("total_tokens", 0)
        new, self._counted = used - (self._counted or 0), used
        if new > 0:
            return self.ledger.spend(self.swarm_id, new)
        return self.ledger.counters(self.swarm_id).get("tokens", 0)

    def carry_on(self, agent: Agent, request_id: str, sessions: RedisSessionStore) -> str:
        """Wait for the request's children, resume, and repeat until an answer."""
        while True:
            self.wait(request_id)
            faults.point("root-children-settled")
            loaded = sessions.load(agent.session.id)
            assert loaded is not None, "the root session vanished while it was parked"
            # The children's work lands in the workspace before the root goes on.
            landing = self.outage.ride(partial(self.bring_home, agent, loaded))
            if landing is not None:
                sessions.save(loaded)
                self.outage.ride(partial(self.ledger.landed, self.swarm_id,
                                         dict(landing.children), request_id))
                self.landings.append(landing)
            agent.session = loaded
            try:
                return agent.resume()
            except Parked as parked:
                request_id = parked.request_id

    def bring_home(self, agent: Agent, loaded: Session) -> homecoming.Landing | None:
        """Land the children's work in the root's workspace, its lock still its own. The
        work is read from Redis before any file is written: a landing that met a Redis
        outage can start over."""
        if agent.guard is not None:
            agent.guard()
        return homecoming.bring_home(
            self.seeds, loaded, Path(loaded.workspace), self.swarm_id, self.tree,
            run_check=homecoming.checker(agent.env, self.settings.command_timeout),
            check=self.settings.land_check)

    def wait(self, request_id: str) -> None:
        """Block until the coordinator wakes this root for ``request_id``; relay progress,
        put the children's approval requests to the person, stop on ``swarm cancel``."""
        queue = ApprovalQueue(self.store.redis, self.swarm_id)
        asked: set[str] = set()
        # A Redis restart while the children work is ridden out: they go on meanwhile.
        while True:
            try:
                woken = self.ledger.wait_woken(self.swarm_id, timeout=0.5)
                self.relay_events()
                # Checked even when woken: a cancel settles the children fast enough for
                # the join to wake the root before it looked; a cancelled root stops.
                reason = self.ledger.cancel_reason(self.swarm_id)
                if reason is not None:
                    raise Cancelled(f"swarm {self.swarm_id} was cancelled: {reason}")
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
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self.outage.failed(exc)
                continue
            self.outage.ok()

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

    def landed(self) -> str:
        """A line on what its children's work did to its folder ("" when none sent any)."""
        return homecoming.summary(self.landings)

    def finish(self, state: str, session: Session | None = None, answer: str = "",
               error: str = "") -> None:
        """Settle its swarm (or mark it detached), keeping what the root did in it: the
        folder's session goes on with later runs, the swarm's record does not."""
        if self.detached:
            state = "detached"
        if self.session is None:
            return
        faults.point("root-before-finish")

        def finish() -> None:
            if self._counted is not None and self._agent is not None:
                self.count(self._agent.session)  # its last tokens
            record = self.ledger.agent(self.swarm_id)
            if record is None:
                return
            end = None
            if session is not None:
                end = RootEnd(usage_since(session.usage, record.base_usage),
                              max(0, session.turns - record.base_turns), session.turns,
                              answer=answer, error=error)
            self.ledger.finish_swarm(self.swarm_id, state, root_id=self.swarm_id, end=end)

        self.outage.ride(finish)  # a swarm settles once: safe to repeat

    def close(self) -> None:
        """Let the local processes go (they stop on their own; the process need not wait)."""
        if self.cluster is not None:
            self.cluster.let_go(self.store.redis)
            self.cluster = None


def moved_on(ledger: Ledger, record: AgentRecord, session: Session | None) -> str:
    """Why the folder's conversation is no longer the one the swarm of root ``record``
    left ("" while it still is): ``swarm attach`` resumes only that one."""
    if session is None:
        return "its folder's conversation was deleted (`swarm sessions clear`)"
    if record.session_created and abs(session.created - record.session_created) > 1e-3:
        return "a later `swarm run --new` in its folder started another conversation"
    if session.parked:
        request = ledger.request(session.parked)
        if request is not None and request.swarm != record.swarm:
            return "a later run in its folder is waiting for children of its own"
    elif record.kept and session.turns != record.session_turns:
        return "a later run in its folder went on with its conversation"
    return ""


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
    if kind == "landed":
        return f"[{who}] its work: {event.get('landing', '')}"
    if kind == "message":
        return f"[{who}] told: {(str(event.get('text', '')).splitlines() or [''])[0][:200]}"
    if kind == "wait":
        count = str(event.get("children", ""))
        children = plural(int(count), "child", "children") if count.isdigit() else "children"
        return f"[{who}] waits for {children} it started in the background"
    if kind in ("spawn", "dispatched", "joined"):
        count = str(event.get("children", ""))
        children = plural(int(count), "child", "children") if count.isdigit() else "children"
        refused = str(event.get("refused", ""))
        more = f", {refused} refused" if refused.isdigit() and int(refused) else ""
        return f"[{who}] {'asked for' if kind == 'spawn' else kind} {children}{more}"
    return f"[{who}] {kind}"

