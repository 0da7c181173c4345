"""What an agent asks before a tool runs, and the answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Decision = Literal["approve", "deny", "always"]
"""``always`` approves and remembers the approval for this tool for the rest of the session."""


@dataclass(frozen=True)
class ApprovalRequest:
    """What an approver is asked: may ``tool`` run with ``arguments``?"""

    tool: str
    arguments: dict[str, Any]
    summary: str
    """One line for a person, e.g. the command."""
    reason: str = ""
    """Why a person is asked (the policy, or what the reviewer said)."""
    agent_id: str = ""
    read_only: bool | None = None
    """What the tool says of itself (an MCP server's ``readOnlyHint``); None when it says
    nothing (``run_cli``, typed tools): the ``review`` policy then asks the LLM reviewer."""
    destructive: bool = False
    """The tool says it may destroy (an MCP tool that is not read-only, unless its
    ``destructiveHint`` is false)."""


@dataclass(frozen=True)
class Answer:
    """What an approver answers: the decision, and why (the model is told why it was
    denied: no one answered in time, the agent was cancelled, ...)."""

    decision: Decision
    reason: str = ""
