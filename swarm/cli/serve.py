"""``swarm serve`` (the HTTP API, and MCP at /mcp), ``swarm token`` (its tokens) and
``swarm mcp`` (the same MCP tools over stdio, for a desktop agent)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from swarm.cli.options import Abort, handle_errors, settings_from
from swarm.config import Settings
from swarm.runtime.local import LocalCluster, alive, wait_for
from swarm.store.connection import Store, open_store
from swarm.text import plural

if TYPE_CHECKING:
    import uvicorn

CTX = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
#: Seconds `swarm serve` / `swarm mcp` give their local processes to stop before killing
#: them (Celery would otherwise wait for a running child to finish).
SERVICE_STOP_GRACE = 1.0


@contextlib.contextmanager
def local_runtime(store: Store, settings: Settings, workers: int | None) -> Iterator[None]:
    """Make sure jobs on ``store`` will run: on the embedded default (or with ``workers``)
    start a local coordinator and workers, stopped on exit; else warn when none answers."""
    if workers is None:
        running = alive(store.redis, "coordinator") and alive(store.redis, "worker")
        workers = 1 if store.embedded and not running else 0
    cluster = None
    if workers:
        cluster = LocalCluster(store.url, settings.home, workers, settings.max_parallel,
                               master=store.master).start()
        try:
            wait_for(store.redis, 30.0, cluster.procs)
        except BaseException:
            cluster.stop()
            raise
        click.echo(f"started a local coordinator and {plural(workers, 'worker')} (logs in "
                   f"{settings.home / 'logs'})", err=True)
    else:
        missing = [k for k in ("coordinator", "worker") if not alive(store.redis, k)]
        if missing:
            click.echo(f"warning: no {' and no '.join(missing)} answers on {store.masked_url}; "
                       "jobs wait in the queue until one starts (`swarm coordinator`, "
                       "`swarm worker`, or --workers N)", err=True)
    try:
        yield
    finally:
        if cluster is not None:
            # A service stops at once: a child its local worker runs is cut short and
            # taken over from its last saved step when a worker next runs (the lease).
            cluster.stop(grace=SERVICE_STOP_GRACE)


class GracefulStop:
    """Signal handling around all of ``swarm serve``, so its cleanup always runs (the local
    coordinator and workers stop, the embedded server is released).

    uvicorn stops gracefully on SIGINT and SIGTERM, then raises the signal again under the
    handler it found: SIGTERM's default action then killed the process before any
    ``finally``, and the embedded Valkey was left running. Under this handler SIGHUP (a
    closed terminal) stops uvicorn gracefully too, the raised-again signal has no effect,
    and signals during the (bounded) cleanup are ignored; before uvicorn runs they
    interrupt like Ctrl-C.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.server: uvicorn.Server | None = None
        self.done = False
        self._previous: dict[int, Any] = {}
        self._stopping = False

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # else no signals here
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def run(self, server: uvicorn.Server) -> None:
        """Serve until a signal (or an error) stops ``server``."""
        self.server = server
        self.call(server.run)

    def call(self, serve: Callable[[], None]) -> None:
        """Run ``serve`` (a signal interrupts it like Ctrl-C); signals after it are ignored."""
        try:
            serve()
        finally:
            self.done = True

    @property
    def stopping(self) -> bool:
        """A signal asked it to stop before serving began."""
        return self._stopping

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.done:
            return
        if self.server is None:
            if not self._stopping:
                self._stopping = True
                threading.Thread(target=self._insist, daemon=True,
                                 name="swarm-stop").start()
            raise KeyboardInterrupt
        self.server.handle_exit(signum, frame)

    def _insist(self) -> None:
        """Signal this process again until what it serves has returned: a
        KeyboardInterrupt raised where Python drops exceptions (a ``__del__`` the garbage
        collector runs, an event loop starting) is lost, and ``swarm mcp`` went on serving
        after SIGTERM. A real signal, not a simulated one: an event loop that handles
        signals itself hears only those."""
        while not self.done:
            time.sleep(0.5)
            if not self.done:
                os.kill(os.getpid(), signal.SIGTERM)


root_option = click.option(
    "--root", type=click.Path(file_okay=False, path_type=Path), default=None,
    envvar="SWARM_SERVE_ROOT",
    help="Folder jobs work under: a job's workspace must lie inside it; a job without one "
         "gets a fresh folder here. [default: SWARM_HOME/jobs; env: SWARM_SERVE_ROOT]")

