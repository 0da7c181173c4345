"""Runs one typed tool (``.swarm/tools/NAME.py``) where the agent's commands run: in its box.

Never imported by swarm: :mod:`swarm.agent.folder` passes this file's text to the python
of the box (``python3 -c``), so it uses the standard library only and runs on any Python 3
from 3.8. Arguments: the tool's file (relative to the workspace, the current folder), a JSON
object ``{"kwargs": {...}, "workspace": true|false}``, the workspace's path, the number of
characters of the result to keep (head and tail), the tool's name.

It runs the file as a module, calls ``run(**kwargs)`` (with ``workspace`` when asked) and writes
one line, :data:`MARK` then a JSON envelope: ``{"result": TEXT}``, ``{"error": "Type: msg"}``
or ``{"unjson": msg}`` (a result that cannot be sent as JSON). What the tool itself prints
(or the programs it starts) goes nowhere, so nothing it writes can pass for the envelope.
"""

from __future__ import annotations

import json
import os
import sys
import types

MARK = "\x1eswarm-tool-result:"


def cap_middle(text: str, cap: int) -> str:  # as swarm.text.cap_middle
    if len(text) <= cap:
        return text
    half = max(cap // 2, 1)
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[-half:]}"


def main() -> None:
    path, payload, workspace, cap, name = sys.argv[1:6]
    out = os.dup(1)  # not inheritable: the tool's own processes never get it
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)

    def send(envelope: dict[str, str]) -> None:
        data = (MARK + json.dumps(envelope, ensure_ascii=False) + "\n").encode("utf-8",
                                                                             "replace")
        while data:
            data = data[os.write(out, data):]

    try:
        args = json.loads(payload)
        kwargs = dict(args["kwargs"])
        mod_name = "_swarm_tool_" + name.replace("-", "_")
        module = types.ModuleType(mod_name)
        module.__file__ = path
        sys.modules[mod_name] = module  # as a normal import (dataclasses look it up there)
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec")
        exec(code, module.__dict__)  # importlib would cost a few ms more
        if args.get("workspace"):
            from pathlib import Path

            kwargs["workspace"] = Path(workspace)
        result = module.run(**kwargs)
    except BaseException as exc:  # whatever it raised is the call's result
        send({"error": f"{type(exc).__name__}: {exc}"})
        return
    if not isinstance(result, str):
        try:
            result = json.dumps(result, default=str)
        except (TypeError, ValueError) as exc:  # e.g. a circular structure
            send({"unjson": str(exc)})
            return
    send({"result": cap_middle(result, int(cap))})


if __name__ == "__main__":
    main()
