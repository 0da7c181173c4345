"""A small MCP server written with the SDK, for the tests and the benchmark: notes kept in
the server's memory.

    python tests/mcp_notes_server.py                 # stdio
    python tests/mcp_notes_server.py --http PORT     # Streamable HTTP on 127.0.0.1:PORT/mcp

Tools: ``count_notes`` and ``list_notes`` (read-only), ``add_note`` (additive),
``delete_notes`` (destructive), ``token_digest`` (read-only: a digest of ``NOTES_TOKEN``
from its environment, so a test can tell the server got a secret without seeing it),
``picture`` (an image), ``wait`` (answers after some seconds), ``fail`` (an error result)
and ``crash`` (the process exits in the middle of the call). With ``NOTES_PIDS=DIR`` it
writes its pid to ``DIR/<pid>`` at start.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import anyio
from mcp.server.mcpserver import Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

READ_ONLY = ToolAnnotations(read_only_hint=True)
ADDITIVE = ToolAnnotations(read_only_hint=False, destructive_hint=False)
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True)
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")

server = MCPServer("notes")
notes: list[str] = []


@server.tool(annotations=READ_ONLY)
def count_notes() -> str:
    """How many notes there are."""
    return f"{len(notes)} notes"


@server.tool(annotations=READ_ONLY)
def list_notes() -> dict[str, list[str]]:
    """Every note, in the order they were added."""
    return {"notes": list(notes)}


@server.tool(annotations=ADDITIVE)
def add_note(text: str) -> str:
    """Add a note."""
    notes.append(text)
    return f"added note {len(notes)}: {text}"


@server.tool(annotations=DESTRUCTIVE)
def delete_notes() -> str:
    """Delete every note."""
    count = len(notes)
    notes.clear()
    return f"deleted {count} notes"


@server.tool(annotations=READ_ONLY)
def token_digest() -> str:
    """A digest of the NOTES_TOKEN this server was started with."""
    token = os.environ.get("NOTES_TOKEN")
    return "unset" if token is None else hashlib.sha256(token.encode()).hexdigest()[:16]


@server.tool(annotations=READ_ONLY)
def picture() -> Image:
    """A tiny picture."""
    return Image(data=PNG, format="png")


@server.tool(annotations=READ_ONLY)
async def wait(seconds: float) -> str:
    """Answers after ``seconds``."""
    await anyio.sleep(seconds)
    return f"waited {seconds:g} s"


@server.tool(annotations=READ_ONLY)
def fail(why: str) -> str:
    """Always fails, saying why."""
    raise ToolError(f"failed on purpose: {why}")


@server.tool()
def crash() -> str:
    """The server process exits in the middle of this call."""
    sys.stdout.flush()
    os._exit(3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=0, help="serve Streamable HTTP on PORT")
    args = parser.parse_args()
    pids = os.environ.get("NOTES_PIDS")
    if pids:
        Path(pids, str(os.getpid())).write_text(" ".join(sys.argv))
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
