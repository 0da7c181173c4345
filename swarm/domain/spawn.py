"""One ``agent`` call of a parent, as the swarm receives it, and the parent's admission of
its calls: everything that can be decided when the call is made is decided there."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from swarm.domain.records import SETTLED, AgentRecord

#: Heads the message a parent gets when it gave its final answer while background children
#: ran: it parked until they settled, and is asked to answer again with their results.
BACKGROUND_SETTLED = ("[swarm: you answered while children you started in the background "
                      "still ran; they have settled now, and their results follow. Take "
                      "them into account and answer again.]\n")


def joined_body(message: dict[str, Any]) -> dict[str, Any] | None:
    """The results of background children a message carries (an ``agent_join`` result, or
    the message after a final answer given while they ran), else None."""
    content = str(message.get("content") or "")
    if message.get("role") == "user" and content.startswith(BACKGROUND_SETTLED):
        content = content[len(BACKGROUND_SETTLED):]
    elif message.get("role") != "tool":
        return None
    try:
        body = json.loads(content)
    except ValueError:
        return None
    return body if isinstance(body, dict) and isinstance(body.get("results"), list) else None


#: The largest task message a child accepts; bigger material belongs in a file.
MAX_MESSAGE = 256 * 1024


@dataclass(frozen=True)
class SpawnCall:
    """One ``agent`` call the model made, checked against the tool's schema."""

    call_id: str
    message: str
    agent_id: str = ""
    output_schema: dict[str, Any] | None = None
    traceparent: str = ""
    """The W3C trace context of this call, when telemetry is on (see swarm.telemetry)."""
    empty: bool = False
    """The model asked for a child that starts in an empty folder (``seed: false``)."""
    type: str = ""
    """The declared agent type it asks for ("": a copy of its parent)."""
    seed: str = ""
    """The snapshot of the parent's workspace the child starts from ("" : empty), set by
    the spawner when it takes the snapshot."""
    background: bool = False
    """The parent goes on while the child runs (``background: true``)."""


def check_call(call: dict[str, Any]) -> str:
    """Why an ``agent`` call cannot be run as it is, or ""."""
    size = len(str(call.get("message", "")).encode())
    if size > MAX_MESSAGE:
        return (f"the message is {size / 1024:.0f} KiB; the limit is {MAX_MESSAGE // 1024} KiB. "
                "Write the material to a file the child can read and pass its path instead")
    schema = call.get("output_schema")
    if schema:
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            return f"output_schema is not a valid JSON Schema: {exc.message}"
    return ""


@dataclass(frozen=True)
class Limits:
    """A swarm's limits on spawning (fixed when it is created)."""

    max_depth: int = 3
    max_children: int = 200
    max_parallel: int = 64
    token_budget: int = 0


@dataclass
class Facts:
    """What the parent reads to admit its calls, in one round trip."""

    parent: AgentRecord
    limits: Limits
    types: frozenset[str] = frozenset()
    cancelled: bool = False
    spent: int = 0
    targets: dict[str, AgentRecord | None] = field(default_factory=dict)
    """The records of the children its calls continue (by ``agent_id``)."""


@dataclass(frozen=True)
class Admission:
    """One call admitted (an ``agent_id`` to run it, new or continued) or refused."""

    call: dict[str, Any]
    agent_id: str = ""
    refusal: str = ""
    label: str = ""

    @property
    def continued(self) -> bool:
        return bool(self.call.get("agent_id"))


def admit(call: dict[str, Any], facts: Facts, new_agent_id: str) -> Admission:
    """Whether ``call`` can run, and as which agent (``new_agent_id`` for a new child).
    The children limit is counted where the request is written (it is the swarm's)."""
    limits, target = facts.limits, str(call.get("agent_id") or "")
    kind = str(call.get("type") or "")
    refusal = check_call(call)
    if not refusal and facts.cancelled:
        refusal = "the parent was cancelled"
    if not refusal and limits.token_budget and facts.spent >= limits.token_budget:
        refusal = (f"token budget spent: this swarm used {facts.spent} tokens of its budget "
                   f"of {limits.token_budget} (SWARM_TOKEN_BUDGET); answer with what you have")
    if refusal:
        return Admission(call, refusal=refusal)
    if target:
        refusal, label = continuation(facts.targets.get(target), target, facts, kind)
        return Admission(call, "" if refusal else target, refusal, label)
    if kind and kind not in facts.types:
        names = ", ".join(sorted(facts.types)) or (
            "none (no .swarm/agents/NAME.md files when the swarm started)")
        return Admission(call, refusal=f"unknown agent type {kind!r}; known types: {names}. "
                         "Omit type for a copy of you")
    depth = facts.parent.depth + 1
    if depth > limits.max_depth:
        return Admission(call, refusal=(
            f"depth limit reached: a child here would be at depth {depth}, the limit is "
            f"{limits.max_depth} (SWARM_MAX_DEPTH); do this part yourself"))
    return Admission(call, new_agent_id)


def continuation(existing: AgentRecord | None, target: str, facts: Facts,
                 kind: str = "") -> tuple[str, str]:
    """Why the parent cannot continue its child ``target`` (or ""), and its label. A
    continued child keeps its type: a call naming another is refused."""
    if existing is None or existing.swarm != facts.parent.swarm:
        return f"no agent {target!r} in this swarm; omit agent_id to start a new one", ""
    if existing.parent != facts.parent.id:
        return (f"agent {target!r} is not your child; only its parent can continue it",
                existing.label)
    if existing.state not in SETTLED:
        return f"agent {target!r} is still {existing.state}; wait for it", existing.label
    if kind and kind != existing.type:
        was = f"of type {existing.type!r}" if existing.type else "a copy of you (no type)"
        return (f"agent {target!r} is {was}, and a continued child keeps its type; omit "
                "type to continue it, or omit agent_id to start a new child of type "
                f"{kind!r}", existing.label)
    return "", existing.label
