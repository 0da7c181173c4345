"""Running one child in a worker: claim its run, work, settle exactly once.

A run is claimed with a lease in the ledger (renewed while the child works), so a
duplicate delivery of the same task does nothing while the first is alive. A child
that spawns children of its own parks: its task ends and the coordinator enqueues
``swarm.agent.resume`` when they settle.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from jsonschema import Draft202012Validator

from swarm import faults, telemetry
from swarm.agent.loop import Agent, Observer
from swarm.agent.tools import Call
from swarm.config import Settings
from swarm.domain.history import repair
from swarm.domain.messages import ChatResult
from swarm.errors import (
    AgentStopped,
    BudgetExceeded,
    Cancelled,
    ModelError,
    Parked,
    TimedOut,
)
from swarm.errors import StoreError as SwarmStoreError
from swarm.llm.client import LLMClient, http_client
from swarm.runtime.build import assemble, new_session
from swarm.runtime.spawner import RedisSpawner
from swarm.store import keys
from swarm.store.approvals import ApprovalQueue, QueueApprover
from swarm.store.gate import RedisRateGate
from swarm.store.hints import HintsStore, SwarmHints
from swarm.store.ledger import SETTLED, Ledger, Run, Start
from swarm.store.sessions import RedisSessionStore
from swarm.workers import workspace as ws
from swarm.workers.supervisor import Supervisor, Watched

log = logging.getLogger(__name__)

#: Seconds a worker trusts what it read of a swarm's settings (they never change).
SETTINGS_TTL = 30.0

#: Settings of the model endpoint: from the worker's environment when it has them.
ENDPOINT = frozenset({"base_url", "model"})

CHILD_PROMPT = """You are agent {agent_id}, a child at depth {depth} of a swarm of copies of
yourself. Your parent handed you the task in the first user message. Do it completely on your
own: nobody can answer questions. Your final answer (a message without tool calls) goes back
to your parent as the result, so make it self-contained: what you did, what you found, where
the files are. Your workspace is {workspace}."""

WRAP_UP = ("[time limit: you have used most of your wall time ({used:.0f} of {limit} s). Stop "
           "starting new work: answer now with what you have done and found, and what is left.]")
RESUMED = ("[your previous worker stopped while you were working; you are resumed from your last "
           "saved step. A command that was running may or may not have finished: check its "
           "effects before running it again.]")

JOB_PROMPT = """You are agent {agent_id}, running a job submitted to the swarm (over HTTP or by a
schedule); nobody watches a terminal. Do the task in the first user message completely; your
final answer (a message without tool calls) is the job's result. Your workspace is
{workspace}."""

SCHEMA_PROMPT = """

Your final answer must be ONLY a JSON value (no prose, no code fences) that matches this JSON
Schema:
{schema}"""


def check_output(answer: str, schema: dict[str, Any]) -> tuple[Any, str]:
    """Parse ``answer`` as JSON and validate it; returns (value, "") or (None, problem)."""
    text = answer.strip()
    if text.startswith("```"):
        text = text.strip("`")
        text = text[text.find("\n") + 1:] if "\n" in text else text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"the answer is not JSON ({exc.msg} at char {exc.pos})"
    errors = sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        return None, "; ".join(
            (f"{'/'.join(map(str, e.path))}: " if e.path else "") + e.message for e in errors[:5])
    return value, ""


class Progress(Observer):
    """Reports a child's turns and commands to the ledger, the event stream and Flower,
    through the process's :class:`Supervisor` (written in batches, not per call)."""

    def __init__(self, supervisor: Supervisor, swarm_id: str, agent_id: str,
                 send: Callable[..., None] | None = None, control: Control | None = None
                 ) -> None:
        self.supervisor, self.swarm_id, self.agent_id = supervisor, swarm_id, agent_id
        self.send, self.control = send, control
        self.turns = 0

    def on_model_result(self, result: ChatResult) -> None:
        self.turns += 1
        if self.control is not None:
            self.control.count(result.usage.total_tokens)

    def on_tool_result(self, call: Call, result: str) -> None:
        faults.point("worker-after-first-command")

    def on_tool_start(self, call: Call, summary: str) -> None:
        last = f"{call.name}: {summary}"[:200]
        self.supervisor.progress(self.swarm_id, self.agent_id, last=last, turns=self.turns,
                                 tool=call.name)
        if self.send is not None:
            try:
                self.send("task-progress", agent=self.agent_id, turn=self.turns, last=last)
            except Exception as exc:  # progress is best effort
                log.debug("progress event not sent: %s", exc)


