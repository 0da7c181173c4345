"""Spawn overhead, fan-in and wall time of a swarm of N children, against the Celery floor.

Everything is real except the model: the embedded Valkey server, a coordinator and
Celery worker processes (``LocalCluster``, started once and reused: the warm path), and
the root agent driven through ``swarm run --workers 0`` with click's CliRunner. The
model is :class:`~swarm.testing.server.ScriptedModelServer` in this process, answering
every request after ``--latency`` seconds; it stamps when each request arrives (before
that sleep) and when its answer has been written (after it), so the figures below are
the swarm's own overhead, never the model's latency.

Per job (root -> N children -> root)::

    root   turn 0: N ``agent`` calls            turn 1: final answer
    child  turn 0: one ``run_cli`` (echo)       turn 1: final answer

- spawn overhead: root's turn-0 answer sent -> each child's first model request arrived
  (N samples a job);
- fan-in: the last child's final answer sent -> the root's next request arrived;
- wall: the whole ``swarm run`` (ideal: 4 model latencies, whatever N);
- floor: an empty Celery task's round trip (``delay().get()``) on the same Redis, with a
  worker in this process; and a Redis PING.

Where the time goes is split with timestamps the swarm writes anyway (ledger fields and
the swarm's event stream) and Celery's task events (task-sent/-received/-started),
captured in this process. Clocks: model-server figures use ``time.perf_counter``; the
breakdown compares ``time.time`` stamps of processes on this one host.

Run: ``python -m bench.spawn`` (about 2 minutes on 2 cores), ``--smoke`` (about 20 s).
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celery
import celery.contrib.testing.tasks  # registers celery.ping for start_worker
import kombu
import redis as redis_lib
from celery import Celery
from celery.contrib.testing.worker import start_worker
from click.testing import CliRunner

from swarm.cli import main as swarm_cli
from swarm.runtime.local import LocalCluster, wait_for
from swarm.store import keys
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.server import EmbeddedServer
from swarm.testing.handler import Handler, HTTPServer
from swarm.testing.scripts import ByTask, task_of, tool_results, turn_of
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall, review_command

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "scripted-model"
FLOOR_QUEUE = "bench-floor"
JOB_TIMEOUT = 120.0

# -- the scripted model, with timestamps ----------------------------------------------------


class _TimedHandler(Handler):
    """The scripted server's handler, stamping arrival (before the latency sleep) and the
    moment the whole answer was written to the socket."""

    _arrived: tuple[float, float] = (0.0, 0.0)

    def setup(self) -> None:
        super().setup()
        if self.server.owner.nodelay:  # type: ignore[attr-defined]
            # The stock server writes an answer as many small chunks; with Nagle on, the last
            # one waits for the client's delayed ACK (~40 ms on Linux) after "sent".
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        arrived = (time.perf_counter(), time.time())
        super().do_GET()
        self.server.owner.note("models", "", -1, arrived)  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        self._arrived = (time.perf_counter(), time.time())
        super().do_POST()

    def _chat(self, request: dict[str, Any]) -> None:
        super()._chat(request)
        kind = "review" if review_command(request) is not None else "chat"
        self.server.owner.note(kind, task_of(request), turn_of(request),  # type: ignore[attr-defined]
                               self._arrived, failed_result(request))


def failed_result(request: dict[str, Any]) -> str:
    """The first of the request's last tool results that says a command failed (the swarm's
    ``error: ...``, or an exit code but 0), or ""."""
    for result in tool_results(request):
        ended = result.rstrip().rsplit("\n", 1)[-1]
        if result.startswith("error:") or (ended.startswith("[exit code: ")
                                             and ended != "[exit code: 0]"):
            return result[:300]
    return ""


@dataclass
class Stamp:
    kind: str  # chat, review, models
    task: str
    turn: int
    arrived: float  # perf_counter
    sent: float
    arrived_wall: float  # time.time
    sent_wall: float
    failed: str = ""
    """A tool result this request carried that says its command failed (:func:`failed_result`)."""


class _BenchHTTPServer(HTTPServer):
    # socketserver's default listen backlog is 5: when dozens of children connect at once the
    # kernel drops SYNs and the client retries after 1 s, which showed up as spawn overhead.
    request_queue_size = 1024


class TimedModelServer(ScriptedModelServer):
    """:class:`ScriptedModelServer` that records a :class:`Stamp` per request."""

    server_class: type[HTTPServer] = _BenchHTTPServer

    def __init__(self, *, nodelay: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nodelay = nodelay
        self.stamps: list[Stamp] = []
        self._stamps_lock = threading.Lock()

    def note(self, kind: str, task: str, turn: int, arrived: tuple[float, float],
             failed: str = "") -> None:
        stamp = Stamp(kind, task, turn, arrived[0], time.perf_counter(), arrived[1], time.time(),
                      failed)
        with self._stamps_lock:
            self.stamps.append(stamp)

    def take_stamps(self) -> list[Stamp]:
        with self._stamps_lock:
            out, self.stamps = self.stamps, []
        return out

    def __enter__(self) -> TimedModelServer:
        return self.start()

    def start(self) -> TimedModelServer:  # as the parent's, with the timed handler
        if self._httpd is None:
            self._httpd = self.server_class((self.host, self.port), _TimedHandler)
            self._httpd.owner = self
            self.port = self._httpd.server_address[1]
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01},
                name=f"timed-model:{self.port}", daemon=True)
            self._thread.start()
        return self


# -- the floor: a bare Celery round trip, and Celery's task events -------------------------

floor_app = Celery("bench-floor")
floor_app.conf.update(
    task_default_queue=FLOOR_QUEUE, task_serializer="json", result_serializer="json",
    accept_content=["json"], task_acks_late=True, worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False, worker_redirect_stdouts=False,
    broker_connection_retry_on_startup=True, result_expires=600)


@floor_app.task(name="bench.empty")  # type: ignore[untyped-decorator]
def empty() -> None:
    """Does nothing: its round trip is the floor under every child's spawn."""


