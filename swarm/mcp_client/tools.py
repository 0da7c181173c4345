"""The MCP tools of one agent: ``mcp__<server>__<tool>`` with the server's JSON schema.

:class:`McpTools` starts the agent's servers the first time the agent asks for its tools
(in the process's :mod:`~swarm.mcp_client.pool`, where an already running server is
shared), and calls them. Failures never raise out of the agent's loop: a server that does
not start is skipped and reported once (:meth:`McpTools.notices`), and a call that fails
(an MCP error, a server that died, a timeout) raises :class:`~swarm.errors.McpServerError`,
which the loop turns into the call's result.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
from mcp import MCPError
from mcp.types import Tool

from swarm.errors import ConfigError, McpServerError
from swarm.mcp_client import bridge
from swarm.mcp_client.config import McpConfig, ServerSpec
from swarm.mcp_client.pool import Connection, Launcher, Pool, closed_connection, pool
from swarm.mcp_client.results import as_text
from swarm.text import cap_middle

PREFIX = "mcp__"
NAME_MAX = 64
"""OpenAI-compatible endpoints take function names of at most 64 of ``[A-Za-z0-9_-]``."""
DESCRIPTION_MAX = 2_000


@dataclass(frozen=True)
class McpTool:
    """One tool of one server, as the model sees it."""

    name: str
    """``mcp__<server>__<tool>``."""
    server: ServerSpec
    """The server's spec, expanded (it may hold secrets: never log or store it)."""
    tool: str
    """The tool's name on its server."""
    schema: dict[str, Any]
    read_only: bool
    destructive: bool


def tool_name(server: str, tool: str) -> str:
    """``mcp__<server>__<tool>``, with characters endpoints refuse replaced by ``_`` and a
    name too long cut, with a hash of the whole so two long names stay apart."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{PREFIX}{server}__{tool}")
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[:NAME_MAX - 9]}_{digest}"


class McpTools:
    """The tools of an agent's MCP servers; one per agent (not thread-safe)."""

    def __init__(self, config: McpConfig, *, log_dir: Path, output_cap: int = 20_000,
                 call_timeout: float = 300.0, start_timeout: float = 30.0,
                 cancel: threading.Event | None = None,
                 environ: Mapping[str, str] | None = None, servers: Pool | None = None,
                 launcher: Launcher | None = None) -> None:
        self.config = config
        self.launcher = launcher
        """Starts the stdio servers (a worker's: in its box); None: as plain processes."""
        self.log_dir, self.output_cap = log_dir, output_cap
        self.call_timeout, self.start_timeout = call_timeout, start_timeout
        self.cancel = cancel
        self.environ = os.environ if environ is None else environ
        self.pool = servers or pool()
        self._tools: dict[str, McpTool] | None = None
        self._notices: list[str] = list(config.problems)

    def __contains__(self, name: str) -> bool:
        return name.startswith(PREFIX) and name in self.tools()

    def tools(self) -> dict[str, McpTool]:
        """The tools by name (the servers start on the first call)."""
        if self._tools is None:
            self._tools = self._start()
        return self._tools

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools().values()]

    def notices(self) -> list[str]:
        """What went wrong starting the servers, each message once."""
        self.tools()
        out, self._notices = self._notices, []
        return out

    def _start(self) -> dict[str, McpTool]:
        configured: list[ServerSpec] = []
        expanded: list[ServerSpec] = []
        for spec in self.config.servers:
            try:
                expanded.append(spec.expand(self.environ))
            except ConfigError as exc:
                self._notices.append(f"{exc}; its tools are not offered")
                continue
            configured.append(spec)
        if not expanded:
            return {}

        async def connect_all() -> list[Connection | BaseException]:
            return await asyncio.gather(
                *(self.pool.connect(s, self.config.cwd, self.log_dir, self.start_timeout,
                                    self.launcher)
                  for s in expanded), return_exceptions=True)

        try:
            started = bridge.call(connect_all(), timeout=self.start_timeout + 15,
                                  cancel=self.cancel)
        except bridge.Abandoned as exc:
            self._notices.append(f"MCP servers skipped: they did not start ({exc})")
            return {}
        tools: dict[str, McpTool] = {}
        for spec, ready, conn in zip(configured, expanded, started, strict=True):
            if isinstance(conn, BaseException):
                # As configured: the expanded command or URL may hold a secret.
                self._notices.append(f"MCP server {spec.name} ({spec.describe()}) skipped: "
                                     f"{conn}")
                continue
            for tool in conn.tools:
                self._add(tools, ready, tool)
        return tools

    def _add(self, tools: dict[str, McpTool], spec: ServerSpec, tool: Tool) -> None:
        name = tool_name(spec.name, tool.name)
        schema = dict(tool.input_schema or {})
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            self._notices.append(f"MCP tool {name} skipped: its input schema is not valid "
                                 f"JSON Schema ({exc.message})")
            return
        if name in tools:
            self._notices.append(f"MCP tool {name} skipped: another tool has that name")
            return
        description = tool.description or tool.title or f"The {tool.name} tool of {spec.name}."
        hints = tool.annotations
        tools[name] = McpTool(
            name=name, server=spec, tool=tool.name,
            schema={"type": "function", "function": {
                "name": name, "description": description[:DESCRIPTION_MAX],
                "parameters": schema}},
            read_only=bool(hints and hints.read_only_hint),
            # The spec's default for a tool that is not read-only: it may destroy.
            destructive=not (hints and (hints.read_only_hint
                                        or hints.destructive_hint is False)))

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call the tool ``name``; its result as text, or :class:`McpServerError`."""
        tool = self.tools().get(name)
        if tool is None:
            raise McpServerError(f"no MCP tool {name!r}")
        server = tool.server.name
        try:
            return bridge.call(self._call(tool, arguments),
                               timeout=self.call_timeout + self.start_timeout + 15,
                               cancel=self.cancel)
        except bridge.Abandoned as exc:
            raise McpServerError(f"the call to MCP server {server} was abandoned: {exc}") \
                from None

    async def _call(self, tool: McpTool, arguments: dict[str, Any]) -> str:
        server = tool.server.name
        try:
            conn = await self.pool.connect(tool.server, self.config.cwd, self.log_dir,
                                           self.start_timeout, self.launcher)
        except McpServerError as exc:
            raise McpServerError(f"MCP server {server} is not running and did not start "
                                 f"again: {exc}") from None
        try:
            result = await conn.call(tool.tool, arguments, self.call_timeout)
        except MCPError as exc:
            if closed_connection(exc):
                await self.pool.discard(conn)
                raise McpServerError(
                    f"MCP server {server} went away during the call (it crashed or exited; "
                    "whether the call took effect is unknown). It is started again at the "
                    "next call" + (f"; its stderr is in {conn.log_path}"
                                   if tool.server.transport == "stdio" else "")) from None
            raise McpServerError(f"MCP server {server} answered with an error: "
                                 f"{cap_middle(exc.message, self.output_cap)}") from None
        except McpServerError:
            raise
        except Exception as exc:  # the SDK's own (a result it cannot parse, HTTP, ...)
            raise McpServerError(f"the call to MCP server {server} failed: "
                                 f"{type(exc).__name__}: {exc}") from None
        text = as_text(result, self.output_cap)
        if result.is_error:
            raise McpServerError(f"{tool.tool} failed on MCP server {server}: {text}")
        return text
