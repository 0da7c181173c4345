"""Machinery shared by the benchmarks of ``python -m bench``.

Reused from :mod:`bench.spawn`: the timed scripted model (:class:`TimedModelServer`, TCP_NODELAY,
a stamp per request), statistics and machine info. Added here:

- :class:`Cluster`: an embedded server, a coordinator and any mix of worker processes (each
  its own concurrency, Celery hostname, and optionally its own host name, via a UTS namespace,
  and its own ``SWARM_HOME``: a second "host" on the same Redis);
- :class:`JobScript`: the scripted model for the benchmark job (a root fanning out to N
  children, each doing T turns of one shell command, then answering; or one sequential agent
  doing all N x T turns);
- :func:`run_root`: a root agent driven through ``swarm run --workers 0`` in this process;
- :class:`Sampler`: per-process peak RSS, PSS and CPU of process trees, from ``/proc``;
- :func:`run_process`: a command as a subprocess, with its wall time, CPU (``wait4``) and
  the memory of its whole process tree.
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_lib
from click.testing import CliRunner

from bench.hosts import HostSpec, host_argv, uts_works
from bench.spawn import (
    MODEL,
    RESULTS,
    Stamp,
    TimedModelServer,
    configure,
    machine_info,
    median,
    neutral_env,
    p95,
    seeding,
)
from swarm.cli import main as swarm_cli
from swarm.runtime.local import STOP_GRACE, alive
from swarm.store.connection import connect
from swarm.store.server import EmbeddedServer
from swarm.testing.scripts import task_of, turn_of
from swarm.testing.server import Reply, ToolCall

__all__ = ["MODEL", "RESULTS", "Cluster", "JobScript", "Sampler", "Stamp", "TimedModelServer",
           "busy_seconds", "configure", "machine_info", "median", "neutral_env", "p95",
           "run_process", "run_root", "seeding"]

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")


_results_dir = RESULTS


def results_dir(path: Path | None = None) -> Path:
    """Where results go (default bench/results/); ``path`` changes it."""
    global _results_dir
    if path is not None:
        _results_dir = path
    return _results_dir


def write_result(name: str, smoke: bool, data: dict[str, Any]) -> Path:
    path = results_dir() / (f"{name}-smoke.json" if smoke else f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


# -- /proc ------------------------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        out.extend(int(x) for x in text.split())
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children_of(p))
    return out


def status(pid: int) -> dict[str, int | str]:
    """VmRSS, VmHWM (kB), Threads and Name of a process from /proc/PID/status; {} if gone."""
    out: dict[str, int | str] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            out[key] = int(value.split()[0])
        elif key == "Name":
            out[key] = value.strip()
    return out


def rss_kb(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KB
    except (OSError, IndexError, ValueError):
        return 0


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def starttime(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Sampler:
    """Samples the process trees under ``roots`` every ``interval`` seconds.

    Per process it keeps the peak resident set (VmHWM, which the kernel tracks exactly: a
    sample only has to see the process once, late in its life), the last CPU seconds seen
    and its name; over time, the peak of the summed RSS and of the summed PSS (shared pages
    divided among the processes sharing them: what the tree really holds).
    """

    def __init__(self, roots: list[int] | Callable[[], list[int]], interval: float = 0.1,
                 pss_every: int = 5) -> None:
        self.roots = roots
        self.interval = interval
        self.pss_every = pss_every
        self.hwm: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self.name: dict[int, str] = {}
        self.born: dict[int, str] = {}
        self.peak_rss_total = 0
        self.peak_pss_total = 0
        self.peak_procs = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        roots = self.roots() if callable(self.roots) else self.roots
        pids = [p for r in roots for p in tree(r)]
        total = 0
        for pid in pids:
            st = status(pid)
            if not st:
                continue
            self.hwm[pid] = max(self.hwm.get(pid, 0), int(st.get("VmHWM", 0)))
            self.name[pid] = str(st.get("Name", "?"))  # the last: a fork execs later
            if pid not in self.born:
                self.born[pid] = starttime(pid)
            total += int(st.get("VmRSS", 0))
            self.cpu[pid] = max(self.cpu.get(pid, 0.0), cpu_seconds(pid))
        self.peak_rss_total = max(self.peak_rss_total, total)
        self.peak_procs = max(self.peak_procs, len(pids))
        if self.samples % self.pss_every == 0:
            self.peak_pss_total = max(self.peak_pss_total, sum(pss_kb(p) for p in pids))
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Sampler:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self

    def leftovers(self) -> list[int]:
        """Processes seen in the tree that still run (the same process: same start time)."""
        return [p for p, born in self.born.items() if born and starttime(p) == born]

    def summed_peak_mib(self, names: tuple[str, ...] | None = None) -> float:
        return sum(v for p, v in self.hwm.items()
                   if names is None or self.name.get(p) in names) / 1024

    def by_name(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for pid, kb in self.hwm.items():
            row = out.setdefault(self.name.get(pid, "?"), {"procs": 0, "peak_mib_sum": 0.0,
                                                           "cpu_s": 0.0})
            row["procs"] += 1
            row["peak_mib_sum"] += kb / 1024
            row["cpu_s"] += self.cpu.get(pid, 0.0)
        return out


@dataclass
class ProcessRun:
    wall: float
    returncode: int
    cpu_user: float
    cpu_sys: float
    maxrss_mib: float
    """ru_maxrss of wait4: the largest single process of the tree, not a sum."""
    summed_peak_mib: float
    peak_total_rss_mib: float
    peak_total_pss_mib: float
    peak_procs: int
    processes: int
    by_name: dict[str, dict[str, float]]
    started: float = 0.0
    """perf_counter when the process was started, and when it was reaped."""
    ended: float = 0.0

    @property
    def cpu(self) -> float:
        return self.cpu_user + self.cpu_sys


def run_process(argv: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None,
                stdout: Any = subprocess.DEVNULL, interval: float = 0.1) -> ProcessRun:
    """Run ``argv``; wall time, CPU of it and every descendant it waited for (``wait4``), and
    the memory of its process tree sampled from /proc."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=subprocess.STDOUT, start_new_session=True)
    sampler = Sampler([proc.pid], interval=interval).start()
    killer = threading.Timer(timeout, lambda: _killpg(proc.pid))
    killer.start()
    try:
        _, code, usage = os.wait4(proc.pid, 0)
    finally:
        wall = time.perf_counter() - started
        killer.cancel()
        sampler.stop()
        _killpg(proc.pid)  # anything it left behind in its group
        left = [p for p in sampler.leftovers() if p != os.getpid()]
        for pid in left:  # e.g. a Valkey server (own session) of a process that crashed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if left:
            log(f"run_process: killed {len(left)} leftover process(es) of {argv[0]}: "
                f"{sorted({sampler.name.get(p, '?') for p in left})}")
    proc.returncode = os.waitstatus_to_exitcode(code)
    return ProcessRun(wall=wall, returncode=proc.returncode, cpu_user=usage.ru_utime,
                      cpu_sys=usage.ru_stime, maxrss_mib=usage.ru_maxrss / 1024,
                      summed_peak_mib=sampler.summed_peak_mib(),
                      peak_total_rss_mib=sampler.peak_rss_total / 1024,
                      peak_total_pss_mib=sampler.peak_pss_total / 1024,
                      peak_procs=sampler.peak_procs, processes=len(sampler.hwm),
                      by_name=sampler.by_name(), started=started, ended=started + wall)