def celery_floor(samples: int) -> list[float]:
    """Seconds of ``empty.delay().get()`` with a threads-pool worker in this process."""
    out: list[float] = []
    with start_worker(floor_app, pool="threads", concurrency=1, loglevel="WARNING",
                      perform_ping_check=True, shutdown_timeout=10):
        for _ in range(10):
            empty.delay().get(timeout=10)
        for _ in range(samples):
            started = time.perf_counter()
            empty.delay().get(timeout=10)
            out.append(time.perf_counter() - started)
    return out


def redis_floor(client: redis_lib.Redis, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        client.ping()
        out.append(time.perf_counter() - started)
    return out


class EventTap:
    """Celery task events (from the coordinator and the workers), by task id."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.tasks: dict[str, dict[str, float]] = defaultdict(dict)
        self.lock = threading.Lock()
        self.receiver: Any = None
        self.thread: threading.Thread | None = None

    def on_event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type", ""))
        if kind.startswith("task-") and "uuid" in event:
            with self.lock:
                self.tasks[event["uuid"]].setdefault(kind, float(event["timestamp"]))

    def start(self) -> EventTap:
        ready = threading.Event()

        def loop() -> None:
            with self.app.connection_for_read() as conn:
                self.receiver = self.app.events.Receiver(conn, handlers={"*": self.on_event})
                ready.set()
                with contextlib.suppress(Exception):
                    self.receiver.capture(limit=None, timeout=None, wakeup=False)

        self.thread = threading.Thread(target=loop, name="celery-events", daemon=True)
        self.thread.start()
        ready.wait(5)
        time.sleep(0.5)  # let it subscribe before the first job
        return self

    def get(self, task_id: str) -> dict[str, float]:
        with self.lock:
            return dict(self.tasks.get(task_id, {}))

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        if self.thread is not None:
            self.thread.join(timeout=3)


# -- statistics -----------------------------------------------------------------------------


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def p95(xs: list[float]) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}" if x >= 0.0995 else f"{x * 1000:.1f}"


# -- one job --------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Env:
    url: str
    home: Path
    model: TimedModelServer
    client: redis_lib.Redis
    tap: EventTap
    latency: float
    pids: dict[str, int] = field(default_factory=dict)
    jobs: int = 0

    def cpu(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}


@dataclass
class Job:
    n: int
    wall: float
    startup: float  # invoke -> root's first request arrived
    spawn: list[float]
    fanin: float
    redis_commands: int
    cpu: dict[str, float]
    models_requests: int
    reviews: int
    spawn_parts: dict[str, list[float]] = field(default_factory=dict)
    fanin_parts: dict[str, float] = field(default_factory=dict)


SPAWN_PARTS = (
    ("root", "root: answer read, agent tool, spawn request written"),
    ("coordinator", "coordinator: request read, limits, ledger, up to this child's send"),
    ("delivery", "celery: task sent (coordinator) -> task received (worker's consumer)"),
    ("pool", "celery: task received -> task started on a pool thread"),
    ("child_setup", "worker: task started -> first model request (claim, workspace, "
                    "session, prompt)"),
)
FANIN_PARTS = (
    ("child_settle", "worker: last answer read -> run settled (diff, ledger)"),
    ("coordinator", "coordinator: settle read -> root woken (N runs read, session saved)"),
    ("root_resume", "root: woken -> next model request (session load, resume)"),
)


_seed_children = True
_kept_env: dict[str, str] = {}


def configure(seed: bool, sandbox: str) -> None:
    """The settings of every part (``python -m bench --no-seed --sandbox MODE``): whether
    jobs' children start from the root's workspace, and the workers' SWARM_SANDBOX."""
    global _seed_children
    _seed_children = seed
    _kept_env["SWARM_SANDBOX"] = sandbox
    neutral_env()


def seeding() -> bool:
    """See :func:`configure`."""
    return _seed_children


def neutral_env() -> None:
    """Remove every SWARM_/OPENAI_/EVA_ variable from this process but the bench's own
    settings (:func:`configure`): the processes it starts inherit its environment, and a
    benchmark must not depend on the caller's settings."""
    for name in [k for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))]:
        del os.environ[name]
    os.environ.update(_kept_env)


