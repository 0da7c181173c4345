"""The one error tree of swarm.

Every exception swarm raises on purpose derives from :class:`SwarmError`, and
every message says what to check or how to fix it::

    SwarmError
    ├── ConfigError                 a setting is missing or invalid
    ├── ModelError                  talking to the OpenAI-compatible endpoint
    │   ├── ModelConnectionError    cannot connect / timed out (after retries)
    │   ├── ModelHTTPError          the server answered 4xx/5xx (after retries)
    │   │   └── ModelRateLimitError 429 after every retry
    │   ├── ModelResponseError      the answer could not be parsed, or the stream broke
    │   ├── ModelNotFoundError      the model id is not listed by GET /models
    │   └── ModelCallAborted        the call was cut short: its agent was stopped (cancel, ...)
    ├── StoreError                  Redis / the embedded server
    │   ├── StoreUnavailableError   cannot reach Redis, or the embedded server did not start
    │   └── LockError               the session is held by another swarm process
    ├── ToolError                   a tool call the model made cannot run (returned to the model)
    │   └── McpServerError          an MCP server did not start, or failed or died during a call
    ├── AgentStopped                the loop stopped before an answer
    │   ├── LimitReached            a limit stopped it (its message names the setting)
    │   │   ├── TurnLimitReached    --max-turns / SWARM_CHILD_MAX_TURNS reached
    │   │   ├── RepeatedCalls       the same calls got the same refusal SWARM_REPEAT_LIMIT times
    │   │   └── BudgetExceeded      the swarm used its token budget
    │   ├── Interrupted             the user pressed Ctrl-C
    │   ├── Cancelled               `swarm cancel` (or its wall-time limit: TimedOut)
    │   │   └── TimedOut
    │   ├── LeaseLost               a worker lost a child's lease (another worker has it)
    │   ├── TaskTooLarge            the task alone would fill the model's context
    │   └── Parked                  the agent waits for its children (not a failure)
    ├── WorkspaceError              a workspace cannot be snapshotted, seeded or restored
    │   ├── SnapshotTooLarge        over SWARM_SNAPSHOT_MAX (or SWARM_SNAPSHOT_SWARM_MAX)
    │   └── WorkspaceLost           a workspace to restore elsewhere is gone or broken
    ├── RuntimeUnavailable          no coordinator or worker answers (berserk mode)
    └── RequestError                a request to `swarm serve` / `swarm mcp` cannot be done
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error swarm raises on purpose."""


class ConfigError(SwarmError):
    """A setting is missing or invalid."""


class ModelError(SwarmError):
    """A problem talking to the model endpoint."""


class ModelConnectionError(ModelError):
    """The endpoint could not be reached, or did not answer in time."""


class ModelHTTPError(ModelError):
    """The endpoint answered with an HTTP error status."""

    def __init__(self, message: str, status_code: int, body: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class ModelRateLimitError(ModelHTTPError):
    """The endpoint kept answering 429 Too Many Requests."""


class ModelResponseError(ModelError):
    """The endpoint's answer could not be understood, or its stream was cut."""


class ModelNotFoundError(ModelError):
    """The configured model id is not one the endpoint lists."""


class ModelCallAborted(ModelError):
    """A model call was cut short because its client's stop event was set (``swarm cancel``,
    a wall-time deadline, a lost lease): whoever set it knows why, and the agent loop asks
    its ``before_step`` hook to say so (:meth:`swarm.agent.loop.Agent.query`)."""


class StoreError(SwarmError):
    """A problem with Redis or the embedded server."""


class StoreUnavailableError(StoreError):
    """Redis cannot be reached, or the embedded server did not start."""


class LockError(StoreError):
    """Another swarm process holds the lock this one needs."""


class ToolError(SwarmError):
    """A tool call cannot be run; the message goes back to the model as the result."""


class McpServerError(ToolError):
    """An MCP server could not be started or reached, or it failed or died during a call."""


class AgentStopped(SwarmError):
    """The agent loop stopped before the model gave a final answer."""


class LimitReached(AgentStopped):
    """A limit stopped the agent; the message names the setting (``swarm run`` exits 3)."""


class TurnLimitReached(LimitReached):
    """The agent made as many model calls as its turn limit allows (``--max-turns``,
    ``SWARM_CHILD_MAX_TURNS``)."""


class RepeatedCalls(LimitReached):
    """The agent made the same tool calls and got the same refusal or error
    ``SWARM_REPEAT_LIMIT`` answers in a row: it is going round in circles."""


class Interrupted(AgentStopped):
    """The user interrupted the current answer (Ctrl-C)."""


class TaskTooLarge(AgentStopped):
    """A task that would take more of the model's context than an agent can work with,
    refused before any model call; the message says its estimated size, the context and
    what to do instead (:func:`swarm.agent.compaction.check_task`)."""


class Parked(AgentStopped):
    """The agent handed ``agent`` calls to the swarm and waits for their results.

    Not a failure: whoever runs the agent parks it (a worker ends its task, the
    terminal waits) and calls :meth:`Agent.resume` once the children settle.
    """

    def __init__(self, request_id: str) -> None:
        super().__init__(f"waiting for the children of spawn request {request_id}")
        self.request_id = request_id


class RuntimeUnavailable(SwarmError):
    """Berserk mode needs a coordinator and workers, and none answered."""


class RequestError(SwarmError):
    """A request to the swarm's services (HTTP API, MCP server) that cannot be done: an
    unknown job, an approval answered already, a workspace outside the root. ``status`` is
    the HTTP status that fits; the MCP server sends the message as a tool error."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Cancelled(AgentStopped):
    """The agent was cancelled (``swarm cancel``, or its parent was)."""

    state = "cancelled"


class TimedOut(Cancelled):
    """The agent ran past its wall-time limit (``SWARM_CHILD_TIMEOUT``)."""

    state = "timed_out"


class BudgetExceeded(LimitReached):
    """The swarm's agents, the root included, used the token budget (``SWARM_TOKEN_BUDGET``)."""


class LeaseLost(AgentStopped):
    """A worker stopped a child whose run's lease it no longer holds: it could not renew
    it in time (Redis unreachable, the host cut off) or another worker took the run over.
    The run goes on elsewhere; this worker runs no more of its commands."""


class WorkspaceError(SwarmError):
    """A workspace could not be snapshotted, seeded, brought home or restored."""


class SnapshotTooLarge(WorkspaceError):
    """A workspace snapshot is over ``SWARM_SNAPSHOT_MAX`` (or the swarm's total over
    ``SWARM_SNAPSHOT_SWARM_MAX``); the message says the size, the cap and what to do."""


class WorkspaceElsewhere(WorkspaceError):
    """A run taken over on a host that does not have its workspace, while a worker still
    runs on the host that does (the run is handed back for that host to take)."""


class PathRefused(WorkspaceError):
    """A folder that must be opened beneath another (a job's workspace beneath the jobs
    root) is not there as it was checked: a part of its path is now a symbolic link (or not
    a folder), or it lies outside. Nothing is opened, granted or followed through it."""


class WorkspaceLost(WorkspaceError):
    """A workspace that must be restored (a parked parent resumed on another host, a
    continued child) cannot be: its snapshot is gone or broken."""