def _killpg(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


# -- the cluster --------------------------------------------------------------------------------


@dataclass
class WorkerSpec:
    concurrency: int
    uts_host: str = ""
    """Run the worker under this host name (a UTS namespace), with its own SWARM_HOME."""


@dataclass
class Cluster:
    """A fresh SWARM_HOME with its embedded server, a coordinator and worker processes.

    Like :class:`swarm.runtime.local.LocalCluster`, with workers that may differ (concurrency,
    host name). Every process runs in its own session and is killed with its group."""

    workers: list[WorkerSpec]
    home: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="swarm-bench-")))
    url: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    uts: bool = False
    """True when the "hosts" really run under other host names."""

    def __post_init__(self) -> None:
        self.server = EmbeddedServer(self.home)
        self._logs: list[Any] = []

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for n, p in self.procs.items() if n.startswith("worker")]

    def _spawn(self, name: str, argv: list[str], home: Path) -> None:
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop())
        self._logs.append(out)
        env = {**os.environ, "SWARM_REDIS_URL": self.url, "SWARM_HOME": str(home),
               "SWARM_PARENT_PID": str(os.getpid())}
        self.procs[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def start(self, timeout: float = 60.0) -> Cluster:
        self.url = self.server.ensure()
        swarm = [sys.executable, "-m", "swarm"]
        self._spawn("coordinator", [*swarm, "coordinator", "--name", f"bench-{os.getpid()}"],
                    self.home)
        self.uts = any(w.uts_host for w in self.workers) and uts_works()
        for i, spec in enumerate(self.workers):
            argv = [*swarm, "worker", "--concurrency", str(spec.concurrency), "--loglevel",
                    "WARNING"]
            home = self.home
            if spec.uts_host and self.uts:
                home = self.home / "hosts" / spec.uts_host
                home.mkdir(parents=True, exist_ok=True)
                argv = host_argv(HostSpec(spec.uts_host),
                                 [*argv, "--hostname", f"swarm@{spec.uts_host}"])
            else:
                label = spec.uts_host or f"w{i}"
                argv += ["--hostname", f"bench{i}-{label}-{os.getpid()}@{socket.gethostname()}"]
            self._spawn(f"worker{i}", argv, home)
        client = connect(self.url)
        deadline = time.monotonic() + timeout
        try:
            while len(alive(client, "worker")) < len(self.workers) or not alive(
                    client, "coordinator"):
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"bench cluster: {name} exited with {proc.returncode}"
                                           f"; see {self.home}/logs/{name}.log")
                if time.monotonic() > deadline:
                    raise RuntimeError("bench cluster: workers did not answer in time")
                time.sleep(0.05)
        finally:
            client.close()
        return self

    def stop(self) -> None:
        for proc in self.procs.values():
            _killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(proc.pid)
                proc.wait(timeout=5)
        for out in self._logs:
            out.close()
        self.procs.clear()
        self.server.stop()
        self.server.release()

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            shutil.rmtree(self.home, ignore_errors=True)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


