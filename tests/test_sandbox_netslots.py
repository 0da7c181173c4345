"""Network slots (swarm.agent.sandbox.netslots): a box's network namespace is set up once
and lent to one box at a time. Two boxes never share one at once, nothing a box left
listening reaches the next box in its slot, the deny routes hold there, and a slot whose
slirp4netns died is dropped for a new one."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.agent import sandbox
from swarm.agent.sandbox import netslots
from swarm.agent.sandbox.lasting import box_python
from swarm.agent.shell import LocalEnvironment
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(not sandbox.probe().ok or not box_python(),
                                reason=f"no sandbox, or no python3 in it, here: "
                                       f"{sandbox.probe().reason}")

NETNS = "readlink /proc/self/ns/net"


@pytest.fixture(autouse=True)
def empty_pool() -> Iterator[None]:
    netslots.POOL.sweep(idle=0)
    yield
    netslots.POOL.sweep(idle=0)


def env_in(folder: Path, name: str) -> LocalEnvironment:
    ws = folder / name
    ws.mkdir()
    made = LocalEnvironment(ws, sandbox="bwrap", die_with_runner=True)
    assert made.choice.box is not None and made.choice.box.net.mode == "user", \
        made.choice.summary
    return made


def netns(env: LocalEnvironment) -> str:
    result = env.execute(NETNS, 30)
    assert result.exit_code == 0 and result.output.startswith("net:["), result.output
    return result.output.strip()


def test_a_slot_is_lent_to_one_box_at_a_time_and_again_once_that_box_is_gone(
        outside_tmp: Path) -> None:
    first, second = env_in(outside_tmp, "a"), env_in(outside_tmp, "b")
    try:
        one, two = netns(first), netns(second)
        assert one != two  # both live: a slot each
        first.close()
        third = env_in(outside_tmp, "c")
        try:
            assert netns(third) == one  # the first's slot, lent again
            assert "tap0" in third.execute("cat /proc/net/dev", 30).output
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def test_a_box_listening_in_its_slot_is_reached_by_no_other_box(outside_tmp: Path) -> None:
    """While a command of one box listens on its loopback (and an abstract socket), boxes
    made meanwhile get other slots and reach neither; the box that gets its slot after it
    closed finds nothing there either."""
    listen = ("import socket, os\n"
              "tcp = socket.socket(); tcp.bind(('127.0.0.1', 47123)); tcp.listen()\n"
              "uds = socket.socket(socket.AF_UNIX); uds.bind('\\0swarm-slot-test'); uds.listen()\n"
              "print('listening', flush=True)\n"
              "import time; time.sleep(60)\n")
    probe = ("import socket\n"
             "for family, address in ((socket.AF_INET, ('127.0.0.1', 47123)),\n"
             "                        (socket.AF_UNIX, '\\0swarm-slot-test')):\n"
             "    try:\n"
             "        socket.socket(family).connect(address); print('reached')\n"
             "    except OSError as exc:\n"
             "        print('refused', type(exc).__name__)\n")
    refused = "refused ConnectionRefusedError\nrefused ConnectionRefusedError\n"
    cancel = threading.Event()
    first = env_in(outside_tmp, "a")
    first.cancel = cancel
    slot = netns(first)
    (first.workspace / "listen.py").write_text(listen)
    running = threading.Thread(target=first.execute, args=("python3 listen.py", 60))
    running.start()
    try:
        wait_until(lambda: "127.0.0.1:47123" in _listeners(first), "the box to listen")
        for name in ("b", "c"):
            other = env_in(outside_tmp, name)
            try:
                assert netns(other) != slot
                (other.workspace / "probe.py").write_text(probe)
                assert other.execute("python3 probe.py", 30).output == refused
            finally:
                other.close()
    finally:
        cancel.set()
        running.join(30)
        first.close()
    after = env_in(outside_tmp, "d")
    try:
        assert netns(after) == slot
        (after.workspace / "probe.py").write_text(probe)
        assert after.execute("python3 probe.py", 30).output == refused
    finally:
        after.close()


def _listeners(env: LocalEnvironment) -> str:
    """The box's TCP listeners, as ``ADDR:PORT`` lines (read from the worker's side: the
    box's own /proc/net/tcp through its runner would need a command, which waits)."""
    box = env._box
    assert box is not None and box.launch is not None
    path = Path(f"/proc/{box.launch.proc.pid}/net/tcp")
    out = []
    for line in path.read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":
            host, port = local.split(":")
            octets = [str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0)]
            out.append(f"{'.'.join(octets)}:{int(port, 16)}")
    return "\n".join(out)


def test_a_slot_whose_slirp_died_is_dropped_for_a_new_one(outside_tmp: Path) -> None:
    first = env_in(outside_tmp, "a")
    slot_ns = netns(first)
    first.close()
    (slot,) = [s for free in netslots.POOL._free.values() for s in free]
    assert slot.slirp.proc is not None
    slot.slirp.proc.kill()  # started by this process's pool
    slot.slirp.proc.wait()
    second = env_in(outside_tmp, "b")
    try:
        assert netns(second) != slot_ns
        assert "tap0" in second.execute("cat /proc/net/dev", 30).output
    finally:
        second.close()
    wait_until(lambda: slot.holder.poll() is not None, "the dead slot's holder to end")


def test_idle_slots_are_closed_with_their_processes(outside_tmp: Path) -> None:
    env = env_in(outside_tmp, "a")
    netns(env)
    env.close()
    (slot,) = [s for free in netslots.POOL._free.values() for s in free]
    slirp = slot.slirp.proc
    assert slirp is not None
    assert netslots.POOL.sweep(idle=3600) == 0 and slot.alive
    assert netslots.POOL.sweep(idle=0) == 1
    assert slot.holder.poll() is not None
    wait_until(lambda: slirp.poll() is not None, "the slot's slirp4netns to end")


def test_a_box_killed_from_outside_does_not_lend_its_slot_again(outside_tmp: Path) -> None:
    """A command timed out in a box of its own is killed from outside (bubblewrap first):
    what it started dies a moment later, so its namespace is closed, never lent again."""
    env = env_in(outside_tmp, "a")
    env.lasting = False
    result = env.execute(f"{NETNS}; sleep 30", 1)
    assert result.timed_out and result.output.startswith("net:["), result.output
    killed = result.output.split()[0]
    assert not [s for free in netslots.POOL._free.values() for s in free]
    after = env_in(outside_tmp, "b")
    try:
        assert netns(after) != killed
    finally:
        after.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="a run's own mount namespace needs root")
def test_a_slot_made_by_a_run_in_its_own_mount_namespace_holds_the_workers(
        outside_tmp: Path) -> None:
    """A run's thread may work in a mount namespace of its own (its view mounted there); a
    slot it makes outlives it, so its processes start in the worker's namespace instead."""
    from swarm.workspace import views

    seen: dict[str, object] = {}

    def run() -> None:
        if not views.isolate(outside_tmp / "views", outside_tmp):
            seen["error"] = "isolate refused"
            return
        try:
            env = env_in(outside_tmp, "a")
            try:
                netns(env)
            finally:
                env.close()
            seen["thread"] = os.stat(
                f"/proc/self/task/{threading.get_native_id()}/ns/mnt").st_ino
        finally:
            views.rejoin()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert "error" not in seen, seen
    (slot,) = [s for free in netslots.POOL._free.values() for s in free]
    assert slot.slirp.proc is not None
    process = os.stat(f"/proc/{os.getpid()}/ns/mnt").st_ino
    assert seen["thread"] != process
    assert os.stat(f"/proc/{slot.holder.pid}/ns/mnt").st_ino == process
