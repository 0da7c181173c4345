"""Wiring: build an :class:`Agent` for a workspace from :class:`Settings`.

The CLI (the root agent) and the workers (children) both build agents with
:func:`build_agent`, so there is one place that decides which environment, tools,
approvals, hints and prompt an agent gets (the model is the caller's).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from swarm.agent import agent_types, sandbox
from swarm.agent.agent_types import AgentType, AgentTypes
from swarm.agent.approval import ApprovalGate, LLMReviewer
from swarm.agent.folder import AgentFolder
from swarm.agent.loop import Agent, AgentConfig, Observer
from swarm.agent.probe import probe_environment, tool_versions
from swarm.agent.prompts import PromptParts, system_prompt
from swarm.agent.protocols import Approver, HintStore, Mailbox, Model, SessionStore, Spawner
from swarm.agent.sandbox import Box
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings
from swarm.domain import history
from swarm.domain.session import Session
from swarm.errors import LockError
from swarm.llm.client import LLMClient
from swarm.mcp_client import config as mcp_config
from swarm.mcp_client.config import McpConfig
from swarm.store import keys
from swarm.store.connection import Outage, Store, open_store
from swarm.store.hints import HomeHints
from swarm.store.locks import RedisLock
from swarm.store.sessions import RedisSessionStore

if TYPE_CHECKING:
    from swarm.mcp_client.tools import McpTools


def new_session(workspace: Path, session_id: str = "") -> Session:
    now = time.time()
    return Session(id=session_id or keys.session_id_for(str(workspace)),
                   workspace=str(workspace), messages=[], usage={}, created=now, updated=now)


def tools_cache(settings: Settings) -> Path:
    """Where the tools' versions are kept between processes (see swarm.agent.probe)."""
    return settings.home / "cache" / "tools.json"


def prompt_builder(workspace: Path, folder: AgentFolder, extra: str = "",
                   tools_file: Path | None = None, kind: AgentType | None = None,
                   preface: tuple[str, str] | None = None) -> Callable[[str], str]:
    """A function of the memory hints that gives the whole system prompt.

    The environment probe and the agent folder are read once per agent, not per turn. An
    agent of a declared type ``kind`` has its instructions in place of swarm's and of the
    folder's (unless it inherits those), and its skills only when it has ``load_skill``.
    ``preface`` (listing, instructions) stands in for the workspace's top level and
    instruction files while they are still arriving (a seeded child's).
    """
    parts = PromptParts(
        environment=probe_environment(workspace, tools_file,
                                      preface[0] if preface is not None else None),
        instructions=(folder.instructions() if preface is None else preface[1])
        if kind is None or "instructions" in kind.inherit else "",
        skills=[(s.name, s.summary) for s in folder.skills()]
        if kind is None or kind.allows("load_skill") else [],
        tool_errors=folder.typed_tools()[1],
        extra=extra,
    )
    if kind is not None:
        parts = dataclasses.replace(parts, base=kind.instructions or (
            f"You are an agent of type {kind.name}: {kind.description}"))

    def build(hints: str) -> str:
        return system_prompt(dataclasses.replace(parts, hints=hints))

    return build


