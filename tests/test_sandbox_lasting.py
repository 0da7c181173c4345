"""A box per child (swarm.agent.sandbox.lasting): its commands run one after another in one
box, and each guarantee of a box per command still holds: what a command leaves behind
dies with it, the command cannot reach its runner's channel, a timed-out or cancelled
command's processes are killed while the box goes on, and the box and what is in it end
with the environment."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.agent import sandbox
from swarm.agent.sandbox import netslots
from swarm.agent.sandbox.lasting import box_python
from swarm.agent.shell import KILL_GRACE, LocalEnvironment
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not sandbox.probe().ok or not box_python(),
                                reason=f"no sandbox, or no python3 in it, here: "
                                       f"{sandbox.probe().reason}")

#: The command lines of the box's processes but its init and runner (pid 1 and 2).
OTHERS = ("for p in /proc/[0-9]*; do n=${p#/proc/}; [ $n -gt 2 ] && [ $n != $$ ] && "
          "tr '\\0' ' ' < $p/cmdline 2>/dev/null && echo; done; true")


@pytest.fixture
def env(outside_tmp: Path) -> Iterator[LocalEnvironment]:
    ws = outside_tmp / "ws"
    ws.mkdir(exist_ok=True)
    made = LocalEnvironment(ws, sandbox="bwrap", die_with_runner=True)
    assert made.lasting
    yield made
    made.close()


def host_processes(word: str) -> list[int]:
    """Pids of this host's processes whose command line holds ``word``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if word.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_commands_leftover_processes_do_not_reach_the_next_command(
        env: LocalEnvironment) -> None:
    """A command's background jobs, detached ones (setsid, nohup) too, are killed when it
    ends, as when its box ended with it: the next command of the box finds none."""
    first = env.execute("echo kept > /tmp/mark; sleep 3001 & setsid sleep 3002 & "
                        "(nohup sleep 3003 >/dev/null 2>&1 &); echo started", 30)
    assert (first.exit_code, first.output) == (0, "started\n"), first.output
    second = env.execute(f"cat /tmp/mark; {OTHERS}", 30)
    assert second.exit_code == 0
    assert second.output.split("\n")[0] == "kept"  # the same box
    assert "sleep" not in second.output, second.output
    assert host_processes("sleep 300") == []


def test_nothing_of_one_childs_box_reaches_the_next_childs(outside_tmp: Path) -> None:
    """The box ends with its environment (a child's turn): the next child's box, in the
    same workspace, starts with an empty /tmp and none of the first one's processes, and
    none is left on the host."""
    ws = outside_tmp / "ws"
    ws.mkdir()
    first = LocalEnvironment(ws, sandbox="bwrap", die_with_runner=True)
    # A process started while the command runs, left to the box's end (no sweep would catch
    # it before the next command: it is the command that waits for it).
    done = first.execute("echo secret > /tmp/left; echo y > /dev/shm/left; "
                         "setsid sleep 3011 & echo ok", 30)
    assert done.output == "ok\n"
    assert host_processes(str(ws))  # its box, between its commands
    first.close()
    assert host_processes(str(ws)) == [] and host_processes("sleep 3011") == []
    second = LocalEnvironment(ws, sandbox="bwrap", die_with_runner=True)
    try:
        seen = second.execute(f"ls /tmp /dev/shm; {OTHERS}", 30)
        assert "left" not in seen.output and "sleep" not in seen.output, seen.output
    finally:
        second.close()


