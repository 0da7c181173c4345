"""Tool schemas the model sees, and checking a call against them.

Schemas are strict (``additionalProperties: false``). A call the model gets
wrong — unknown tool, arguments that are not JSON or do not match the schema —
never raises out of the loop: :func:`parse_call` returns an error string that
goes back to the model as that call's result.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.agent.agent_types import AgentTypes

ToolSchema = dict[str, Any]


def function_schema(name: str, description: str, properties: dict[str, Any],
                    required: list[str]) -> ToolSchema:
    """An OpenAI ``tools`` entry with a strict object schema."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


RUN_CLI = function_schema(
    "run_cli",
    "Run a shell command with `bash -c` in your workspace and get its stdout and stderr "
    "(interleaved) and exit code. stdin is closed: never run interactive programs or pagers. "
    "Long output is cut in the middle. Each call starts a fresh shell in the workspace: "
    "`cd` does not carry over, chain with `&&`.",
    {
        "command": {"type": "string", "description": "The command, run with bash -c."},
        "timeout": {"type": "integer", "minimum": 1,
                    "description": "Seconds before the command and its children are killed."},
    },
    ["command"],
)

LOAD_SKILL = function_schema(
    "load_skill",
    "Load a skill (instructions for a kind of task) listed in the system prompt.",
    {"name": {"type": "string", "description": "The skill's name as listed."}},
    ["name"],
)

LEAVE_MEMORY_HINTS = function_schema(
    "leave_memory_hints",
    "Your context is nearly full. After saving what matters to files, call this with the "
    "complete, updated memory hints (where your notes, skills and progress are, and what to do "
    "next). The conversation is then compacted and continues from these hints.",
    {"hints": {"type": "string", "description": "The full new content of your memory hints."}},
    ["hints"],
)

AGENT = function_schema(
    "agent",
    "Spawn a copy of yourself with a fresh history and its own workspace to do part of the "
    "job, or continue an earlier child by agent_id. `message` must carry all the context the "
    "child needs. Several agent calls in one answer run in parallel. The child starts with a "
    "copy of your workspace as it is now (committed, uncommitted and untracked files; not "
    "ignored ones or secrets like .env). When it settles, its changes land in your "
    "workspace, uncommitted, in call order, merged with what changed there meanwhile "
    "(`landing: landed`); a child whose changes conflict with yours or an earlier "
    "sibling's is not landed (`landing: conflict`, with the files and its hunks): continue "
    "it with agent_id to redo its change over your workspace as it is now, or do it "
    "yourself. `changes: none` when it changed nothing.",
    {
        "message": {"type": "string"},
        "agent_id": {"type": "string"},
        "output_schema": {"type": "object"},
        "seed": {"type": "boolean",
                 "description": "false: the child starts in an empty folder (default true); "
                                "its files are then kept aside at the path its result names."},
        "land": {"type": "string", "enum": ["merge", "keep"],
                 "description": "keep: do not land its changes; keep them aside for you to "
                                "compare (default merge)."},
        "check": {"type": "string",
                  "description": "a command run in your workspace after its changes land "
                                 "(e.g. the tests); if it fails they are taken back and its "
                                 "result says so with the command's output."},
        "background": {"type": "boolean",
                       "description": "true: answer at once with the child's agent_id and "
                                      "go on working while it runs; take its result with "
                                      "agent_join (agent_status peeks, agent_cancel drops "
                                      "it). If you answer while it still runs, you wait for "
                                      "it and get its result to answer again."},
    },
    ["message"],
)


def agent_schema(types: AgentTypes | None) -> ToolSchema:
    """The ``agent`` tool: :data:`AGENT`, and with declared types a ``type`` parameter and
    the types listed by name and description (an unknown name is refused when it is
    dispatched, with the list)."""
    if not types:
        return AGENT
    listed = "\n".join(f"- {t.name}: {t.description}" for _, t in sorted(types.types.items()))
    function = AGENT["function"]
    parameters = function["parameters"]
    return {"type": "function", "function": {
        **function,
        "description": (f"{function['description']}\n\nAgent types: pass `type` to start a "
                        "child of one (its own instructions, tools and model; without "
                        "`type` the child is a copy of you). A continued child keeps its "
                        f"type.\n{listed}"),
        "parameters": {**parameters, "properties": {
            **parameters["properties"],
            "type": {"type": "string",
                     "description": f"the agent type to start: {', '.join(types.names())}"}}},
    }}


@dataclass(frozen=True)
class Call:
    """A tool call as the model made it, with its arguments parsed (when they parse)."""

    id: str
    name: str
    arguments: dict[str, Any]
    error: str = ""
    """Non-empty when the call cannot run; this text is the call's result."""


def tool_name(schema: ToolSchema) -> str:
    return str(schema["function"]["name"])


def parse_call(raw: dict[str, Any], offered: dict[str, ToolSchema]) -> Call:
    """Check one raw ``tool_calls`` entry against the tools offered this turn."""
    call_id = str(raw.get("id") or "")
    function = raw.get("function") or {}
    name = str(function.get("name") or "")
    if name not in offered:
        names = ", ".join(sorted(offered)) or "none"
        return Call(call_id, name, {}, f"error: unknown tool {name!r}. Available tools: {names}.")
    text = function.get("arguments")
    if isinstance(text, dict):  # some servers send an object, not a JSON string
        args: Any = text
    else:
        try:
            args = json.loads(text or "{}")
        except json.JSONDecodeError as exc:
            return Call(call_id, name, {}, (
                f"error: the arguments of {name} are not valid JSON ({exc.msg} at char "
                f"{exc.pos}). Send one JSON object that matches the tool's schema."
            ))
    if not isinstance(args, dict):
        return Call(call_id, name, {}, f"error: the arguments of {name} must be a JSON object.")
    from jsonschema import Draft202012Validator  # ~0.1 s to import: see prewarm()

    problems = sorted(
        Draft202012Validator(offered[name]["function"]["parameters"]).iter_errors(args),
        key=lambda e: list(e.path),
    )
    if problems:
        detail = "; ".join(
            (f"{'/'.join(map(str, p.path))}: " if p.path else "") + p.message for p in problems[:5]
        )
        return Call(call_id, name, args, (
            f"error: invalid arguments for {name}: {detail}. "
            f"Schema: {json.dumps(offered[name]['function']['parameters'])}"
        ))
    return Call(call_id, name, args)


def _import_checker() -> None:
    import jsonschema  # noqa: F401


def prewarm() -> None:
    """Import what checking a call needs (jsonschema, ~0.1 s) in a background thread, so
    a process that is about to wait for the model's first answer pays for it meanwhile,
    not after the answer (nor before its first request)."""
    threading.Thread(target=_import_checker, daemon=True, name="prewarm").start()
