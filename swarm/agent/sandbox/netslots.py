"""Network namespaces kept for boxes: each set up once (its namespace, its deny routes and
rules, its slirp4netns) and lent to one box at a time, instead of made and torn down for
every box (about a quarter of a box's CPU, with the kernel's share of its teardown).

A slot is a namespace held by a small shell (:data:`HOLD`, started as a box's network was:
``unshare --net``, or ``--user --map-root-user --net`` for a worker that is not root),
which applies the routes and rules once slirp4netns serves the namespace and then waits for
the end of its stdin (the worker closing it, or dying). A box enters it with ``nsenter``
(:func:`~swarm.agent.boxnet.enter`) and waits for its worker as before
(:class:`~swarm.agent.sandbox.Launch`), unprivileged, after ``setpriv``
(:meth:`~swarm.agent.sandbox.Box.argv`).

A slot goes back to its pool only once the box that had it ended on its own: every process
that was in the namespace but the holder was the box's, in the box's own pid namespace,
gone before bubblewrap exits, so nothing a box started is left in it for the next (a
socket dies with its process; the box has no capability over the namespace: it cannot
change its routes, rules or addresses). A box killed from outside closes its slot. Two
boxes never hold one slot at once. Slots idle for :data:`IDLE` seconds are closed; a slot
whose holder or slirp4netns died is dropped; where none can be made, boxes make their own
network for :data:`IDLE` seconds before a slot is tried again. What does carry over:
connections the kernel still keeps closing (``TIME_WAIT``, seen in ``/proc/net/tcp``), the
interface's counters, and slirp4netns's memory of recent flows.

A slot's processes start in the worker's own mount namespace, even when a run's thread
that makes it works in one of its own (:func:`_worker_mounts`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

from swarm.agent import boxnet
from swarm.agent.boxnet import Network

log = logging.getLogger(__name__)

#: Seconds a slot may stay unused before it is closed.
IDLE = 60.0

#: The holder: says "up" in its namespace, waits for "go" (slirp4netns serves the
#: namespace then), applies ``$1`` (``ip -batch`` routes) and ``$2`` (nftables rules), says
#: "ready" and waits for its stdin's end.
HOLD = ('r=$1 f=$2; echo up || exit 137; read -r go; [ "$go" = go ] || exit 137; '
        'if [ -n "$r" ]; then printf %s "$r" | ip -batch - >&2 || exit 126; fi; '
        'if [ -n "$f" ]; then printf %s "$f" | nft -f - >&2 || exit 126; fi; '
        'echo ready; read -r _; exit 0')


class Unavailable(Exception):
    """A slot could not be made (the message says why): the box makes its own network."""


@dataclass(eq=False)
class Slot:
    """A network namespace for one box at a time (:data:`HOLD`'s process holds it)."""

    net: Network
    holder: subprocess.Popen[bytes]
    slirp: boxnet.Slirp
    idle_since: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return self.holder.poll() is None and self.slirp.proc is not None \
            and self.slirp.proc.poll() is None

    def close(self) -> None:
        self.slirp.stop()
        _end(self.holder)


def _end(holder: subprocess.Popen[bytes]) -> None:
    for pipe in (holder.stdin, holder.stdout, holder.stderr):
        with contextlib.suppress(OSError):
            if pipe is not None:
                pipe.close()
    with contextlib.suppress(OSError):
        holder.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        holder.wait(timeout=5)


def own_mounts(unknown: bool = False) -> bool:
    """Whether the calling thread works in a mount namespace other than its process's (a
    run's, :func:`swarm.workspace.views.isolate`); ``unknown`` where /proc cannot tell."""
    try:
        mine = os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/mnt").st_ino
        process = os.stat(f"/proc/{os.getpid()}/ns/mnt").st_ino
    except OSError:
        return unknown
    return mine != process


def _worker_mounts() -> list[str]:
    """How a slot's processes start in the worker's own mount namespace when the calling
    thread works in one of its own (:func:`own_mounts`): a slot outlives the run, and
    would keep that namespace, and the run's view, alive."""
    return ["nsenter", f"--mount=/proc/{os.getpid()}/ns/mnt", "--"] if own_mounts() else []


def make(net: Network) -> Slot:
    """A new slot for boxes with the network ``net``; :class:`Unavailable` when it fails."""
    missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise Unavailable(f"{' and '.join(missing)} not found (util-linux)")
    own = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
    mounts = _worker_mounts()
    try:
        holder = subprocess.Popen(
            [*mounts, "unshare", *own, "--net", "--", "/bin/sh", "-c", HOLD, "sh",
             net.routes(), net.rules()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, bufsize=0, cwd="/")
    except OSError as exc:
        raise Unavailable(f"unshare did not start ({exc})") from exc
    assert holder.stdin is not None and holder.stdout is not None
    slirp: boxnet.Slirp | None = None
    try:
        if _line(holder) != b"up":
            raise Unavailable(f"its namespace was not made: {_said(holder)}")
        slirp = boxnet.Slirp(holder.pid, lasting=True, prefix=mounts)
        if slirp.error:
            raise Unavailable(slirp.error)
        holder.stdin.write(b"go\n")
        if _line(holder) != b"ready":
            raise Unavailable(f"its routes were not set: {_said(holder)}")
    except (Unavailable, OSError) as exc:
        if slirp is not None:
            slirp.stop()
        _end(holder)
        raise Unavailable(str(exc)) from exc
    return Slot(net, holder, slirp)


def _line(holder: subprocess.Popen[bytes]) -> bytes:
    """The holder's next line (b"" when it ended or said nothing in time)."""
    assert holder.stdout is not None
    return boxnet.read_line(holder.stdout.fileno(), boxnet.READY_TIMEOUT)


def _said(holder: subprocess.Popen[bytes]) -> str:
    with contextlib.suppress(OSError):
        holder.kill()
    holder.wait()
    assert holder.stderr is not None
    text = holder.stderr.read().decode(errors="replace").strip()
    return text.splitlines()[-1] if text else f"exit code {holder.returncode}"


class Pool:
    """This process's slots, free ones by network."""

    def __init__(self) -> None:
        self._free: dict[Network, list[Slot]] = {}
        self._lock = threading.Lock()
        self._failed: dict[Network, float] = {}
        """When making a slot for a network last failed: none is tried for :data:`IDLE`
        seconds after (each box makes its own network meanwhile)."""

    def take(self, net: Network) -> Slot:
        """A free slot for ``net`` (a new one when none is); :class:`Unavailable`."""
        failed = self._failed.get(net)
        if failed is not None and time.monotonic() - failed < IDLE:
            raise Unavailable("making one failed a moment ago")
        dead: list[Slot] = []
        with self._lock:
            free = self._free.get(net, [])
            while free:
                slot = free.pop()
                if slot.alive:
                    break
                dead.append(slot)
            else:
                slot = None
        for gone in dead:
            gone.close()
        if slot is not None:
            return slot
        try:
            return make(net)
        except Unavailable as exc:
            self._failed[net] = time.monotonic()
            log.warning("boxes make their own network namespaces for a while: no network "
                        "slot could be made (%s)", exc)
            raise

    def give(self, slot: Slot) -> None:
        """``slot`` back, once the box that had it is gone (closed when it died)."""
        if not slot.alive:
            slot.close()
            return
        slot.idle_since = time.monotonic()
        with self._lock:
            self._free.setdefault(slot.net, []).append(slot)

    def sweep(self, idle: float = IDLE) -> int:
        """Close the slots unused for ``idle`` seconds, or dead; how many."""
        now = time.monotonic()
        with self._lock:
            old = [s for free in self._free.values() for s in free
                   if now - s.idle_since >= idle or not s.alive]
            for net, free in self._free.items():
                self._free[net] = [s for s in free if s not in old]
        for slot in old:
            slot.close()
        return len(old)

    def forget(self) -> None:
        """In a forked child: drop the parent's slots (closing this copy of their pipes, so
        they end with the parent)."""
        self._lock = threading.Lock()
        for free in self._free.values():
            for slot in free:
                for pipe in (slot.holder.stdin, slot.holder.stdout, slot.holder.stderr):
                    with contextlib.suppress(OSError):
                        if pipe is not None:
                            pipe.close()
                with contextlib.suppress(OSError):
                    os.close(slot.slirp.exit_w)
        self._free = {}


POOL = Pool()


def _sweeper() -> None:
    while True:
        time.sleep(IDLE / 2)
        with contextlib.suppress(Exception):
            POOL.sweep()


# Started with the module, by the thread importing the sandbox (a worker's main thread): a
# thread a run's thread started would share its filesystem context (see swarm.agent.later).
threading.Thread(target=_sweeper, daemon=True, name="swarm-netslots").start()
os.register_at_fork(after_in_child=POOL.forget)