workers_option = click.option(
    "--workers", type=click.IntRange(min=0), default=None,
    help="Local worker processes to start, with a local coordinator (default: 1 on the "
         "embedded server unless some already run, else 0: use the deployment's).")


@click.command(context_settings=CTX)
@click.option("--host", default="127.0.0.1", show_default=True, envvar="SWARM_SERVE_HOST",
              help="Address to listen on. [env: SWARM_SERVE_HOST]")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              envvar="SWARM_SERVE_PORT", help="Port. [env: SWARM_SERVE_PORT]")
@root_option
@workers_option
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info",
                                                "debug"]), default="info", show_default=True)
@handle_errors
def serve(host: str, port: int, root: Path | None, workers: int | None, log_level: str) -> None:
    """Serve the HTTP API: submit, watch, cancel and approve jobs (OpenAPI at /openapi.json),
    the same as MCP tools over Streamable HTTP at /mcp (see `swarm mcp -h`), and a live
    page of the jobs at / (open it in a browser and paste a token).

    Every request needs `Authorization: Bearer TOKEN` (/mcp too): SWARM_SERVE_TOKEN (one
    admin token, from the environment) or tokens from `swarm token create`. A token sees
    and acts on the jobs it submitted; an admin token (`--admin`) on every job. Jobs run on
    the same Redis,
    coordinators and workers as `swarm run`: with no SWARM_REDIS_URL the embedded server,
    a local coordinator and a worker start with the service and stop with it.

    \b
      swarm token create --name me          # prints a token once
      swarm serve --port 8000
      curl -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \\
           -d '{"task": "list the files here", "approve": "all"}' localhost:8000/v1/jobs
    """
    import uvicorn

    from swarm.broker.app import configure
    from swarm.serve.app import Server, create_app
    from swarm.serve.auth import Authenticator
    from swarm.serve.jobs import jobs_root
    from swarm.serve.service import Service

    settings = settings_from()
    token = os.environ.get("SWARM_SERVE_TOKEN", "")
    with GracefulStop() as stop, open_store(settings) as store:
        auth = Authenticator(store.redis, token)
        if not auth.configured():
            raise Abort("no API token yet: set SWARM_SERVE_TOKEN, or run `swarm token create` "
                        "(it prints a token once) and start `swarm serve` again")
        with local_runtime(store, settings, workers):
            service = Service(store.redis, configure(store.url, store.master), settings,
                              jobs_root(settings.home, str(root) if root else None), auth)
            click.echo(f"swarm serve on http://{host}:{port} (the page at /, OpenAPI at "
                       f"/openapi.json, MCP at /mcp; "
                       f"store {store.masked_url}; jobs under {service.root})", err=True)
            config = uvicorn.Config(create_app(service), host=host, port=port,
                                    log_level=log_level, timeout_graceful_shutdown=3,
                                    server_header=False)
            stop.run(Server(config, service))


@click.command("mcp", context_settings=CTX)
@root_option
@click.option("-C", "--workspace", default=None,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Folder jobs that name none work in, e.g. the project the agent works on "
                   "(default: a fresh folder under --root).")