# -- the benchmark job -----------------------------------------------------------------------


@dataclass
class JobScript:
    """The scripted model of one benchmark job, keyed by a tag unique to the job.

    - root (task ``{tag}ROOT: ...``): turn 0 calls ``agent`` ``n`` times; turn 1 answers;
    - child ``i`` (task ``{tag}CHILD-{i}: ...``): turns 0..T-1 each run one shell command,
      turn T answers (T + 1 model calls, T commands);
    - sequential (task ``{tag}SEQ: ...``): N x T turns each running one command, then answers.
    """

    tag: str
    n: int
    turns: int
    command: str = "echo {i}.{k} >> out.txt"
    seed: bool = field(default_factory=lambda: seeding())
    """Children start from the root's workspace (False: ``seed: false``, empty folders);
    by default as ``python -m bench --no-seed`` says."""

    @property
    def root_task(self) -> str:
        return f"{self.tag}ROOT: fan out {self.n} parts"

    def child_task(self, i: int) -> str:
        return f"{self.tag}CHILD-{i}: do part {i} in {self.turns} steps"

    @property
    def sequential_task(self) -> str:
        return f"{self.tag}SEQ: do {self.n} parts of {self.turns} steps each, one after another"

    @property
    def root_answer(self) -> str:
        return f"all {self.n} children answered"

    def child_answer(self, i: int) -> str:
        return f"part {i} done"

    def child_index(self, task: str) -> int | None:
        match = re.search(re.escape(self.tag) + r"CHILD-(\d+):", task)
        return int(match.group(1)) if match else None

    def __call__(self, request: dict[str, Any]) -> Reply:
        task, turn = task_of(request), turn_of(request)
        if task.startswith(f"{self.tag}ROOT"):
            if turn == 0:
                extra = {} if self.seed else {"seed": False}
                return Reply(tool_calls=[ToolCall("agent", {"message": self.child_task(i),
                                                            **extra},
                                                  id=f"c{i}") for i in range(self.n)])
            return Reply(content=self.root_answer)
        i = self.child_index(task)
        if i is not None:
            if turn < self.turns:
                return Reply(tool_calls=[ToolCall("run_cli", {
                    "command": self.command.format(i=i, k=turn)})])
            return Reply(content=self.child_answer(i))
        if task.startswith(f"{self.tag}SEQ"):
            if turn < self.n * self.turns:
                i, k = divmod(turn, self.turns)
                return Reply(tool_calls=[ToolCall("run_cli", {
                    "command": self.command.format(i=i, k=k)})])
            return Reply(content=f"all {self.n} parts done")
        return Reply(content=f"[bench model: no script for {task[:60]!r}]")


def model_env(model: Any) -> dict[str, str]:
    """The settings a `swarm run` needs to talk to the scripted model."""
    return {"SWARM_BASE_URL": model.base_url, "SWARM_MODEL": MODEL, "SWARM_API_KEY": "bench",
            "SWARM_RETRIES": "1", "SWARM_YES": "1"}


@dataclass
class RootRun:
    wall: float
    stamps: list[Stamp]
    stdout: str


_jobs = 0


def new_tag() -> str:
    global _jobs
    _jobs += 1
    return f"B{os.getpid()}J{_jobs}"


