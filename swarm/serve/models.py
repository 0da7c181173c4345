"""Request and response bodies of the HTTP API (pydantic; unknown fields are refused)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swarm.domain.approval import Decision

#: Longest task, in characters.
MAX_TASK = 256 * 1024
#: Largest request body, in bytes (a task at its limit, JSON-escaped, fits).
MAX_BODY = 2 * 1024 * 1024

#: Path components of 1-63 characters (no NUL), so a valid name is a valid file name.
WORKSPACE_PATTERN = r"^/?(?:[^/\x00]{1,63}/+)*[^/\x00]{0,63}$"

JobStateName = Literal["queued", "running", "done", "failed", "cancelled"]
#: Job and approval ids.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Limits(BaseModel):
    """Limits of one job: each may only tighten the service's own (``SWARM_*``), which
    applies to those left out. Each is a JSON integer (``3`` or ``3.0``, as JSON Schema has
    it), never ``"3"`` or ``true``."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _numbers_only(cls, data: Any) -> Any:
        for name, value in (data.items() if isinstance(data, dict) else ()):
            if isinstance(value, str | bool):
                raise ValueError(f"{name} must be an integer, not {type(value).__name__}")
        return data

    max_depth: int | None = Field(None, ge=1, le=10,
                                  description="deepest child level")
    max_children: int | None = Field(None, ge=1, le=10_000,
                                     description="children per job")
    max_parallel: int | None = Field(None, ge=1, le=1_000,
                                     description="children in flight")
    max_turns: int | None = Field(None, ge=0, le=100_000,
                                  description="model calls per run of the job's root agent, "
                                              "and the most a child may make; 0 = no cap")
    child_max_turns: int | None = Field(None, ge=0, le=100_000,
                                        description="model calls per run of a child; 0 = no "
                                                    "cap")
    token_budget: int | None = Field(None, ge=0, le=10**12,
                                     description="tokens per job; 0 = no cap")
    child_timeout: int | None = Field(None, ge=1, le=7 * 24 * 3600,
                                      description="wall seconds per agent")


class JobRequest(Strict):
    """A job: a task for a root agent that runs on the swarm's workers."""

    task: str = Field(min_length=1, max_length=MAX_TASK, pattern=r"\S",
                      description=f"what to do (at most {MAX_TASK} characters, not blank); "
                                  "one that would take SWARM_COMPACT_AT of the model's context "
                                  "or more (4 characters a token) is refused with 413")
    approve: Literal["all", "ask"] = Field(
        "ask", description="all: approve every tool call; ask: the approval policies apply "
                           "and requests wait in GET /v1/approvals for an answer")
    workspace: str | None = Field(
        None, min_length=1, max_length=1024, pattern=WORKSPACE_PATTERN,
        description="a folder inside the service's root (SWARM_SERVE_ROOT), absolute or "
                    "relative to it, created if missing (names of at most 63 characters); "
                    "default: a fresh folder. Outside the root: 403")
    limits: Limits | None = None


class JobCreated(BaseModel):
    id: str


class AgentInfo(BaseModel):
    id: str
    parent: str
    depth: int
    state: str
    label: str
    landing: str | None = Field(default=None, description=(
        "how a child's work came home in its parent's workspace: landed, conflict, kept, "
        "no changes, check failed, failed (null until its parent took it)"))
    type: str | None = Field(default=None, description=(
        "its declared agent type (.swarm/agents/NAME.md); null for a copy of its parent "
        "and for the root"))


class Job(BaseModel):
    """A job as it stands: its state, the root's answer (or error), usage and agents."""

    id: str
    state: JobStateName
    answer: str | None = None
    error: str | None = None
    usage: dict[str, int]
    agents: list[AgentInfo]
    source: str = ""
    workspace: str = ""
    task: str = ""
    owner: str = Field("", description="the id of the API token that submitted it "
                                        "(`swarm token list`); empty when no token did")