@workers_option
@handle_errors
def mcp(root: Path | None, workspace: Path | None, workers: int | None) -> None:
    """Serve the swarm as MCP tools over stdio, for an agent that starts it (Claude Code,
    Codex, ...): submit a job (optionally waiting, with progress), its status tree, its
    answer, cancel it, list and answer approvals.

    Set up like `swarm serve`: the model settings (SWARM_BASE_URL, SWARM_MODEL,
    SWARM_API_KEY) in its environment, and with no SWARM_REDIS_URL the embedded server, a
    local coordinator and a worker start with it and stop when the agent closes it. Its
    stdout is the protocol; messages go to stderr. No token: the agent that starts it is
    trusted (over HTTP, `swarm serve` serves the same tools at /mcp behind its tokens).

    \b
    Claude Code (jobs work in the current project unless they name a folder):
      claude mcp add swarm -e SWARM_BASE_URL=http://127.0.0.1:8080/v1 \\
          -- swarm mcp --workspace "$PWD" --root "$PWD"
    Codex (~/.codex/config.toml):
      [mcp_servers.swarm]
      command = "swarm"
      args = ["mcp", "--workspace", "/path/to/project", "--root", "/path/to/project"]
      env = { SWARM_BASE_URL = "http://127.0.0.1:8080/v1" }
      env_vars = ["SWARM_API_KEY"]
      startup_timeout_sec = 60
      tool_timeout_sec = 3600
    """
    from swarm.broker.app import configure
    from swarm.serve.jobs import jobs_root
    from swarm.serve.mcp import stdio_runner
    from swarm.serve.service import Service

    settings = settings_from()
    # The agent closes stdin to stop it, or sends SIGTERM: either way the local processes
    # stop and the embedded server is released (signals during that cleanup are ignored).
    with GracefulStop() as stop, open_store(settings) as store, \
            local_runtime(store, settings, workers), contextlib.suppress(KeyboardInterrupt):
        # A stop from here on (even before serving starts: the agent may have read the
        # line below) is a clean exit, with the cleanup above.
        def serve() -> None:
            service = Service(store.redis, configure(store.url, store.master), settings,
                              jobs_root(settings.home, str(root) if root else None),
                              workspace=workspace.resolve() if workspace else None)
            try:
                serve_stdio = stdio_runner(service)
            except Exception:
                if stop.stopping:  # a stop during the build came out as the library's error
                    raise KeyboardInterrupt from None
                raise
            click.echo(f"swarm mcp on stdio (store {store.masked_url}; jobs under "
                       f"{service.root})", err=True)
            serve_stdio()

        stop.call(serve)  # however it ends, signals during the cleanup are ignored
    # Everything is cleaned up by now (local processes stopped, the embedded server left).
    # A signal that stopped the server with its stdin open left AnyIO's worker thread
    # blocked reading it, which the interpreter's exit would wait for forever, and an
    # interrupt raised as the interpreter shut down made it die of SIGINT: it ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@click.group(context_settings=CTX)
def token() -> None:
    """API tokens of `swarm serve`, kept hashed (SHA-256) in Redis."""


@token.command("create", context_settings=CTX)
@click.option("--name", default=None, help="A name to list and revoke it by.")
@click.option("--admin", is_flag=True,
              help="Let it see and act on every job (default: only the jobs it submits).")
@handle_errors
def token_create(name: str | None, admin: bool) -> None:
    """Make a token and print it (on stdout) once: it cannot be shown again.

    It sees and acts on the jobs it submits (and their events and approvals); another
    token's job is a 404 to it. With --admin it sees every job, as SWARM_SERVE_TOKEN does.
    """
    from swarm.serve.auth import TokenError, TokenStore

    with open_store(settings_from()) as store:
        try:
            secret, info = TokenStore(store.redis).create(name, admin=admin)
        except TokenError as exc:
            raise Abort(str(exc)) from None
    click.echo(secret)
    click.echo(f"token {info.name} (id {info.id}, scope {info.scope}) created; it is shown "
               "only this once", err=True)


@token.command("list", context_settings=CTX)
@handle_errors
def token_list() -> None:
    """The tokens by id, name, creation time and scope (never the tokens themselves).

    user: the jobs it submitted; admin: every job. A token made before tokens had scopes
    is admin, marked "(made before scopes)": replace it with a user token where it need
    not see other tokens' jobs.
    """
    from swarm.serve.auth import TokenStore

    with open_store(settings_from()) as store:
        tokens = TokenStore(store.redis).all()
    if not tokens:
        click.echo("no tokens; `swarm token create` makes one", err=True)
    for t in tokens:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(t.created))
        note = " (made before scopes)" if t.legacy else ""
        click.echo(f"{t.id}  {t.name}  {when}  {t.scope}{note}")


@token.command("revoke", context_settings=CTX)
@click.argument("name_or_id")
@handle_errors
def token_revoke(name_or_id: str) -> None:
    """Revoke a token by name or id; requests with it get 401 at once."""
    from swarm.serve.auth import TokenStore

    with open_store(settings_from()) as store:
        gone = TokenStore(store.redis).revoke(name_or_id)
    if not gone:
        raise Abort(f"no token named {name_or_id!r} or with that id; `swarm token list`")
    click.echo(f"revoked {', '.join(f'{t.name} ({t.id})' for t in gone)}", err=True)
