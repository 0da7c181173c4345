"""Approvals: per-tool policies, EVA's LLM reviewer, and the approvers that ask a person.

Policies (set per tool with ``SWARM_APPROVAL``, e.g. ``run_cli=review,*=once``):

- ``always``  ask before every call
- ``never``   never ask: the call runs
- ``once``    ask the first time; after an approval the tool runs freely for the session
- ``review``  an LLM reviewer at temperature 0 passes read-only commands; others are asked.
              An MCP tool is judged by its server's annotations instead: one marked
              ``readOnlyHint`` runs, any other (``destructiveHint``, or no hint) is asked

A tool's policy is its own entry, else the longest glob that matches it
(``mcp__github__*=always``), else ``*``. Whatever the policy, a person who answers
``always`` approves that tool for the session.

``--yes`` approves everything. The loop never reads stdin: it calls the
:class:`~swarm.agent.protocols.Approver` it was given. Silence is not consent:
an approver that cannot get an answer denies.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO

from swarm.agent.protocols import Approver, Model
from swarm.domain.approval import Answer, ApprovalRequest, Decision
from swarm.errors import SwarmError

log = logging.getLogger(__name__)

REVIEW_PROMPT = """You review shell commands for safety on {os} with bash.
If the command only reads (like cat, ls, grep, head, find without -delete or -exec, git status),
answer ALLOW. If it writes, deletes, executes programs or scripts, installs, changes permissions,
connects to the network, or you are unsure, answer DENY.
Answer with exactly one word: ALLOW or DENY."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of the approval gate for one call."""

    allowed: bool
    reason: str = ""


class LLMReviewer:
    """EVA's reviewer: one non-streamed call at temperature 0 per command.

    Returns True only for a clear ``ALLOW``; anything else (DENY, garbage, an error
    reaching the model) sends the command to a person.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.system = REVIEW_PROMPT.format(os=platform.system() or "Linux")

    def __call__(self, command: str) -> bool:
        messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": f"<command>\n{command}\n</command>"},
        ]
        try:
            result = self.model.chat(messages, temperature=0, stream=False)
        except SwarmError as exc:
            log.warning("safety review failed, asking instead: %s", exc)
            return False
        return reviewer_allows(result.content)


def reviewer_allows(answer: str) -> bool:
    """True only when the reviewer's whole answer is the word ALLOW (quotes, markdown
    emphasis and a full stop aside): "NOT ALLOWED", "DISALLOW" or prose ask a person."""
    return answer.strip().strip("\"'`*_.!").strip().upper() == "ALLOW"


@dataclass
class ApprovalGate:
    """Applies the per-tool policies; asks ``approver`` when a person must decide."""

    policies: Callable[[str], str]
    approver: Approver
    reviewer: Callable[[str], bool] | None = None
    yes: bool = False
    approved_tools: set[str] = field(default_factory=set)

    def check(self, request: ApprovalRequest) -> Verdict:
        if self.yes:
            return Verdict(True, "--yes")
        policy = self.policies(request.tool)
        if policy == "never":
            return Verdict(True, "policy never")
        if request.tool in self.approved_tools:
            return Verdict(True, "approved earlier this session")
        reason = f"policy {policy} for {request.tool}"
        if policy == "review" and request.read_only is not None:
            if request.read_only:
                return Verdict(True, "its server marks it read-only")
            reason = ("its server marks it destructive" if request.destructive
                      else "its server does not mark it read-only")
        elif policy == "review":
            if self.reviewer is not None and self.reviewer(request.summary):
                return Verdict(True, "reviewer: read-only")
            reason = "the safety reviewer did not pass it as read-only"
        answer = self.approver(dataclasses.replace(request, reason=reason))
        if answer.decision == "always":
            self.approved_tools.add(request.tool)
            return Verdict(True, "approved for the session")
        if answer.decision == "approve":
            if policy == "once":
                self.approved_tools.add(request.tool)
            return Verdict(True, "approved")
        return Verdict(False, answer.reason or "denied by the user")


def approve_all(request: ApprovalRequest, /) -> Answer:
    """The approver behind ``--yes``."""
    return Answer("approve")


def deny_all(request: ApprovalRequest, /) -> Answer:
    """An approver for places with nobody to ask."""
    return Answer("deny", "there is no one to ask")


_ANSWERS: dict[str, Decision] = {
    "y": "approve", "yes": "approve", "a": "always", "always": "always",
}


class TerminalApprover:
    """Asks ``y/N/a`` on the terminal. EOF, a closed stream or anything but y/a is a denial."""

    def __init__(self, stdin: IO[str] | None = None, stderr: IO[str] | None = None,
                 lock: threading.Lock | None = None,
                 before_ask: Iterable[Callable[[], None]] = ()) -> None:
        self.stdin = stdin
        self.stderr = stderr
        self.lock = lock or threading.Lock()
        self.before_ask = list(before_ask)

    def __call__(self, request: ApprovalRequest, /) -> Answer:
        stdin = self.stdin if self.stdin is not None else sys.stdin
        stderr = self.stderr if self.stderr is not None else sys.stderr
        with self.lock:
            for hook in self.before_ask:
                hook()
            who = f"[{request.agent_id}] " if request.agent_id else ""
            stderr.write(f"\n{who}{request.tool} wants to run: {request.summary}\n")
            if request.reason:
                stderr.write(f"  ({request.reason})\n")
            stderr.write("  Allow? [y]es / [N]o / [a]lways for this tool: ")
            stderr.flush()
            try:
                line = "" if stdin is None or stdin.closed else stdin.readline()
            except (OSError, ValueError):
                line = ""
            if not line:
                stderr.write("\n  no answer (stdin closed): denied\n")
                return Answer("deny", "no one answered (stdin is closed)")
            return Answer(_ANSWERS.get(line.strip().lower(), "deny"))