class CancelResult(BaseModel):
    id: str
    state: JobStateName
    flagged: list[str] = Field(description="agents that were still active and now stop")


class Approval(BaseModel):
    """A tool call waiting for a person."""

    id: str
    job: str
    agent: str
    tool: str
    summary: str
    reason: str
    created: float


class JobStatus(Job):
    """A job with its agents drawn as a tree, one line each (for a model to read)."""

    tree: str


class JobAnswer(BaseModel):
    """Where a job stands after waiting for it: settled (``answer`` or ``error``), or still
    going, maybe with approvals that wait for an answer."""

    id: str
    state: JobStateName
    answer: str | None = None
    error: str | None = None
    approvals: list[Approval] = Field(
        default_factory=list, description="tool calls of this job waiting for an answer")


class ApprovalAnswer(Strict):
    decision: Decision = Field(
        description="always: approve, and approve this tool for the rest of the job")


class ApprovalDone(BaseModel):
    id: str
    job: str
    decision: Decision


class ErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class Error(BaseModel):
    """Every error: ``detail`` says what is wrong (a list for invalid fields)."""

    detail: str | list[ErrorItem]


class JobSummary(BaseModel):
    """A job or swarm as listed: what it is, where it stands, when it started."""

    id: str
    kind: Literal["job", "swarm"] = Field(description=(
        "job: submitted over the API, MCP or a schedule; swarm: a root in a terminal "
        "(`swarm run`, `swarm chat`), which only admin tokens see"))
    source: str = ""
    state: str = Field(description="a job's state (queued, running, done, failed, "
                                   "cancelled); a swarm's (running, done, failed, ...)")
    task: str = ""
    created: float
    settled: float | None = None
    agents: int = Field(description="agents in its tree")
    owner: str = ""


class SwarmSnapshot(BaseModel):
    """A job's swarm at one moment: `swarm status --json`, plus where its events stand."""

    swarm: dict[str, Any]
    totals: dict[str, Any]
    agents: list[dict[str, Any]] = Field(description=(
        "every agent in tree order: id, parent, kind, state, depth, label, task, times, "
        "turns, usage, cost (null without prices), last, answer, error, landing, children"))
    last_event: str = Field(description=(
        "the id of the job's last event before this snapshot was read (\"\" when none): "
        "follow GET /v1/jobs/{id}/events with it as Last-Event-ID"))


class ConversationEntry(BaseModel):
    kind: Literal["user", "thinking", "said", "call", "output", "answer", "assistant"]
    text: str
    tool: str | None = None
    id: str | None = None
    output: str | None = Field(None, description="a call's result (null while it has none)")


class AgentDetail(BaseModel):
    """One agent: its record, the tail of its conversation (texts capped) and the result
    of its latest run."""

    agent: dict[str, Any]
    conversation: list[ConversationEntry]
    earlier: int = Field(description="entries of the conversation before those shown")
    result: dict[str, Any] | None = Field(description="its latest run's result (null until "
                                                      "it settles)")


class AgentDiff(BaseModel):
    """The changes an agent's work made to the files it started from (as `swarm land
    AGENT --show` prints them), capped."""

    agent: str
    diff: str
    stat: str = Field(description="git's --shortstat line (\"\" with no diff)")
    truncated: bool
    note: str = Field(description="why there is no diff, when there is none")


class AgentCancelled(BaseModel):
    id: str
    job: str
    flagged: list[str] = Field(description="agents of its subtree that were still active "
                                           "and now stop")


class AgentMessage(Strict):
    """A message for a running agent: it reads it at its next turn boundary."""

    text: str = Field(min_length=1, max_length=MAX_TASK, pattern=r"\S",
                      description=f"what to tell it (at most {MAX_TASK} characters, not blank; "
                                  "like a task, one too large for the model's context is "
                                  "refused with 413)")


class MessageSent(BaseModel):
    id: str = Field(description="the message's id in the agent's mailbox")
    job: str
    agent: str