class Control:
    """Stops one running child between steps: ``swarm cancel``, its wall-time limit, the
    token budget, a lost lease.

    The process's :class:`Supervisor` sets :attr:`event` (which also kills a running
    command) on cancel, at the hard deadline or when the lease is lost; :meth:`before_step`
    stops the loop between steps, and asks the child to wrap up at 80% of its time.
    """

    def __init__(self, redis_: redis.Redis, swarm_id: str, watched: Watched,
                 settings: Settings, supervisor: Supervisor, *, cancelled: bool,
                 spent: int) -> None:
        """``cancelled`` (while it waited in the queue: it stops before its first model
        call) and ``spent`` (the swarm's tokens before this child or this resume started:
        they count too) are read with the claim (:meth:`Ledger.start`)."""
        self.redis, self.swarm_id, self.watched = redis_, swarm_id, watched
        self.supervisor = supervisor
        self.limit = settings.child_timeout
        self.budget = settings.token_budget
        self.event = watched.event
        self.warned = False
        if cancelled:
            self.event.set()
        self.tokens = spent if self.budget else 0

    @property
    def timed_out(self) -> bool:
        return self.watched.timed_out

    def cancelled(self) -> bool:
        return self.event.is_set()

    def before_step(self, agent: Agent) -> None:
        if self.event.is_set():
            if self.timed_out:
                raise TimedOut(f"wall-time limit of {self.limit} s reached "
                               "(SWARM_CHILD_TIMEOUT)")
            raise Cancelled("cancelled (swarm cancel, or its parent was cancelled)")
        if self.budget and self.tokens >= self.budget:
            raise BudgetExceeded(f"the swarm used {self.tokens} tokens of its budget of "
                                 f"{self.budget} (SWARM_TOKEN_BUDGET)")
        used = time.monotonic() - self.watched.start
        if not self.warned and used >= 0.8 * self.limit:
            self.warned = True
            agent.messages.append({"role": "user",
                                   "content": WRAP_UP.format(used=used, limit=self.limit)})

    def count(self, tokens: int) -> None:
        """Add a model call's tokens to the swarm's count: at once when the swarm has a
        budget (its total decides whether to go on), else with the next progress flush."""
        if not self.budget:
            self.supervisor.add_tokens(self.swarm_id, tokens)
            return
        try:
            self.tokens = int(self.redis.hincrby(keys.swarm_counters(self.swarm_id), "tokens",
                                                 tokens))
        except redis.RedisError as exc:
            log.warning("token count not recorded: %s", exc)