def test_a_command_cannot_reach_its_runners_channel(env: LocalEnvironment) -> None:
    """The runner is not dumpable: the command (same uid, no capability) can neither open
    its descriptors (the worker's socket, the lifeline), take them with pidfd_getfd, nor
    write its memory; so it cannot send the worker a fake end or run anything past its
    limits through it."""
    steal = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "pidfd = libc.syscall(434, 2, 0)\n"  # pidfd_open(runner)
        "got = [libc.syscall(438, pidfd, fd, 0) for fd in range(3, 12)]\n"  # pidfd_getfd
        "print('stolen' if any(g >= 0 for g in got) else 'refused')\n")
    result = env.execute(
        "ls /proc/2/fd; echo ls=$?; echo X0 > /proc/2/fd/3; echo write=$?; "
        "head -c 1 /proc/2/mem; echo mem=$?; "
        f"python3 -c \"{steal}\"", 30)
    out = result.output
    assert "ls=2" in out and "write=1" in out and "mem=1" in out, out
    assert "refused" in out and "stolen" not in out, out
    assert out.count("Permission denied") >= 3, out
    assert env.execute("echo still", 30).output == "still\n"


def test_a_command_holds_no_descriptor_but_its_input_and_output(env: LocalEnvironment) -> None:
    """A command gets its input (``/dev/null``) and its output pipe, nothing of its runner
    (the worker's socket, the lifeline, its wake-up pipe, the last command's output)."""
    for _ in range(2):
        result = env.execute("ls /proc/$$/fd; readlink /proc/$$/fd/0", 30)
        assert (result.output, result.exit_code) == ("0\n1\n2\n/dev/null\n", 0), result.output


_SPAWN = r'''
import posix, sys
runner = {"__name__": "runner"}
exec(open(sys.argv[1]).read(), runner)
if sys.argv[2] == "fork":
    def refuse(*args, **kwargs):
        raise NotImplementedError("setsid")  # as where libc has no POSIX_SPAWN_SETSID
    posix.posix_spawnp = refuse
r, w = posix.pipe()
pid = runner["start"](b"echo ran; ls /proc/$$/fd; read -a f < /proc/$$/stat; "
                      b"[ ${f[5]} = $$ ] && echo leader; grep SigIgn /proc/$$/status", w)
posix.close(w)
out = b""
while True:
    chunk = posix.read(r, 65536)
    if not chunk:
        break
    out += chunk
posix.waitpid(pid, 0)
sys.stdout.write(out.decode())
'''


