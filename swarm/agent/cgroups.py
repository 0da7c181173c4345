"""Limits of sandboxed commands: a cgroup per box, under a subtree per worker process.

The subtree is made under this process's own cgroup of each controller (cgroup v2 where
the host has it: ``/sys/fs/cgroup/cgroup.controllers``; else the v1 hierarchies of
``memory``, ``pids`` and ``cpu``), so a worker in a container or a systemd service with a
delegated cgroup keeps its boxes inside what it was given. Each box gets its own group
with :class:`Limits` (memory, processes, CPU weight); the whole subtree weighs, for the
CPU, as much as one group beside the worker, so the boxes together cannot starve it.

The box's first process (still root, or the worker's user, before it drops to the box's
uid) is moved into its group by the worker before it is let go; the group is removed once
the command has ended, after killing whatever the command left in it, and its counters
tell whether the kernel stopped the command for a limit (:meth:`Group.verdict`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.agent import later

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
#: cpu.weight of the worker's subtree (v2; cpu.shares 1024 on v1): as much as any other
#: group beside it.
SUBTREE_WEIGHT = 100



@dataclass(frozen=True)
class Limits:
    """What one box may use: ``memory`` bytes (0: no limit), ``pids`` processes and
    threads, ``cpu`` weight (1-10000, 100 the default of any group)."""

    memory: int = 2 << 30
    pids: int = 1024
    cpu: int = 100


class Unavailable(Exception):
    """No cgroup can be made here: why, and how to fix it."""


_FIX = ("run the worker as root, or give its user a delegated cgroup (cgroup v2: systemd "
        "Delegate=yes, or `docker run --cgroupns=private`) it may write")


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and ``""`` for the v2 hierarchy."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            out[name] = path
    return out


def _write(path: Path, value: str) -> None:
    with open(path, "w") as out:
        out.write(value)


#: Names of boxes' groups, one count for the process: two trees (of other limits) share
#: its folders, and a group lent again outlives its box.
_NAMES = itertools.count(1)


class Tree:
    """The worker's subtree: one folder per controller (v1), or one folder (v2)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.v2 = (ROOT / "cgroup.controllers").is_file()
        own = _own_paths()
        tag = f"swarm-{os.getpid()}-{_start_time()}"
        if self.v2:
            parent = ROOT / own.get("", "/").lstrip("/")
            self.bases = {"": self._v2_base(parent, tag)}
        else:
            self.bases = {}
            for name in CONTROLLERS:
                mount = ROOT / name
                if not (mount / "cgroup.procs").is_file():
                    self.remove()
                    raise Unavailable(f"no cgroup v1 '{name}' hierarchy at {mount} (and no "
                                      "cgroup v2 at /sys/fs/cgroup): mount the cgroup "
                                      "controllers memory, pids and cpu")
                base = mount / own.get(name, "/").lstrip("/") / tag
                try:
                    base.mkdir(exist_ok=True)
                except OSError as exc:
                    self.remove()
                    raise Unavailable(f"cannot make a cgroup in {base.parent} ({exc}): "
                                      f"{_FIX}") from exc
                self.bases[name] = base
            with contextlib.suppress(OSError):
                _write(self.bases["cpu"] / "cpu.shares", str(SUBTREE_WEIGHT * 1024 // 100))
        self._lock = threading.Lock()
        self._free: list[Group] = []
        """Groups whose box is gone, empty, to be lent again (:meth:`Group.release`):
        making and removing one was ~3 ms of a box's CPU, and the kernel's work after."""
        for base in self.bases.values():
            sweep(base.parent)

    def _ensure(self) -> None:
        """Make the subtree again if a sweep of another process removed it while empty
        (one in another pid namespace, where this process's pid is not alive)."""
        for name, base in self.bases.items():
            if not base.is_dir():
                base.mkdir(exist_ok=True)
                with contextlib.suppress(OSError):
                    if self.v2:
                        _write(base / "cgroup.subtree_control", "+memory +pids +cpu")
                    elif name == "cpu":
                        _write(base / "cpu.shares", str(SUBTREE_WEIGHT * 1024 // 100))

    def _v2_base(self, parent: Path, tag: str) -> Path:
        wanted = set(CONTROLLERS)
        try:
            have = set((parent / "cgroup.controllers").read_text().split())
        except OSError as exc:
            raise Unavailable(f"cannot read {parent}/cgroup.controllers ({exc}): "
                              f"{_FIX}") from exc
        if not wanted <= have:
            raise Unavailable(f"the cgroup {parent} lacks the controllers "
                              f"{' '.join(sorted(wanted - have))}: {_FIX}")
        base = parent / tag
        try:
            base.mkdir(exist_ok=True)
            self._enable(parent)
            _write(base / "cgroup.subtree_control", "+memory +pids +cpu")
            with contextlib.suppress(OSError):
                _write(base / "cpu.weight", str(SUBTREE_WEIGHT))
        except OSError as exc:
            with contextlib.suppress(OSError):
                base.rmdir()
            raise Unavailable(f"cannot make a cgroup with memory, pids and cpu under {parent} "
                              f"({exc}): {_FIX}") from exc
        return base

    @staticmethod
    def _enable(parent: Path) -> None:
        """Let ``parent``'s children have the controllers. A group holding processes may not
        (v2's rule): this process then moves to a leaf of its own beside the subtree."""
        try:
            _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        leaf = parent / f"swarm-worker-{os.getpid()}"
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", "0")
        _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")

    def group(self) -> Group:
        """A box's group, with the limits set: an empty one a box left, or a new one
        (OSError when it cannot be made). Its :meth:`Group.counts` go on from its last box."""
        while True:
            with self._lock:
                reused = self._free.pop() if self._free else None
            if reused is None:
                break
            if all(p.is_dir() for p in reused.paths.values()) and not reused._pids():
                try:  # its limits as set, whatever became of them
                    reused.configure()
                except OSError:
                    reused.remove_soon()
                    continue
                return reused
            reused.remove_soon()
        with self._lock:
            name = f"box-{next(_NAMES)}"
            self._ensure()
        paths = {c: base / name for c, base in self.bases.items()}
        made: list[Path] = []
        try:
            for path in paths.values():
                path.mkdir()
                made.append(path)
            group = Group(self, paths)
            group.configure()
        except OSError:
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        return group

    def remove(self) -> None:
        """Remove the subtree (its groups must be gone)."""
        for base in getattr(self, "bases", {}).values():
            for child in base.glob("box-*"):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                base.rmdir()


def sweep(parent: Path) -> None:
    """Remove the empty subtrees under ``parent`` of worker processes that are gone (killed
    before they could remove their own)."""
    for base in parent.glob("swarm-*-*"):
        _, pid, start = [*base.name.split("-"), "", ""][:3]
        if base.name.startswith("swarm-worker-") or not pid.isdigit():
            continue
        try:
            alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == start
        except (OSError, IndexError):
            alive = False
        if alive:
            continue
        for child in base.glob("box-*"):
            with contextlib.suppress(OSError):
                child.rmdir()
        with contextlib.suppress(OSError):
            base.rmdir()


def _start_time() -> str:
    return Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]


class Group:
    """One box's cgroup (a folder per controller on v1)."""

    def __init__(self, tree: Tree, paths: dict[str, Path]) -> None:
        self.tree = tree
        self.paths = paths

    def _file(self, controller: str, name: str) -> Path:
        return self.paths.get(controller, self.paths.get("", Path("/nonexistent"))) / name

    def configure(self) -> None:
        limits = self.tree.limits
        if self.tree.v2:
            if limits.memory:
                _write(self._file("", "memory.max"), str(limits.memory))
                with contextlib.suppress(OSError):
                    _write(self._file("", "memory.swap.max"), "0")
            _write(self._file("", "pids.max"), str(limits.pids))
            _write(self._file("", "cpu.weight"), str(limits.cpu))
            return
        if limits.memory:
            _write(self._file("memory", "memory.limit_in_bytes"), str(limits.memory))
            with contextlib.suppress(OSError):
                _write(self._file("memory", "memory.memsw.limit_in_bytes"), str(limits.memory))
        _write(self._file("pids", "pids.max"), str(limits.pids))
        _write(self._file("cpu", "cpu.shares"), str(max(2, limits.cpu * 1024 // 100)))

    def join(self, pid: int) -> None:
        """Move process ``pid`` (the box's first, before it runs anything) in."""
        for path in self.paths.values():
            _write(path / "cgroup.procs", str(pid))

    def _count(self, controller: str, name: str, key: str) -> int:
        try:
            for line in self._file(controller, name).read_text().splitlines():
                word, _, value = line.partition(" ")
                if word == key:
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def counts(self) -> tuple[int, int]:
        """The processes the kernel killed for the memory limit, and the times a fork
        failed for the pids limit, so far."""
        oom = self._count("", "memory.events", "oom_kill") if self.tree.v2 else \
            self._count("memory", "memory.oom_control", "oom_kill")
        return oom, self._count("pids" if not self.tree.v2 else "", "pids.events", "max")

    def verdict(self, since: tuple[int, int] = (0, 0)) -> str:
        """A line naming the limit the kernel enforced on this box (since ``since``, its
        :meth:`counts` before a command of a lasting box), or ""."""
        limits = self.tree.limits
        oom, forks = (now - then for now, then in zip(self.counts(), since, strict=True))
        if oom:
            return (f"[killed: the command reached the sandbox's memory limit of "
                    f"{limits.memory >> 20} MiB (SWARM_SANDBOX_MEMORY); the kernel killed "
                    f"{oom} process{'es' if oom > 1 else ''} of it]")
        if forks:
            return (f"[the command reached the sandbox's limit of {limits.pids} processes and "
                    "threads (SWARM_SANDBOX_PIDS): some of its forks failed]")
        return ""

    def _pids(self) -> list[int]:
        out: set[int] = set()
        for path in self.paths.values():
            with contextlib.suppress(OSError, ValueError):
                out.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        return sorted(out)

    def release(self) -> None:
        """Its box is gone: lent again to another box once nothing is left in it (what the
        box's first process took along may take a few ms to exit: waited for by a thread),
        removed when something stays."""
        if not self._lend():
            later.soon(self._lend_or_remove)

    def _lend(self) -> bool:
        if self._pids() or not all(p.is_dir() for p in self.paths.values()):
            return False
        with self.tree._lock:
            self.tree._free.append(self)
        return True

    def _lend_or_remove(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._lend():
            if time.monotonic() >= deadline:
                self.remove()
                return
            time.sleep(0.005)

    def remove_soon(self) -> None:
        """:meth:`remove`, by a thread when what the command left takes its time to exit
        (the box's last processes, killed with its first: 10-15 ms a command waited)."""
        if not self.remove(timeout=0):
            later.soon(self.remove)

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill what is left in the group and remove it; False when it could not be."""
        deadline = time.monotonic() + timeout
        while True:
            if self.tree.v2:
                with contextlib.suppress(OSError):
                    _write(self._file("", "cgroup.kill"), "1")
            for pid in self._pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for path in list(self.paths.values()):
                try:
                    path.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
            if not any(p.exists() for p in self.paths.values()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
