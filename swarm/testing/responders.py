"""What the scripted model answers when nothing is scripted: the default responder (fan
out, fan in, run a command in backticks, a greeting) and the safety reviewer. Both look
only at the request, so any number of conversations (a swarm) may talk to them at once.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from swarm.testing.replies import Reply, ToolCall
from swarm.text import plural

_READ_ONLY = {"ls", "cat", "head", "tail", "grep", "wc", "pwd", "echo", "find"}
_GIT_READ_ONLY = {"status", "log", "diff"}
_COMMAND = re.compile(r"<command>\s*(.*?)\s*</command>", re.S)
_FENCED = re.compile(r"```[\w-]*\n(.*?)```", re.S)
_BACKTICKED = re.compile(r"`([^`\n]+)`")


def default_reviewer(command: str) -> str:
    """``ALLOW`` for plainly read-only commands (pipes of them too), ``DENY`` for the rest."""
    if re.search(r"[;&<>`]|\$\(", command):
        return "DENY"
    for segment in command.split("|"):
        try:
            words = shlex.split(segment)
        except ValueError:
            return "DENY"
        if not words:
            return "DENY"
        head = words[0]
        if head == "git":
            if len(words) < 2 or words[1] not in _GIT_READ_ONLY:
                return "DENY"
        elif head not in _READ_ONLY:
            return "DENY"
        if head == "find" and any(w in {"-delete", "-exec", "-execdir", "-ok", "-okdir",
                                        "-fprint", "-fprintf", "-fls"} for w in words):
            return "DENY"
    return "ALLOW"


MAX_FAN_OUT = 200
"""The most children one ``fan out N`` task asks for (the swarm's own limits still apply)."""
FAN_IN_LINE = 300
"""Characters of a child's answer (or error) on its line of the root's summary."""
FAN_OUT_COMMAND = "pwd"
"""What the children of a ``fan out N`` task without a command run."""
_FAN_OUT = re.compile(r"\bfan[ -]?out\b\W*(?:to\W+)?(\d+)", re.I)
HELLO = ("Hello from the scripted model. Put a command in `backticks` and I will run it; "
         "'fan out 3: `pwd`' hands it to 3 child agents and sums up their answers.")


def default_responder(request: dict[str, Any]) -> Reply:
    """What the scripted model answers when nothing is scripted; it looks only at the
    request, so any number of conversations (a swarm) may talk to it at once:

    - ``fan out N: `COMMAND` `` (a user message): ``N`` calls of the ``agent`` tool, each
      child told to run COMMAND (default ``pwd``) and report its output;
    - the results of ``agent`` calls: a summary, one line per child (its answer cut at
      :data:`FAN_IN_LINE` characters, marked);
    - a command in backticks (or a fenced block): a ``run_cli`` call; its result: the
      output, whole;
    - anything else: a greeting that says the above.
    """
    messages = request.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    text = message_text(last)
    if last.get("role") == "tool":
        # The whole result, as swarm gave it (its own cap marks where it cut an output).
        return fan_in_reply(messages) or Reply("Done. Output:\n" + text)
    if last.get("role") == "user":
        fan_out = fan_out_reply(text, request)
        if fan_out is not None:
            return fan_out
        match = _FENCED.search(text) or _BACKTICKED.search(text)
        if match and match.group(1).strip():
            return Reply(tool_calls=[ToolCall("run_cli", {"command": match.group(1).strip()})])
    return Reply(HELLO)


def fan_out_reply(text: str, request: dict[str, Any]) -> Reply | None:
    """The ``agent`` calls a ``fan out N`` message asks for; None when ``text`` is not one.

    The form is looked for outside backticks, so a child told to run ``echo fan out 2``
    does not fan out itself."""
    match = _FAN_OUT.search(_BACKTICKED.sub("", _FENCED.sub("", text)))
    if match is None:
        return None
    count = int(match[1])
    if not 1 <= count <= MAX_FAN_OUT:
        return Reply(f"I fan out to 1 to {MAX_FAN_OUT} children, not {count}.")
    offered = {str((t.get("function") or {}).get("name")) for t in request.get("tools") or []
               if isinstance(t, dict)}
    if "agent" not in offered:
        return Reply("I cannot fan out here: this request does not offer the `agent` tool.")
    found = _FENCED.search(text) or _BACKTICKED.search(text)
    command = found.group(1).strip() if found and found.group(1).strip() else FAN_OUT_COMMAND
    quoted = f"```sh\n{command}\n```" if "`" in command or "\n" in command else f"`{command}`"
    return Reply(
        content=f"Handing {quoted} to {plural(count, 'child agent')}.",
        tool_calls=[ToolCall("agent", {"message": f"child {i} of {count}: run {quoted} and "
                                                  "report its output"})
                    for i in range(1, count + 1)])


def fan_in_reply(messages: list[dict[str, Any]]) -> Reply | None:
    """A summary of the children's results when the last tool messages answer ``agent``
    calls (one line per child: id, state, its answer or error); else None."""
    start = len(messages)
    while start and isinstance(messages[start - 1], dict) \
            and messages[start - 1].get("role") == "tool":
        start -= 1
    asked = messages[start - 1] if start else {}
    calls = (asked.get("tool_calls") if isinstance(asked, dict) else None) or []
    if start == len(messages) or not calls or any(
            not isinstance(c, dict) or (c.get("function") or {}).get("name") != "agent"
            for c in calls):
        return None
    states: dict[str, int] = {}
    rows = []
    for message in messages[start:]:
        text = message_text(message)
        try:
            result = json.loads(text)
        except ValueError:
            result = None
        if not isinstance(result, dict):
            result = {"state": "unknown", "answer": text}
        state = str(result.get("state") or "unknown")
        states[state] = states.get(state, 0) + 1
        if state == "done":
            said = json.dumps(result["output"]) if "output" in result else result.get("answer")
        else:
            said = result.get("error") or result.get("answer")
        said = " ".join(str(said or "").split())
        if len(said) > FAN_IN_LINE:
            said = f"{said[:FAN_IN_LINE]} [... {len(said) - FAN_IN_LINE} characters cut]"
        rows.append(f"- {result.get('agent_id') or '-'} {state}: {said}")
    tally = ", ".join(f"{n} {state}" for state, n in states.items())
    return Reply(f"{plural(len(rows), 'child', 'children')}: {tally}.\n" + "\n".join(rows))


def message_text(message: dict[str, Any]) -> str:
    """The text of a message whose content is a string or a list of parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def review_command(request: dict[str, Any]) -> str | None:
    """The command of a safety-review request, or None when the request is not one."""
    if request.get("tools"):
        return None
    for message in reversed(request.get("messages") or []):
        if isinstance(message, dict):
            match = _COMMAND.search(message_text(message))
            if match:
                return match.group(1)
    return None