class ModelClients:
    """What the children of one worker process share to reach their models: an HTTP
    client per pool thread and kind of endpoint settings, and each model's context length
    (``/models`` is asked once per :data:`CONTEXT_TTL`, not once per child).

    A client per thread rather than one pool for the process: a child's requests run one
    after another in its thread, so each thread keeps one warm connection, and httpcore's
    pool scans every connection it holds on each request and each close (with 200
    children in one pool that scan was over half the worker's CPU)."""

    CONTEXT_TTL = 300.0

    def __init__(self) -> None:
        self._local = threading.local()
        self._contexts: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def http(self, settings: Settings) -> httpx.Client:
        """This thread's HTTP client for ``settings``' kind of endpoint."""
        base = settings.base_url.rstrip("/")
        key = (base.startswith("https:"), settings.connect_timeout, settings.read_timeout)
        clients: dict[tuple[bool, float, float], httpx.Client] | None = getattr(
            self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        http = clients.get(key)
        if http is None:
            http = clients[key] = http_client(base, settings.connect_timeout,
                                              settings.read_timeout)
        return http

    def client(self, settings: Settings) -> LLMClient:
        http = self.http(settings)
        with self._lock:
            known = self._contexts.get((settings.base_url.rstrip("/"), settings.model))
        fresh = known is not None and time.monotonic() - known[0] < self.CONTEXT_TTL
        return LLMClient.from_settings(settings, http=http,
                                       context_length=known[1] if known and fresh else None)

    def release(self, model: LLMClient) -> None:
        """Remember what ``model`` learnt of its context length; the pool stays open."""
        length = model.known_context_length
        if length is not None and model.model:
            with self._lock:
                if len(self._contexts) > 1000:
                    self._contexts.clear()
                key = (model.base_url, model.model)
                if key not in self._contexts or time.monotonic() - self._contexts[key][0] \
                        >= self.CONTEXT_TTL:
                    self._contexts[key] = (time.monotonic(), length)
        model.close()


@dataclass
class ChildRunner:
    """Everything a worker process needs to run children; one per process."""

    settings: Settings
    redis: redis.Redis
    host: str = socket.gethostname()

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.redis)
        self.sessions = RedisSessionStore(self.redis, ttl=self.settings.session_ttl, index=False)
        self.supervisor = Supervisor(self.redis, self.settings.lease)
        self.models = ModelClients()
        self._settings: dict[str, tuple[float, dict[str, Any]]] = {}
        self._settings_lock = threading.Lock()

    def run(self, run_id: str, *, resume: bool = False,
            send: Callable[..., None] | None = None, traceparent: str = "") -> dict[str, Any]:
        """Run (or, with ``resume``, carry on) the run ``run_id``; returns a small summary.

        A run delivered again after its worker died (its lease ran out) is claimed anew and
        resumed from its last saved step.
        """
        run = self.ledger.run(run_id)
        if run is None:
            log.warning("run %s is not in the ledger; nothing to do", run_id)
            return {"run": run_id, "state": "missing"}
        if run.state in SETTLED:
            return {"run": run_id, "state": run.state}
        token = secrets.token_hex(8)
        swarm_id = run.swarm
        if run.agent and not swarm_id:  # a record from before runs carried their swarm
            swarm_id = self.ledger.agent(run.agent).get("swarm", "")
        start = self.ledger.start(run, swarm_id, token, self.settings.lease, self.host,
                                  "parked" if resume else "queued") \
            if run.agent and swarm_id else None
        if start is None:
            log.warning("run %s has no agent in the ledger; nothing to do", run_id)
            return {"run": run_id, "state": "missing"}
        if not start.claimed:
            return {"run": run_id, "state": "skipped (another worker has it)"}
        # The run's own limit (a swarm may set a shorter one) is applied in _work.
        watched = self.supervisor.watch(Watched(run.id, run.agent, token,
                                                self.settings.child_timeout))
        try:
            with telemetry.span("agent", parent=traceparent, agent_id=run.agent, run=run.id,
                                resume=resume):
                return self._work(run, start, resume, send, watched)
        except (SwarmStoreError, redis.RedisError):
            raise  # Redis went away: the lease runs out and a worker takes the run over
        except Exception as exc:
            # A bug outside the agent's loop: taking the run over would hit it again, and
            # its parent would wait forever. Settle it as failed, with the reason.
            log.exception("run %s crashed", run.id)
            self.ledger.settle(run, swarm_id, "failed",
                               {"agent_id": run.agent,
                                "error": f"internal error: {type(exc).__name__}: {exc}"},
                               {}, token=token)
            return {"run": run.id, "state": "failed"}
        finally:
            self.supervisor.forget(watched)

    def _work(self, run: Run, start: Start, resume: bool,
              send: Callable[..., None] | None, watched: Watched) -> dict[str, Any]:
        """The run claimed by ``start``, of the agent whose record it read."""
        record = start.agent
        swarm_id = record["swarm"]
        settings = self.settings.with_(**{
            k: v for k, v in self.swarm_settings(swarm_id).items()
            # A worker configured with its own endpoint keeps it (a deployment's workers);
            # one without (local workers, the demo) uses the root's.
            if not (k in ENDPOINT and ENDPOINT & self.settings.explicit)})
        if "stream" not in settings.explicit:
            # Nobody watches a child's tokens arrive: whole answers cost the worker less than
            # half the CPU of a parsed stream (and one read instead of one per chunk).
            settings = dataclasses.replace(settings, stream=False)
        workspace = self._workspace(record, swarm_id)
        session = self.sessions.from_fields(run.agent, start.session_meta,
                                            start.session_messages) \
            or new_session(workspace.path, run.agent)
        if session.parked and self._still_waiting(run, session.parked):
            return {"run": run.id, "state": "parked"}
        before = self._snapshot(workspace, run)
        watched.limit = settings.child_timeout
        control = Control(self.redis, swarm_id, watched, settings, self.supervisor,
                          cancelled=start.cancelled, spent=start.spent)
        model = self.models.client(settings)
        model.gate = RedisRateGate(self.redis, swarm_id)
        queue = ApprovalQueue(self.redis, swarm_id)
        try:
            agent = assemble(
                settings, workspace.path, model, session, store=self.sessions,
                hints=SwarmHints(self.redis, swarm_id, HintsStore(self.redis, settings.home),
                                 agent_id=run.agent),
                approver=QueueApprover(queue, settings.approval_timeout, control.cancelled),
                observer=Progress(self.supervisor, swarm_id, run.agent, send, control),
                spawner=RedisSpawner(self.ledger, run.agent, swarm_id, run.id),
                extra_prompt=(JOB_PROMPT if record.get("kind") == "job" else CHILD_PROMPT)
                .format(agent_id=run.agent, depth=record["depth"], workspace=workspace.path),
                agent_id=run.agent,
                cancel=control.event,
            )
            agent.before_step = control.before_step
            state, result = self._answer(agent, run, resume)
        except Parked:
            self.ledger.event(swarm_id, "parked", run.agent)
            return {"run": run.id, "state": "parked"}
        finally:
            self.models.release(model)
        start_usage = run.result.get("usage_at_start") or {}
        result.update(
            agent_id=run.agent, workspace=str(workspace.path),
            files_changed=ws.changed_files(before, ws.snapshot(workspace.path)),
            usage=_usage_delta(start_usage, session.usage))
        if workspace.git_branch:
            result["git_branch"] = workspace.git_branch
            result["diffstat"] = ws.commit_changes(
                workspace, f"swarm {run.agent}: {run.message[:60]}")
        self.supervisor.flush()  # its progress goes before its settlement
        self.ledger.settle(run, swarm_id, state, result, session.usage, token=watched.token)
        if record.get("kind") == "job":
            self.ledger.finish_swarm(swarm_id, state)
        return {"run": run.id, "state": state}

    def _still_waiting(self, run: Run, request_id: str) -> bool:
        """A run found parked on a request: True if that request is still out (the join
        resumes it), else the spawn never got out; the calls are answered as interrupted."""
        request = self.ledger.request(request_id)
        if request and request.get("state") != "joined":
            self.ledger.set_run(run.id, state="parked", lease="")
            self.redis.zrem(keys.leases(), run.id)
            return True
        return False

    def _snapshot(self, workspace: ws.Workspace, run: Run) -> ws.Snapshot:
        """The workspace as it was when this run began (kept on disk across resumes)."""
        path = workspace.path.parent / f".{run.agent}.{run.id}.snapshot.json"
        try:
            return {k: (v[0], v[1]) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError):
            snap = ws.snapshot(workspace.path)
            path.write_text(json.dumps(snap))
            return snap

    def _answer(self, agent: Agent, run: Run, resume: bool) -> tuple[str, dict[str, Any]]:
        """Work to a final answer; check it against the run's output schema (one retry)."""
        session = agent.session
        try:
            if resume:
                answer = agent.resume(since_turn=run.start_turn)
            elif 0 <= run.start_index < len(session.messages):
                # A worker died mid-run: carry on from the last saved step.
                agent.run_start = run.start_turn
                if session.parked:  # its spawn request never went out: answer the calls
                    session.messages = repair(session.messages)
                    session.parked = ""
                agent.messages.append({"role": "user", "content": RESUMED})
                agent.save()
                answer = agent.resume(since_turn=run.start_turn)
            else:
                self.ledger.set_run(run.id, start_turn=session.turns,
                                    start_index=len(session.messages),
                                    result=json.dumps({"usage_at_start": session.usage}))
                message = run.message
                if run.output_schema:
                    message += SCHEMA_PROMPT.format(schema=json.dumps(run.output_schema))
                # Unsaved until the model answers: a worker that dies first leaves the
                # session at start_index, so the run starts again from its message.
                answer = agent.run(message, save_task=False)
            if not run.output_schema:
                return "done", {"answer": answer}
            value, problem = check_output(answer, run.output_schema)
            if problem:
                answer = agent.run(
                    f"Your answer does not match the output schema: {problem}. Answer again with "
                    "only the JSON value, nothing else.")
                value, problem = check_output(answer, run.output_schema)
            if problem:
                return "failed", {"answer": answer,
                                  "error": f"the answer did not match output_schema: {problem}"}
            return "done", {"answer": answer, "output": value}
        except Parked:
            raise
        except Cancelled as exc:
            return exc.state, {"error": str(exc)}
        except (AgentStopped, ModelError) as exc:
            return "failed", {"error": f"{type(exc).__name__}: {exc}"}
        except (SwarmStoreError, redis.RedisError):
            raise  # Redis went away: the task fails, the lease runs out, a worker takes over
        except Exception as exc:  # a bug must not leave the parent waiting forever
            log.exception("child %s crashed", run.agent)
            return "failed", {"error": f"internal error: {type(exc).__name__}: {exc}"}

    def swarm_settings(self, swarm_id: str) -> dict[str, Any]:
        """The swarm's settings (written once, when it was created), read at most every
        :data:`SETTINGS_TTL` seconds per swarm: a fan-out's siblings share one read."""
        now = time.monotonic()
        with self._settings_lock:
            known = self._settings.get(swarm_id)
        if known is not None and now - known[0] < SETTINGS_TTL:
            return known[1]
        value = self.ledger.swarm_settings(swarm_id)
        with self._settings_lock:
            if len(self._settings) > 1000:
                self._settings.clear()
            self._settings[swarm_id] = (now, value)
        return value

    def _workspace(self, record: dict[str, str], swarm_id: str) -> ws.Workspace:
        if record.get("workspace"):
            path = Path(record["workspace"])
            branch = f"swarm/{record['id']}" if (path / ".git").is_file() else ""
            path.mkdir(parents=True, exist_ok=True)
            return ws.Workspace(path, branch)
        if "parent_host" in record:
            parent = {"workspace": record.get("parent_workspace", ""),
                      "host": record["parent_host"]}
        else:  # written by a coordinator from before the parent's fields rode along
            parent = self.ledger.agent(record["parent"])
        workspace = ws.prepare(self.settings.home, swarm_id, record["id"],
                               parent.get("workspace", ""), parent.get("host") == self.host)
        self.ledger.update_agent(record["id"], workspace=str(workspace.path))
        return workspace


def _usage_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: int(v) - int(before.get(k, 0)) for k, v in after.items()}