@pytest.mark.parametrize("way", ["spawn", "fork"])
def test_the_runner_starts_a_command_alone_in_its_session_with_default_signals(
        way: str) -> None:
    """Spawned (or forked, where libc cannot start a session with posix_spawn): the
    command leads a session of its own, holds its input and output only, and ignores no
    signal Python ignores (SIGPIPE, SIGXFSZ)."""
    from swarm.agent.sandbox.lasting import RUNNER

    done = subprocess.run([sys.executable, "-c", _SPAWN, str(RUNNER), way],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    ran, *fds, leader, ignored = done.stdout.splitlines()
    assert (ran, fds, leader) == ("ran", ["0", "1", "2"], "leader"), done.stdout
    assert int(ignored.split()[1], 16) & (1 << 12 | 1 << 24) == 0, ignored


def test_a_timed_out_command_is_killed_and_the_box_goes_on(env: LocalEnvironment) -> None:
    """SIGTERM reaches the command's process group through the runner (a trap sees it),
    SIGKILL after the grace when it stays, and what it started is gone; the box it ran in
    serves the next command."""
    env.execute("echo kept > /tmp/mark", 30)
    began = time.monotonic()
    result = env.execute("trap 'echo got-term' TERM; sleep 3021 & "
                         "while :; do sleep 0.05; done", 1)
    assert result.timed_out and result.exit_code is None
    assert "got-term" in result.output, result.output  # SIGTERM first, then SIGKILL
    assert time.monotonic() - began < 1 + KILL_GRACE + 1.5
    after = env.execute(f"cat /tmp/mark; {OTHERS}", 30)
    assert after.output.split("\n")[0] == "kept", after.output  # the same box
    assert "sleep" not in after.output, after.output


def test_a_cancelled_command_is_killed_at_once(outside_tmp: Path) -> None:
    cancel = threading.Event()
    env = LocalEnvironment(outside_tmp, sandbox="bwrap", die_with_runner=True, cancel=cancel)
    try:
        env.execute("true", 30)
        threading.Timer(0.5, cancel.set).start()
        began = time.monotonic()
        result = env.execute("sleep 3031; echo finished", 30)
        assert result.cancelled and "finished" not in result.output
        assert time.monotonic() - began < 0.5 + KILL_GRACE + 1
        cancel.clear()
        assert "sleep" not in env.execute(OTHERS, 30).output
    finally:
        env.close()


def test_output_is_capped_and_ends_with_its_command(env: LocalEnvironment) -> None:
    result = env.execute("head -c 100000 /dev/zero | tr '\\0' a; echo; echo end", 30,
                         output_cap=100)
    assert result.cut_chars > 0 and result.output.endswith("end\n"), result.output[-80:]
    assert env.execute("echo next", 30).output == "next\n"


def test_a_killed_runner_ends_the_box_and_the_next_command_gets_a_new_one(
        env: LocalEnvironment) -> None:
    env.execute("echo kept > /tmp/mark", 30)
    lost = env.execute("kill -KILL 2; sleep 5", 30)
    assert "box ended with the command" in lost.output
    again = env.execute("cat /tmp/mark 2>/dev/null || echo fresh", 30)
    assert again.output == "fresh\n"


def test_the_box_is_started_once_for_the_commands_of_a_child(env: LocalEnvironment) -> None:
    """The point of it: a child's commands share one box (one bubblewrap on the host)."""
    env.execute("true", 30)
    boxes = host_processes(str(env.workspace))
    for _ in range(5):
        env.execute("true", 30)
    assert host_processes(str(env.workspace)) == boxes
    assert os.getpid() not in boxes


def test_a_box_between_commands_dies_with_its_worker(outside_tmp: Path) -> None:
    """A child's box waits between its commands (while the model thinks): a worker killed
    then takes it along, and what the last command left cannot outlive it."""
    ws = outside_tmp / "ws"
    ws.mkdir()
    worker = (
        "import sys\n"
        "from pathlib import Path\n"
        "from swarm.agent.shell import LocalEnvironment\n"
        f"env = LocalEnvironment(Path({str(ws)!r}), sandbox='bwrap', die_with_runner=True)\n"
        "assert env.execute('true', 30).exit_code == 0\n"
        "print('idle', flush=True)\n"
        "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", worker], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().strip() == "idle"
        assert host_processes(str(ws)), "no box between its commands"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stdin.close()
    wait_until(lambda: host_processes(str(ws)) == [], "the box to end with its worker",
               timeout=30)


def test_boxes_start_and_run_where_the_workers_descriptors_pass_1024(outside_tmp: Path) -> None:
    """A worker holding hundreds of children's boxes has descriptors numbered past 1,024,
    which select() refuses: the box's start, its network's, its runner and the command's end
    are waited for without it (at 500 children, half the commands failed so)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    netslots.POOL.sweep(idle=0)  # a new network slot, made past 1,024 too
    held = [os.open(os.devnull, os.O_RDONLY)]
    try:
        while held[-1] < 1100:
            held.append(os.dup(held[0]))
        ws = outside_tmp / "ws"
        ws.mkdir()
        env = LocalEnvironment(ws, sandbox="bwrap", die_with_runner=True)
        try:
            first, second = env.execute("echo one", 30), env.execute("echo two", 30)
            assert (first.exit_code, first.output) == (0, "one\n"), first.output
            assert (second.exit_code, second.output) == (0, "two\n"), second.output
            assert env.lasting and env._box is not None and env._box.sock is not None
            assert env._box.sock.fileno() > 1024
        finally:
            env.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def resident_stack_kib() -> int:
    """KiB of the calling thread's stack in memory (glibc's ``pthread_getattr_np``, then
    ``mincore`` over the stack)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(256)
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    base, size = ctypes.c_void_p(), ctypes.c_size_t()
    assert libc.pthread_attr_getstack(attr, ctypes.byref(base), ctypes.byref(size)) == 0
    libc.pthread_attr_destroy(attr)
    page = os.sysconf("SC_PAGE_SIZE")
    pages = (ctypes.c_ubyte * (size.value // page))()
    assert libc.mincore(base, size, pages) == 0, os.strerror(ctypes.get_errno())
    return sum(p & 1 for p in pages) * page // 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's threads")
def test_waiting_on_a_box_leaves_no_more_on_the_threads_stack_than_a_command_outside_one(
        env: LocalEnvironment, tmp_path: Path) -> None:
    """A worker runs each live child in a thread of its own, and what a wait leaves on the
    thread's stack stays in memory as long as the thread: waiting on the box by
    ``select.select`` (three 16 KiB arrays on the stack) cost each child 24 KiB of the
    worker's memory that a command outside a box did not."""
    bare = LocalEnvironment(tmp_path, sandbox="none")
    found: dict[str, int] = {}

    def run(name: str, environment: LocalEnvironment) -> None:
        assert environment.execute("true", 30).exit_code == 0  # a box starts, and is waited on
        found[name] = resident_stack_kib()

    # Stacks of sizes of their own: glibc gives a new thread a cached stack of an ended one
    # (its pages in memory still) only as large as it asks for or larger.
    default = threading.stack_size()
    try:
        for name, environment, kib in (("outside", bare, 1024), ("boxed", env, 1040)):
            threading.stack_size(kib * 1024)
            thread = threading.Thread(target=run, args=(name, environment))
            thread.start()
            thread.join()
    finally:
        threading.stack_size(default)
    assert found["boxed"] <= found["outside"] + 8, found


def test_a_box_started_ahead_outlives_the_thread_that_asked_and_runs_the_commands(
        env: LocalEnvironment) -> None:
    """A child's box starts while its model thinks (:meth:`LocalEnvironment.warm`), on a
    thread that lasts: a box dies with the thread that started it, and the run's thread
    that asks may be gone before the first command (here it is)."""
    asker = threading.Thread(target=env.warm)
    asker.start()
    asker.join()
    assert env._warming is not None
    env._warming.result(timeout=30)  # started, with no command
    boxes = host_processes(str(env.workspace))
    assert boxes
    for _ in range(3):
        done = env.execute("echo ran", 30)
        assert (done.output, done.exit_code) == ("ran\n", 0)
    assert host_processes(str(env.workspace)) == boxes  # the first command ran in it
    env.close()
    wait_until(lambda: host_processes(str(env.workspace)) == [], "the box to end")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_a_run_in_its_own_mount_namespace_starts_its_box_there(outside_tmp: Path) -> None:
    """A run working in a view has a mount namespace of its own, which its box must copy:
    its box is not started ahead on another thread (in the process's namespace)."""
    from swarm.workspace import views

    ws = outside_tmp / "ws"
    (ws / "inner").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(ws / "inner")], check=True)
    try:
        (ws / "inner" / "seen-outside-the-run").write_text("x")
        env = LocalEnvironment(ws, sandbox="bwrap", die_with_runner=True)
        out: list[str] = []

        def run() -> None:
            assert views.isolate(ws, ws / "kept")  # unmounts inner, for this thread only
            try:
                env.warm()
                if env._warming is not None:  # started ahead after all: it ran first
                    env._warming.result()
                out.append(env.execute("ls inner", 30).output)
                env.close()
            finally:
                views.rejoin()

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert out == [""]
    finally:
        subprocess.run(["umount", "-l", str(ws / "inner")], check=True)


def test_no_box_is_started_ahead_once_the_environment_was_closed(env: LocalEnvironment) -> None:
    """A run whose workspace arrives after it closed its environment (cancelled, or its
    model failed, before its first step) starts no box that nothing would close."""
    env.close()
    env.warm()
    if env._warming is not None:
        env._warming.result(timeout=30)
    assert env._box is None
    assert host_processes(str(env.workspace)) == []
