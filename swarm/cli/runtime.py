"""``swarm worker``, ``swarm coordinator``, ``swarm flower``: the long-running processes."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import sys
import warnings
from types import FrameType

import click

from swarm.cli.options import Abort, handle_errors, interrupt_on_term, settings_from
from swarm.store import keys
from swarm.store.connection import open_store

CTX = {"help_option_names": ["-h", "--help"]}

ROOT_NOTE = ("note: this worker runs as root: children's commands run as the sandbox line "
             "above says, but the worker's own work (git, landing children's changes) runs as "
             "root. Unless it needs root for copy-on-write views or cgroup limits, run it as "
             "another user (`sudo -u USER swarm worker`; the image's worker is user swarm).")


@click.command(context_settings=CTX)
@click.option("-c", "--concurrency", type=click.IntRange(min=1), default=64, show_default=True,
              envvar="SWARM_WORKER_CONCURRENCY",
              help="Children run at once by this process (threads: agents mostly wait on the "
                   "model). [env: SWARM_WORKER_CONCURRENCY]")
@click.option("-Q", "--queues", default="swarm", show_default=True, envvar="SWARM_QUEUES",
              help="Comma-separated queues to take tasks from (and always this host's own, "
                   "swarm.host.HOSTNAME: children whose folder is here). [env: SWARM_QUEUES]")
@click.option("-n", "--hostname", default=None,
              help="Worker name shown in Flower (default: swarm@HOST).")
@click.option("-P", "--pool", type=click.Choice(["threads", "prefork", "solo"]),
              default="threads", show_default=True, help="Celery pool.")
@click.option("-l", "--loglevel", default="INFO", show_default=True)
@click.option("--check-sandbox", is_flag=True,
              help="Only try the sandbox here: print where commands would run; exit 1 when "
                   "this worker would refuse children.")
@handle_errors
def worker(concurrency: int, queues: str, hostname: str | None, pool: str, loglevel: str,
           check_sandbox: bool) -> None:
    """Run children: a Celery worker on SWARM_REDIS_URL (or this SWARM_HOME's embedded server).

    Start one on every machine that should work for the swarm; each needs the model
    settings (SWARM_BASE_URL, SWARM_API_KEY, ...) in its own environment. Children's
    commands run in bubblewrap (SWARM_SANDBOX=auto); a worker where that does not work
    says so and refuses children, unless SWARM_SANDBOX=none is set. Unless GLIBC_TUNABLES
    is set, it starts itself again with glibc's allocator set for a thread a child
    (docs/deploy.md).
    """
    from swarm.runtime import malloc

    malloc.tune(sys.argv[1:])  # first: glibc's allocator set for a thread a live child
    import threading

    from swarm.workspace import views

    # The copy-on-write views of children's workspaces are mounted in this process's own
    # mount namespace (where it may make one): they go away with it, however it ends.
    # First: a thread started before (importing the sandbox starts some) would stay in
    # the host's, and the boxes it starts with it, where no view is mounted.
    views.private_mounts()
    from swarm.agent import sandbox, tools
    from swarm.agent.probe import tool_versions
    from swarm.runtime.build import tools_cache
    from swarm.runtime.local import exit_with_parent, started_for_a_run
    from swarm.secrets import hide_from_proc

    # Agents' commands are this process's children: keep the API key and the Redis URL
    # out of what they can read in /proc/$PPID/environ.
    hide_from_proc(sys.argv[1:])
    more_open_files(concurrency)
    malloc.untune()
    settings = settings_from()
    choice = sandbox.for_worker(settings)
    click.echo(f"sandbox: {choice.summary}", err=True)
    if check_sandbox:
        if choice.refuse:
            raise Abort(f"this worker would refuse children: {choice.refuse}")
        return
    if os.geteuid() == 0 or os.getuid() == 0:
        click.echo(ROOT_NOTE, err=True)
    # Every child's prompt names the tools' versions (once per process, ~0.3 s of
    # subprocesses unless kept on disk): gathered while Celery starts. Checking a child's
    # calls needs jsonschema (~0.1 s of CPU): imported once the worker is ready, so it
    # does not delay that, and before a first child needs it.
    threading.Thread(target=tool_versions, args=(tools_cache(settings),), daemon=True,
                     name="probe").start()
    from celery.exceptions import SecurityWarning
    from celery.signals import worker_ready

    from swarm.broker.app import configure, host_queue
    from swarm.schedules import tasks as _schedule_tasks  # noqa: F401 (registers its task)
    from swarm.workers import tasks as _worker_tasks  # noqa: F401 (registers theirs)

    worker_ready.connect(lambda **_: tools.prewarm(), weak=False)
    # Celery's says to pass --uid, which swarm worker does not have: ROOT_NOTE says it.
    warnings.filterwarnings("ignore", message="You're running the worker with superuser",
                            category=SecurityWarning)

    exit_with_parent()
    # Until Celery takes SIGTERM over, it unwinds: on the embedded default this process is a
    # user of the server, and the last user to leave stops it.
    interrupt_on_term()
    with open_store(settings, adopt=started_for_a_run()) as store:
        app = configure(store.url, store.master)
        app.worker_main([
            "worker", f"--concurrency={concurrency}", f"--pool={pool}",
            f"--queues={queues},{host_queue(socket.gethostname())}",
            f"--hostname={hostname or 'swarm@' + socket.gethostname()}",
            f"--loglevel={loglevel}", "--task-events", "--without-mingle",
        ])


#: Descriptors a running child may hold in its worker (its box's socket and network, the
#: command's output, the model's and Redis's connections, git's pipes), with room to spare.
FILES_A_CHILD = 16


def more_open_files(concurrency: int) -> None:
    """Raise this process's soft limit of open files to its hard one: the usual soft 1,024
    runs out at a few hundred children with their boxes; a warning when the hard limit is
    too low for ``concurrency`` children."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    have = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = concurrency * FILES_A_CHILD + 256
    if have != resource.RLIM_INFINITY and have < need:
        click.echo(f"warning: this worker may open {have} files, and {concurrency} children "
                   f"may need about {need}: raise its limit (ulimit -n {need}, LimitNOFILE= in "
                   "a systemd unit, --ulimit nofile= for a container) or lower --concurrency",
                   err=True)


@click.command(context_settings=CTX)
@click.option("--name", default=None, help="Consumer name in the stream group (default: HOST).")
@handle_errors
def coordinator(name: str | None) -> None:
    """Turn spawn requests into children and settled children into results.

    Several may run on one Redis: they share the work through a consumer group.
    """
    import logging

    from swarm.broker.app import configure
    from swarm.coordinator.service import Coordinator
    from swarm.runtime.local import exit_with_parent, started_for_a_run
    from swarm.secrets import hide_from_proc

    logging.getLogger("swarm").setLevel(logging.INFO)
    hide_from_proc(sys.argv[1:])  # the secrets of `swarm run`'s local one come by a pipe
    settings = settings_from()
    exit_with_parent()
    interrupt_on_term()  # until the service's own handler: leave the server as its user
    with open_store(settings, adopt=started_for_a_run()) as store:
        service = Coordinator(store.redis, configure(store.url, store.master), settings,
                              name=name or socket.gethostname())

        def stop(signum: int, frame: FrameType | None) -> None:
            service.stop.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        click.echo(f"coordinator {service.name} on {store.masked_url}", err=True)
        try:
            service.run()
        finally:
            store.redis.delete(keys.heartbeat("coordinator", service.name))


def is_loopback(address: str) -> bool:
    """Whether a server bound to ``address`` can be reached from this machine only."""
    host = address.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or "" (every interface)
        return False


@click.command(context_settings=CTX)
@click.option("--port", type=int, default=5555, show_default=True, envvar="FLOWER_PORT")
@click.option("--address", default="127.0.0.1", show_default=True, envvar="FLOWER_ADDRESS",
              help="Address to listen on; any but a loopback one needs a login (--basic-auth, "
                   "or Flower's OAuth through FLOWER_AUTH). [env: FLOWER_ADDRESS]")
@click.option("--basic-auth", envvar="FLOWER_BASIC_AUTH", default=None,
              help="user:password (comma-separate several). [env: FLOWER_BASIC_AUTH]")
@handle_errors
def flower(port: int, address: str, basic_auth: str | None) -> None:
    """Watch the swarm in Flower (tasks are named after their agents; args are ids only)."""
    from swarm.broker.app import configure

    if not basic_auth and not os.environ.get("FLOWER_AUTH"):
        if not is_loopback(address):
            raise Abort(f"Flower on {address or 'every interface'} would show the swarm to "
                        "anyone who reaches it, with no login: pass --basic-auth user:password "
                        "(or set FLOWER_BASIC_AUTH), or listen on 127.0.0.1")
        host = f"[{address}]" if ":" in address and not address.startswith("[") else address
        click.echo(f"warning: Flower on http://{host}:{port} has no login; anyone with an "
                   "account on this machine can use it (--basic-auth user:password adds one)",
                   err=True)
    settings = settings_from()
    with open_store(settings) as store:
        app = configure(store.url, store.master)
        argv = ["flower", f"--port={port}", f"--address={address}"]
        if basic_auth:
            argv.append(f"--basic-auth={basic_auth}")
        app.start(argv=argv)