def run_job(env: Env, n: int, command: str = "echo {i} > n.txt") -> Job:
    env.jobs += 1
    tag = f"J{env.jobs}x{os.getpid()}"
    root_key, child_key = f"BENCHROOT-{tag}", f"BENCHCHILD-{tag}-"

    extra = {} if seeding() else {"seed": False}

    def fan_out(request: dict[str, Any]) -> Reply:
        return Reply(tool_calls=[ToolCall("agent", {"message": f"{child_key}{i}: do it", **extra},
                                          id=f"c{i}") for i in range(n)])

    def shell(request: dict[str, Any]) -> Reply:
        i = task_of(request).split(child_key, 1)[1].split(":", 1)[0]
        return Reply(tool_calls=[ToolCall("run_cli", {"command": command.format(i=i)})])

    env.model.responder = ByTask({
        root_key: [fan_out, Reply(content=f"all {n} children answered")],
        child_key: [shell, Reply(content="child done")],
    })
    workspace = env.home / "jobs" / tag
    workspace.mkdir(parents=True)
    cli_env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    cli_env.update(SWARM_BASE_URL=env.model.base_url, SWARM_REDIS_URL=env.url,
                   SWARM_HOME=str(env.home), SWARM_MODEL=MODEL, SWARM_API_KEY="bench",
                   SWARM_RETRIES="1", SWARM_MAX_PARALLEL=str(max(64, n)),
                   SWARM_MAX_CHILDREN=str(max(200, n)))
    env.model.take_stamps()
    commands_before = int(env.client.info("stats")["total_commands_processed"])
    cpu_before = env.cpu()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    watchdog = threading.Timer(JOB_TIMEOUT, _thread.interrupt_main)
    watchdog.start()
    started, started_wall = time.perf_counter(), time.time()
    try:
        result = CliRunner().invoke(swarm_cli, ["run", "--yes", "--workers", "0", "-C",
                                                str(workspace), f"{root_key}: fan out"],
                                    env=cli_env, catch_exceptions=False)
    finally:
        wall = time.perf_counter() - started
        watchdog.cancel()
        for sig, handler in handlers.items():  # `swarm run` makes SIGTERM raise Ctrl-C
            signal.signal(sig, handler)
    if result.exit_code != 0 or f"all {n} children answered" not in result.stdout:
        raise RuntimeError(f"job N={n} failed (exit {result.exit_code}):\n{result.stdout}\n"
                           f"{result.stderr[-3000:]}")
    commands = int(env.client.info("stats")["total_commands_processed"]) - commands_before
    cpu = {k: v - cpu_before[k] for k, v in env.cpu().items()}
    stamps = env.model.take_stamps()
    return analyse(env, n, tag, root_key, child_key, stamps, wall, started, started_wall,
                   commands, cpu)


