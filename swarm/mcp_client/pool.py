"""Running MCP servers: one per configuration per process, shared by every agent of the
process (a worker's children), started on first use and again after it died.

Everything here runs on the loop of :mod:`swarm.mcp_client.bridge`. A :class:`Connection`
is one server and the SDK's :class:`mcp.Client` talking to it, owned by one task (the SDK's
transports must be entered and left in the same task); calls from any agent go through it
concurrently. A server that fails to start is logged once and remembered for
:data:`RETRY_AFTER` seconds, so the children starting meanwhile skip it at once.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import httpx2
from mcp import Client, MCPError, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CONNECTION_CLOSED, CallToolResult, Implementation, Tool

from swarm import __version__
from swarm.errors import McpServerError
from swarm.mcp_client import bridge
from swarm.mcp_client.config import ServerSpec

log = logging.getLogger(__name__)

RETRY_AFTER = 30.0
"""Seconds a failed start is remembered before a new agent tries the server again."""
CLOSE_TIMEOUT = 10.0
#: Seconds an HTTP request to a server may take to connect, and to send the next byte.
HTTP_TIMEOUT, HTTP_READ_TIMEOUT = 30.0, 300.0
CLIENT_INFO = Implementation(name="swarm", version=__version__)


@dataclass(frozen=True)
class Key:
    """What makes two servers the same process: the expanded spec (not its name), cwd and
    how it is started (:attr:`Launcher.key`)."""

    spec: ServerSpec
    cwd: str
    launcher: str = ""


@dataclass(frozen=True)
class Launch:
    """How a stdio server's process starts: the program and its arguments, and its folder."""

    command: str
    args: tuple[str, ...]
    cwd: Path


class Launcher(Protocol):
    """Starts stdio servers otherwise than as plain child processes of this one: a worker's
    in its box (:class:`swarm.agent.mcp_box.BoxedServers`)."""

    @property
    def key(self) -> str:
        """Servers started by launchers of the same key are the same (shared)."""
        ...

    def __call__(self, spec: ServerSpec) -> Launch:
        """How ``spec`` (expanded) starts; ``OSError`` when it cannot."""
        ...


class Connection:
    """One running server and the client talking to it."""

    def __init__(self, spec: ServerSpec, cwd: Path | None, log_dir: Path,
                 launcher: Launcher | None = None) -> None:
        self.spec, self.cwd, self.log_dir = spec, cwd, log_dir
        self.launcher = launcher
        self.client: Client | None = None
        self.tools: list[Tool] = []
        self.error = ""
        self.started_in = 0.0
        self._ready = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.client is not None and not self._closing.is_set()

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"mcp-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.spec.name)}.log"

    async def start(self, timeout: float) -> None:
        """Start the server, initialize the session and list its tools."""
        began = time.monotonic()
        self._task = asyncio.create_task(self._serve(), name=f"mcp {self.spec.name}")
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            await self.close(wait=0.0)
            raise McpServerError(f"it did not start and list its tools within {timeout:g} s "
                                 "(SWARM_MCP_START_TIMEOUT)") from None
        if self.client is None:
            raise McpServerError(self.error or "it stopped while starting")
        self.started_in = time.monotonic() - began

    async def _serve(self) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport = await self._transport(stack)
                client = await stack.enter_async_context(Client(transport,
                                                                client_info=CLIENT_INFO))
                self.tools = await _list_tools(client)
                self.client = client
                self._ready.set()
                await self._closing.wait()
        except Exception as exc:
            self.error = self._describe(exc)
        finally:
            self.client = None
            self._ready.set()

    async def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        spec = self.spec
        if spec.transport == "http":
            http = await stack.enter_async_context(httpx2.AsyncClient(
                headers=dict(spec.headers),
                timeout=httpx2.Timeout(HTTP_TIMEOUT, read=HTTP_READ_TIMEOUT)))
            return streamable_http_client(spec.url, http_client=http)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        errlog = stack.enter_context(self.log_path.open("a", encoding="utf-8"))
        if self.launcher is not None:
            launch = self.launcher(spec)
            params = StdioServerParameters(command=launch.command, args=list(launch.args),
                                           env=dict(spec.env) or None, cwd=launch.cwd)
        else:
            params = StdioServerParameters(command=spec.command, args=list(spec.args),
                                           env=dict(spec.env) or None, cwd=self.cwd)
        return stdio_client(params, errlog=errlog)

    def _describe(self, exc: BaseException) -> str:
        """One line for an exception out of the SDK (task groups wrap them in groups)."""
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        if isinstance(exc, FileNotFoundError) and self.spec.transport == "stdio":
            return (f"its command {self.spec.command!r} was not found; install it or fix "
                    "\"command\" in the config")
        if isinstance(exc, MCPError):
            text = f"the server answered: {exc.message}"
        elif isinstance(exc, httpx2.HTTPError):
            text = f"HTTP: {type(exc).__name__}: {exc}"
        else:
            text = f"{type(exc).__name__}: {exc}"
        if self.spec.transport == "stdio":
            text += f" (its stderr is in {self.log_path})"
        return text

    async def call(self, tool: str, arguments: dict[str, Any], timeout: float
                   ) -> CallToolResult:
        client = self.client
        if client is None:
            raise McpServerError(f"MCP server {self.spec.name} is not running")
        return await client.call_tool(tool, arguments, read_timeout_seconds=timeout)

    async def close(self, wait: float = CLOSE_TIMEOUT) -> None:
        """Stop the server: let it leave cleanly for ``wait`` seconds, then cancel its task
        (the SDK still closes the server's stdin and kills it if it lingers)."""
        self._closing.set()
        task = self._task
        if task is None or task.done():
            return
        done, _ = await asyncio.wait([task], timeout=wait) if wait else (set(), set())
        if not done:
            task.cancel()
            await asyncio.wait([task], timeout=CLOSE_TIMEOUT)