def build_agent(
    settings: Settings,
    workspace: Path,
    model: Model,
    session: Session,
    *,
    store: SessionStore | None,
    hints: HintStore,
    approver: Approver,
    observer: Observer | None = None,
    spawner: Spawner | None = None,
    extra_prompt: str = "",
    agent_id: str = "",
    cancel: threading.Event | None = None,
    guard: Callable[[], None] | None = None,
    before_step: Callable[[Agent], None] | None = None,
    mailbox: Mailbox | None = None,
    mcp: McpConfig | None = None,
    read_only: tuple[Path, ...] = (),
    die_with_runner: bool = False,
    linked: Path | None = None,
    beneath: Path | None = None,
    boxed_mcp: bool = False,
    hidden: tuple[Path, ...] = (),
    kind: str = "root",
    types: AgentTypes | None = None,
    agent_type: AgentType | None = None,
    preface: tuple[str, str] | None = None,
) -> Agent:
    """An agent for ``workspace`` with every collaborator it needs.

    ``cancel`` kills a running command (and abandons an MCP call) when set; ``guard`` and
    ``before_step`` are the agent's (:class:`Agent`): the root's session lock, a child's
    limits; so is ``mailbox``, what people tell it while it works. ``mcp`` lists its MCP
    servers (a root reads them from its folder, a child inherits its swarm's).
    ``read_only`` folders are seen by sandboxed commands (the objects a child's repository
    borrows). With ``die_with_runner`` (a worker's children) an unconfined
    command dies with the process that runs it. ``linked``: a view's upper folder, where its
    git worktree is registered; ``beneath``: the folder the workspace must lie in, opened
    from there following no symbolic link before the sandbox grants it (a job's jobs root)
    (:class:`LocalEnvironment`). With ``boxed_mcp`` (a worker's children) its stdio MCP
    servers start in the box its commands run in, when they run in one
    (:mod:`swarm.agent.mcp_box`). ``hidden`` folders are hidden from its sandboxed
    commands like ``SWARM_HOME`` (a same-host child's parent's workspace). ``kind`` (root in
    a terminal, job, child) picks its turn limit (:meth:`Settings.turn_limit`). ``types``
    are the declared types its ``agent`` tool may start; ``agent_type`` is its own: its
    instructions, and its tools only (its MCP servers too: those its tools name). Its
    model, approvals and turn limit are the caller's to put in ``settings`` and ``model``.
    ``preface``: see :func:`prompt_builder` (its caller's ``guard`` then holds its tool
    calls until the files are there)."""
    if agent_type is not None and mcp is not None and \
            (servers := agent_type.mcp_servers()) is not None:
        mcp = dataclasses.replace(mcp, servers=tuple(s for s in mcp.servers
                                                     if s.name in servers))
    folder = AgentFolder(workspace)
    env = LocalEnvironment(workspace, output_cap=settings.output_cap, cancel=cancel,
                           sandbox=settings.sandbox, network=sandbox.network_of(settings),
                           limits=sandbox.limits_of(settings), show=sandbox.shown_of(settings),
                           hide=(settings.home, *hidden), read_only=read_only,
                           sandbox_uid=settings.sandbox_uid, pass_env=tuple(
                               n.strip() for n in settings.sandbox_env.split(",") if n.strip()),
                           die_with_runner=die_with_runner, linked=linked, beneath=beneath)
    box = env.choice.box if boxed_mcp else None
    max_turns, limit_name = settings.turn_limit(child=kind == "child")
    if kind == "root" and limit_name == "SWARM_MAX_TURNS":
        limit_name = "--max-turns"
    return Agent(
        model=model,
        env=env,
        gate=ApprovalGate(settings.policy_for, approver, LLMReviewer(model), yes=settings.yes),
        session=session,
        system_prompt=prompt_builder(workspace, folder, extra_prompt, tools_cache(settings),
                                     agent_type, preface),
        store=store,
        hints=hints,
        folder=folder,
        observer=observer or Observer(),
        config=AgentConfig(
            max_turns=max_turns,
            turn_limit_name=limit_name,
            repeat_limit=settings.repeat_limit,
            command_timeout=settings.command_timeout,
            command_timeout_max=settings.command_timeout_max,
            compact_at=settings.compact_at,
            agent_id=agent_id,
        ),
        spawner=spawner,
        guard=guard,
        before_step=before_step,
        mailbox=mailbox,
        mcp=mcp_tools(settings, mcp, cancel, box) if mcp is not None else None,
        types=types,
        kind=agent_type,
    )


def mcp_tools(settings: Settings, mcp: McpConfig, cancel: threading.Event | None,
              box: Box | None = None) -> McpTools | None:
    """The agent's MCP tools (stdio servers started in ``box`` when given, each in a
    folder under ``SWARM_HOME/mcp``); None without servers, and then the MCP SDK (seconds
    to import) is not loaded."""
    if not (mcp.servers or mcp.problems):
        return None
    from swarm.agent.mcp_box import BoxedServers
    from swarm.mcp_client.tools import McpTools

    return McpTools(mcp, log_dir=settings.home / "logs", output_cap=settings.output_cap,
                    call_timeout=settings.command_timeout,
                    start_timeout=settings.mcp_start_timeout, cancel=cancel,
                    launcher=BoxedServers(box, settings.home / "mcp") if box else None)