def analyse(env: Env, n: int, tag: str, root_key: str, child_key: str, stamps: list[Stamp],
            wall: float, started: float, started_wall: float, commands: int,
            cpu: dict[str, float]) -> Job:
    chats = [s for s in stamps if s.kind == "chat"]
    root = {s.turn: s for s in chats if root_key in s.task}
    first: dict[int, Stamp] = {}
    last: dict[int, Stamp] = {}
    pattern = re.compile(re.escape(child_key) + r"(\d+):")
    for s in chats:
        match = pattern.search(s.task)
        if match:
            i = int(match.group(1))
            (first if s.turn == 0 else last)[i] = s
    assert len(first) == n and len(last) == n, (len(first), len(last), n)
    spawn = [first[i].arrived - root[0].sent for i in range(n)]
    final = max(last.values(), key=lambda s: s.sent)
    fanin = root[1].arrived - final.sent
    job = Job(n=n, wall=wall, startup=root[0].arrived - started, spawn=spawn, fanin=fanin,
              redis_commands=commands, cpu=cpu,
              models_requests=sum(1 for s in stamps if s.kind == "models"),
              reviews=sum(1 for s in stamps if s.kind == "review"))
    with contextlib.suppress(Exception):  # the breakdown is best effort
        breakdown(env, job, root, first, final, pattern)
    return job


def breakdown(env: Env, job: Job, root: dict[int, Stamp], first: dict[int, Stamp],
              final: Stamp, pattern: re.Pattern[str]) -> None:
    client: Any = env.client  # decoded strings
    ledger = Ledger(client)
    swarm_id = ledger.latest_swarm()
    assert swarm_id
    events = client.xrange(keys.events(swarm_id))
    queued = {f["agent"]: float(f["ts"]) for _, f in events if f.get("kind") == "queued"}
    joined = [float(f["ts"]) for _, f in events if f.get("kind") == "joined"]
    parts: dict[str, list[float]] = defaultdict(list)
    settled: list[float] = []
    request_created = None
    for agent in ledger.agents(swarm_id):
        if agent.kind != "child":
            continue
        run = client.hgetall(keys.run(agent.run))
        i = int(pattern.search(run["message"]).group(1))  # type: ignore[union-attr]
        if request_created is None:
            request_created = float(client.hget(keys.request(run["request"]), "created"))
        celery_events = env.tap.get(agent.run)
        sent, started = celery_events.get("task-sent"), celery_events.get("task-started")
        received = celery_events.get("task-received")
        parts["root"].append(request_created - root[0].sent_wall)
        if sent is not None:
            parts["coordinator"].append(sent - request_created)
        if sent is not None and received is not None and started is not None:
            parts["delivery"].append(received - sent)
            parts["pool"].append(started - received)
            parts["child_setup"].append(first[i].arrived_wall - started)
        settled.append(float(run["settled"]))
        parts["_queued_to_sent"].append((sent or math.nan) - queued.get(agent.id, math.nan))
    job.spawn_parts = {k: [x for x in v if not math.isnan(x)] for k, v in parts.items()}
    last_settled = max(settled)
    job.fanin_parts = {"child_settle": last_settled - final.sent_wall,
                       "coordinator": joined[-1] - last_settled,
                       "root_resume": root[1].arrived_wall - joined[-1]}


