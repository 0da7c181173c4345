"""A stdio MCP server in the standard library alone, for tests that run it where the MCP
SDK is not installed (a box's ``python3``). One tool, ``whoami``: the server's uid, its
``NoNewPrivs`` and ``Seccomp`` lines, its folder, its pid and its environment.

    python3 tests/mcp_min_server.py
"""

from __future__ import annotations

import json
import os
import sys


def whoami() -> dict[str, object]:
    with open("/proc/self/status") as f:
        status = [line.strip() for line in f if line.startswith(("NoNewPrivs", "Seccomp:"))]
    try:  # its network namespace's (/sys shows the host's)
        with open("/proc/self/net/dev") as f:
            interfaces = sorted(line.split(":")[0].strip() for line in f if ":" in line)
    except OSError:
        interfaces = []
    return {"uid": os.getuid(), "status": status, "cwd": os.getcwd(), "pid": os.getpid(),
            "interfaces": interfaces,
            "env": dict(os.environ)}


TOOLS = [{"name": "whoami", "description": "Where this server runs.",
          "inputSchema": {"type": "object", "properties": {}},
          "annotations": {"readOnlyHint": True}}]


def answer(request: dict[str, object]) -> dict[str, object] | None:
    method, params = request.get("method"), request.get("params") or {}
    assert isinstance(params, dict)
    if "id" not in request:
        return None  # a notification
    if method == "initialize":
        result: dict[str, object] = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}}, "serverInfo": {"name": "min", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call" and params.get("name") == "whoami":
        result = {"content": [{"type": "text", "text": json.dumps(whoami())}],
                  "isError": False}
    elif method == "ping":
        result = {}
    else:
        return {"jsonrpc": "2.0", "id": request["id"],
                "error": {"code": -32601, "message": f"no method {method}"}}
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = answer(json.loads(line))
        if reply is not None:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