@dataclass
class LocalRun:
    """The root agent bound to a workspace, with the store it saves to."""

    agent: Agent
    store: Store
    sessions: RedisSessionStore
    resumed: bool
    repaired: bool
    outage: Outage
    """Rides out a Redis restart in its saves, its lock and its swarm's writes."""

    @property
    def redis(self) -> redis.Redis:
        return self.store.redis

    @property
    def unconfined(self) -> str:
        """A one-line notice when the root's commands run unconfined, else ""."""
        env = self.agent.env
        return env.choice.notice if isinstance(env, LocalEnvironment) else ""


def owner_info(workspace: Path) -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "workspace": str(workspace)}


@contextmanager
def local_agent(
    settings: Settings,
    workspace: Path,
    *,
    approver: Approver,
    observer: Observer | None = None,
    new: bool = False,
    spawner: Callable[[Store, Session, Outage], Spawner] | None = None,
    keep_parked: bool = False,
) -> Iterator[LocalRun]:
    """Open the store, lock the workspace's session, and yield a ready root agent.

    The session lock is held until the block exits, so two swarm processes on
    one folder (on one host or two) never interleave. A save, a load or the lock that
    meets a Redis restart waits for Redis to come back (:meth:`Outage.of_root`), saying
    so through ``observer``; a save is tried again only while the lock is still its own.
    ``spawner`` builds the berserk-mode spawner for the session, riding out outages with
    the same :class:`Outage` (None: the ``agent`` tool is not offered).
    A session left parked by a root that went away is repaired (its children's results
    will not come) unless ``keep_parked`` (``swarm attach`` waits for them instead).
    """
    workspace = workspace.resolve()
    # The probe's tool versions take ~0.3 s of subprocesses: gather them while the store
    # starts and the model is looked up.
    threading.Thread(target=tool_versions, args=(tools_cache(settings),), daemon=True,
                     name="probe").start()
    with open_store(settings) as store:
        outage = Outage.of_root(store, settings, (observer or Observer()).on_notice)
        session_id = keys.session_id_for(str(workspace))
        lock = RedisLock(store.redis, keys.session_lock(session_id), ttl=settings.lock_ttl,
                         owner_info=owner_info(workspace), outage=outage)

        def guard() -> None:
            if not lock.check():
                raise LockError(
                    "another swarm process took the lock on this folder's session while this "
                    "one was suspended or could not reach Redis for longer than "
                    f"{settings.lock_ttl} s (SWARM_LOCK_TTL), or Redis answered too late to "
                    "tell; stopping so as not to overwrite its work. Run again once it is "
                    "done.")

        sessions = RedisSessionStore(store.redis, ttl=settings.session_ttl, outage=outage,
                                     fence=guard)
        with lock:
            loaded = None if new else sessions.load(session_id)
            resumed = loaded is not None and bool(loaded.messages)
            repaired = bool(loaded.repairs) if loaded is not None else False
            session: Session = loaded if loaded is not None else new_session(workspace)
            if session.parked and not keep_parked:
                # The last root run stopped while its children worked: their results
                # will not come back to this new run, so answer the calls as interrupted.
                session.messages = history.repair(session.messages)
                session.parked = ""
                repaired = True
            # Before the model is looked up: a spawner may start processes in the background.
            made = spawner(store, session, outage) if spawner is not None else None
            model = LLMClient.from_settings(settings)
            if observer is not None:
                model.on_retry = observer.on_retry
            try:
                with observer.model_call(model) if observer is not None else nullcontext():
                    model.resolve_model()
                    model.context_length()  # an unknown model id fails here, before any step
                agent = build_agent(
                    settings, workspace, model, session, store=sessions,
                    hints=HomeHints(store.redis, settings.home), approver=approver,
                    observer=observer, spawner=made, guard=guard,
                    mcp=mcp_config.load(workspace, settings.home),
                    types=agent_types.load(workspace, settings.home))
                yield LocalRun(agent, store, sessions, resumed, repaired, outage)
            finally:
                model.close()