# -- the whole benchmark ----------------------------------------------------------------------


def server_pid(client: redis_lib.Redis) -> int:
    return int(client.info("server")["process_id"])


def machine_info(client: redis_lib.Redis) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].strip()
    server = client.info("server")
    return {"host": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpus": os.cpu_count(), "memory": mem, "python": platform.python_version(),
            "celery": celery.__version__, "kombu": kombu.__version__,
            "redis_py": redis_lib.__version__,
            "server": f"{server.get('server_name', 'redis')} "
                      f"{server.get('valkey_version', server.get('redis_version'))}",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


@contextlib.contextmanager
def swarm_cluster(workers: int, concurrency: int) -> Iterator[tuple[str, Path, LocalCluster]]:
    """A fresh SWARM_HOME with its embedded server, a coordinator and worker processes."""
    home = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    server = EmbeddedServer(home)
    cluster: LocalCluster | None = None
    try:
        url = server.ensure()
        cluster = LocalCluster(url, home, workers=workers, concurrency=concurrency).start()
        wait_for(connect(url), 30, cluster.procs)
        yield url, home, cluster
    finally:
        if cluster is not None:
            cluster.stop()
        server.stop()
        server.release()
        shutil.rmtree(home, ignore_errors=True)


def summarise(jobs: list[Job]) -> dict[str, Any]:
    spawn = [x for j in jobs for x in j.spawn]
    fanin = [j.fanin for j in jobs]
    walls = [j.wall for j in jobs]
    parts = {k: median([x for j in jobs for x in j.spawn_parts.get(k, [])])
             for k, _ in SPAWN_PARTS}
    parts["_queued_to_sent"] = median([x for j in jobs
                                       for x in j.spawn_parts.get("_queued_to_sent", [])])
    return {
        "spawn": {"median": median(spawn), "p95": p95(spawn), "samples": spawn},
        "fanin": {"median": median(fanin), "p95": p95(fanin), "samples": fanin},
        "wall": {"median": median(walls), "p95": p95(walls), "samples": walls},
        "root_startup": median([j.startup for j in jobs]),
        "spawn_breakdown_median": parts,
        "fanin_breakdown_median": {k: median([j.fanin_parts[k] for j in jobs
                                              if k in j.fanin_parts]) for k, _ in FANIN_PARTS},
        "cpu_seconds_per_job": {k: median([j.cpu[k] for j in jobs]) for k in jobs[0].cpu},
        "redis_commands_per_job": median([float(j.redis_commands) for j in jobs]),
        "models_requests_per_job": median([float(j.models_requests) for j in jobs]),
        "reviews_per_job": median([float(j.reviews) for j in jobs]),
        "jobs": [j.__dict__ for j in jobs],
    }


def print_table(out: dict[str, Any]) -> None:
    print("\n".join(table_lines(out)))


def table_lines(out: dict[str, Any]) -> list[str]:
    cfg, sizes, floor = out["config"], out["sizes"], out["floor"]
    lines: list[str] = []

    def w(text: str) -> None:
        lines.extend(text.split("\n"))

    w(f"\nswarm spawn benchmark: {out['machine']['cpus']} CPUs, {cfg['workers']} worker "
      f"process(es) x {cfg['concurrency']} threads, model latency {cfg['latency']:.2f} s/answer, "
      f"{cfg['repeats']} jobs per N, model server TCP_NODELAY "
      f"{'on' if cfg['model_server_nodelay'] else 'off'}")
    w(f"floor: empty Celery task round trip median {ms(floor['celery']['median'])} ms "
      f"(p95 {ms(floor['celery']['p95'])}, n={len(floor['celery']['samples'])}); "
      f"Redis PING median {ms(floor['redis_ping']['median'])} ms")
    base = sizes[str(cfg["sizes"][0])]["wall"]["median"]
    ideal = 4 * cfg["latency"]
    w("")
    w("   N | spawn ms med   p95 | fan-in ms med   p95 | wall s med   p95 | wall/N=1 | "
      "Redis cmds/job/N")
    for n in cfg["sizes"]:
        s = sizes[str(n)]
        w(f"{n:>4} | {ms(s['spawn']['median']):>9} {ms(s['spawn']['p95']):>5} | "
          f"{ms(s['fanin']['median']):>10} {ms(s['fanin']['p95']):>5} | "
          f"{s['wall']['median']:>10.2f} {s['wall']['p95']:>5.2f} | "
          f"{s['wall']['median'] / base:>8.2f} | {s['redis_commands_per_job'] / n:>6.0f}")
    w(f"(ideal wall: {ideal:.2f} s of model latency, 4 answers in a row, whatever N; "
      f"root start-up before its first request: "
      f"{ms(sizes[str(cfg['sizes'][0])]['root_startup'])} ms)")
    w("\nCPU seconds per job (median): " + "; ".join(
        f"N={n}: " + ", ".join(f"{k} {v:.2f}" for k, v in
                              sizes[str(n)]["cpu_seconds_per_job"].items())
        for n in cfg["sizes"]))
    w("\nspawn overhead, median ms per child:")
    w("   N | " + " | ".join(f"{k:>11}" for k, _ in SPAWN_PARTS))
    for n in cfg["sizes"]:
        parts = sizes[str(n)]["spawn_breakdown_median"]
        w(f"{n:>4} | " + " | ".join(f"{ms(parts.get(k)):>11}" for k, _ in SPAWN_PARTS))
    w("fan-in, median ms:")
    w("   N | " + " | ".join(f"{k:>12}" for k, _ in FANIN_PARTS))
    for n in cfg["sizes"]:
        parts = sizes[str(n)]["fanin_breakdown_median"]
        w(f"{n:>4} | " + " | ".join(f"{ms(parts.get(k)):>12}" for k, _ in FANIN_PARTS))
    for k, text in SPAWN_PARTS + FANIN_PARTS:
        w(f"  {k}: {text}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.spawn",
        description="Measure spawn overhead, fan-in and wall time of a swarm of N children "
                    "(real embedded Redis, coordinator and Celery workers; scripted model), "
                    "and the floor of a bare Celery round trip. Prints a table and writes "
                    "JSON to bench/results/.")
    parser.add_argument("--sizes", default="1,10,50",
                        help="comma-separated numbers of children (default: 1,10,50)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="jobs per size (default: 10); spawn gets N samples a job")
    parser.add_argument("--latency", type=float, default=0.2,
                        help="seconds the scripted model waits before each answer (default 0.2)")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes (default 1, as `swarm run` starts)")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="threads per worker process (default 64 = SWARM_MAX_PARALLEL)")
    parser.add_argument("--floor-samples", type=int, default=200,
                        help="empty Celery round trips for the floor (default 200)")
    parser.add_argument("--nagle", action="store_true",
                        help="leave Nagle's algorithm on in the scripted server, as the stock "
                             "ScriptedModelServer does: every answer then reaches the client "
                             "~40 ms after it was written (default: TCP_NODELAY)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny run (N=1,3, 2 jobs each, 50 floor samples; ~20 s), "
                             "written to spawn-smoke.json")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output (default bench/results/spawn.json, "
                             "spawn-smoke.json with --smoke)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out = collect(args)
    print_table(out)
    out_path = args.out or RESULTS / ("spawn-smoke.json" if args.smoke else "spawn.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwritten {out_path} in {out['run_seconds']:.0f} s")


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the parsed ``args``; returns what main() writes."""
    if args.smoke:
        args.sizes, args.repeats, args.floor_samples = "1,3", 2, 50
    sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    neutral_env()  # the workers inherit this environment: keep it neutral
    began = time.perf_counter()

    with swarm_cluster(args.workers, args.concurrency) as (url, home, cluster), \
            TimedModelServer(latency=args.latency, models=[MODEL],
                             nodelay=not args.nagle) as model:
        floor_app.conf.broker_url = url
        floor_app.conf.result_backend = url
        client = connect(url)
        tap = EventTap(floor_app).start()
        try:
            env = Env(url, home, model, client, tap, args.latency)
            env.pids = {"bench (root + model)": os.getpid(), "redis": server_pid(client),
                        "coordinator": cluster.procs[0].pid}
            env.pids.update({f"worker{i}": p.pid for i, p in enumerate(cluster.procs[1:])})
            print(f"cluster ready in {time.perf_counter() - began:.1f} s "
                  f"(pids {[p.pid for p in cluster.procs]}); floor...", file=sys.stderr)
            floor = {"celery": celery_floor(args.floor_samples),
                     "redis_ping": redis_floor(client, 200)}
            warm = run_job(env, min(3, max(sizes)))
            print(f"warm-up job (first on fresh workers, N={warm.n}): wall {warm.wall:.2f} s, "
                  f"spawn median {ms(median(warm.spawn))} ms", file=sys.stderr)
            results: dict[str, Any] = {}
            for n in sizes:
                jobs = []
                for r in range(args.repeats):
                    job = run_job(env, n)
                    jobs.append(job)
                    print(f"N={n} job {r + 1}/{args.repeats}: wall {job.wall:.2f} s, spawn "
                          f"median {ms(median(job.spawn))} ms, fan-in {ms(job.fanin)} ms",
                          file=sys.stderr)
                results[str(n)] = summarise(jobs)
            machine = machine_info(client)
        finally:
            tap.stop()
            client.close()

    out = {
        "benchmark": "spawn",
        "machine": machine,
        "config": {"sizes": sizes, "repeats": args.repeats, "latency": args.latency,
                   "workers": args.workers, "concurrency": args.concurrency,
                   "floor_samples": args.floor_samples, "smoke": args.smoke,
                   "model_server_nodelay": not args.nagle,
                   "child": "1 run_cli turn (echo) + 1 answer",
                   "units": "seconds"},
        "floor": {k: {"median": median(v), "p95": p95(v), "samples": v}
                  for k, v in floor.items()},
        "warmup": warm.__dict__,
        "sizes": results,
        "run_seconds": time.perf_counter() - began,
    }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 of ``python -m bench``: sizes and repeats from the suite's options."""
    sizes = ",".join(str(n) for n in args.spawn_sizes)
    own = ["--sizes", sizes, "--repeats", str(args.spawn_repeats), "--latency", "0.2",
           "--concurrency", str(max(64, max(args.spawn_sizes)))]
    if args.smoke:
        own += ["--floor-samples", "20"]
    spawn_args = build_parser().parse_args(own)
    return collect(spawn_args)


def report(out: dict[str, Any]) -> list[str]:
    return ["1. spawn overhead and fan-in" + table_lines(out)[0].replace(
        "swarm spawn benchmark", ""), *table_lines(out)[1:]]


if __name__ == "__main__":
    main()