async def _list_tools(client: Client) -> list[Tool]:
    tools: list[Tool] = []
    cursor: str | None = None
    for _ in range(100):  # a server whose pages never end must not hang the start
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


@dataclass
class Pool:
    """The process's servers by :class:`Key` (use :func:`pool`)."""

    connections: dict[Key, Connection] = field(default_factory=dict)
    _starting: dict[Key, asyncio.Future[Connection]] = field(default_factory=dict)
    _failed: dict[Key, tuple[float, str]] = field(default_factory=dict)

    async def connect(self, spec: ServerSpec, cwd: Path | None, log_dir: Path,
                      timeout: float, launcher: Launcher | None = None) -> Connection:
        """The running server of ``spec`` (expanded), started (by ``launcher`` when
        given) if it is not."""
        key = Key(replace(spec, name=""), str(cwd or ""),
                  launcher.key if launcher is not None and spec.transport == "stdio" else "")
        conn = self.connections.get(key)
        if conn is not None and conn.alive:
            return conn
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < RETRY_AFTER:
            raise McpServerError(failed[1])
        pending = self._starting.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._start(key, spec, cwd, log_dir, timeout,
                                                        launcher))
            self._starting[key] = pending
            pending.add_done_callback(lambda _: self._starting.pop(key, None))
        return await asyncio.shield(pending)

    async def _start(self, key: Key, spec: ServerSpec, cwd: Path | None, log_dir: Path,
                     timeout: float, launcher: Launcher | None) -> Connection:
        conn = Connection(spec, cwd, log_dir, launcher)
        try:
            await conn.start(timeout)
        except McpServerError as exc:
            self._failed[key] = (time.monotonic(), str(exc))
            # Not a warning: the agent reports it (a terminal's line, the model's notice);
            # this line is for a worker's log.
            log.info("MCP server %s did not start: %s", spec.name, exc)
            raise
        self._failed.pop(key, None)
        old = self.connections.pop(key, None)
        if old is not None:
            await old.close()
        self.connections[key] = conn
        log.info("MCP server %s started in %.2f s with %d tools", spec.name, conn.started_in,
                 len(conn.tools))
        return conn

    async def discard(self, conn: Connection) -> None:
        """Forget a server that broke (its next use starts it again) and stop it."""
        for key, known in list(self.connections.items()):
            if known is conn:
                del self.connections[key]
        await conn.close()

    async def close_all(self) -> None:
        conns = list(self.connections.values())
        self.connections.clear()
        self._failed.clear()
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)


def closed_connection(exc: BaseException) -> bool:
    """Whether ``exc`` says the server went away (it crashed or exited) during a call."""
    return isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED


_pool = Pool()


def pool() -> Pool:
    """The process's pool (use it on the bridge's loop only)."""
    return _pool


def shutdown() -> None:
    """Stop every server of the process (at exit; a test between cases)."""
    if bridge.running():
        bridge.call(_pool.close_all(), timeout=2 * CLOSE_TIMEOUT + 5)


def _forget() -> None:
    """In a forked child: the parent's servers are not this process's."""
    global _pool
    _pool = Pool()


atexit.register(shutdown)
os.register_at_fork(after_in_child=_forget)