def run_root(cluster: Cluster, model: Any, script: JobScript, *,
             max_parallel: int, timeout: float = 180.0,
             workspace: Path | None = None) -> RootRun:
    """Run the root of ``script`` as ``swarm run --workers 0`` in this process, on ``cluster``
    (in ``workspace``; default a new empty folder)."""
    model.responder = script
    if workspace is None:
        workspace = cluster.home / "jobs" / script.tag
        workspace.mkdir(parents=True)
    env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(model_env(model))
    env.update(SWARM_REDIS_URL=cluster.url, SWARM_HOME=str(cluster.home),
               SWARM_MAX_PARALLEL=str(max_parallel),
               SWARM_MAX_CHILDREN=str(max(200, script.n)))
    model.take_stamps()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    watchdog = threading.Timer(timeout, _thread.interrupt_main)
    watchdog.start()
    started = time.perf_counter()
    try:
        result = CliRunner().invoke(swarm_cli, ["run", "--yes", "--new", "--workers", "0", "-C",
                                                str(workspace), script.root_task],
                                    env=env, catch_exceptions=False)
    finally:
        wall = time.perf_counter() - started
        watchdog.cancel()
        for sig, handler in handlers.items():  # `swarm run` makes SIGTERM raise Ctrl-C
            signal.signal(sig, handler)
    if result.exit_code != 0 or script.root_answer not in result.stdout:
        raise RuntimeError(f"job {script.tag} N={script.n} failed (exit {result.exit_code}):\n"
                           f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return RootRun(wall, model.take_stamps(), result.stdout)


@dataclass
class JobTimes:
    """What the model server saw of one root -> N children -> root job."""

    phase: float
    """Root's fan-out answer sent -> root's next request arrived (the children's part)."""
    spawn: list[float]
    """Fan-out answer sent -> each child's first request arrived."""
    turn_gaps: list[float]
    """A child's answer sent -> its next request arrived (command, saves, progress)."""
    first_gaps: list[float]
    """The same after a child's first answer only: its first command (its box's start)."""
    fanin: float
    startup: float
    models_requests: int
    peak_concurrent_requests: int


def analyse(script: JobScript, run: RootRun, invoked_at: float | None = None) -> JobTimes:
    chats = [s for s in run.stamps if s.kind == "chat"]
    root = {s.turn: s for s in chats if s.task.startswith(f"{script.tag}ROOT")}
    per_child: dict[int, dict[int, Stamp]] = {}
    for s in chats:
        i = script.child_index(s.task)
        if i is not None:
            per_child.setdefault(i, {})[s.turn] = s
    missing = [i for i in range(script.n) if len(per_child.get(i, {})) != script.turns + 1]
    if missing or 0 not in root or 1 not in root:
        raise RuntimeError(f"job {script.tag}: incomplete stamps (children {missing[:5]}...)")
    failed = [s for s in chats if s.failed and script.child_index(s.task) is not None]
    if failed:  # a figure of commands that did not run measures nothing
        raise RuntimeError(f"job {script.tag}: {len(failed)} of the children's commands failed, "
                           f"the first: {failed[0].failed!r}")
    spawn = [per_child[i][0].arrived - root[0].sent for i in range(script.n)]
    gaps = [per_child[i][k + 1].arrived - per_child[i][k].sent
            for i in range(script.n) for k in range(script.turns)]
    last = max(per_child[i][script.turns].sent for i in range(script.n))
    events = sorted([(s.arrived, 1) for s in chats] + [(s.sent, -1) for s in chats])
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return JobTimes(phase=root[1].arrived - root[0].sent, spawn=spawn, turn_gaps=gaps,
                    first_gaps=gaps[::script.turns] if script.turns else [],
                    fanin=root[1].arrived - last,
                    startup=(root[0].arrived - invoked_at) if invoked_at else 0.0,
                    models_requests=sum(1 for s in run.stamps if s.kind == "models"),
                    peak_concurrent_requests=peak)


@contextlib.contextmanager
def model_server(latency: float, processes: int = 0) -> Iterator[Any]:
    """The timed scripted model: in this process, or in ``processes`` of its own
    (:class:`bench.model_procs.ModelProcesses`)."""
    if processes:
        from bench.model_procs import ModelProcesses

        with ModelProcesses(latency, processes) as procs:
            yield procs
        return
    with TimedModelServer(latency=latency, models=[MODEL], nodelay=True) as model:
        yield model


def redis_info(client: redis_lib.Redis) -> dict[str, Any]:
    info = client.info("all")
    return {"commands": int(info["total_commands_processed"]),
            "net_in": int(info["total_net_input_bytes"]),
            "net_out": int(info["total_net_output_bytes"]),
            "used_memory": int(info["used_memory"]),
            "commandstats": {k[len("cmdstat_"):]: int(v["calls"]) for k, v in info.items()
                             if k.startswith("cmdstat_")}}


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
