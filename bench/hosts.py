"""Simulated machines on one Linux host, for the benchmarks and the multi-host tests.

A "host" is a process started through :func:`host_argv`:

- in its own UTS namespace (``unshare --uts``): its own host name;
- optionally in its own mount namespace (``--mount``): a private folder (its disk) bound
  over ``SWARM_HOME`` and empty tmpfs over folders it must not see (the laptop's);
- optionally in its own network namespace (:class:`Network`): joined to a bridge by a veth
  pair, with its own address; its link can go down (a partition) and come back;
- optionally with its clock ahead (libfaketime, Debian package ``faketime``: :func:`host_env`).

``bench.common.Cluster`` (the ``workers`` and ``seed`` parts), ``bench.chaos`` and
``tests/test_multihost.py`` start their hosts here. Needs root (or the capabilities) for
the namespaces; :func:`namespaces_reason` and :func:`network_reason` say why not.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def namespaces_reason() -> str:
    """Why mount and UTS namespaces cannot be made here, or ""."""
    try:
        out = subprocess.run(["unshare", "--mount", "--uts", "--propagation", "private",
                              "sh", "-c", "hostname swarm-ns-check && mount -t tmpfs tmpfs /mnt"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare is not available: {exc}"
    return "" if out.returncode == 0 else f"mount/UTS namespaces not permitted: {out.stderr}"


def uts_works() -> bool:
    """Whether ``unshare --uts`` may set a host name here."""
    try:
        done = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname bench-probe"],
                              capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def network_reason() -> str:
    """Why network namespaces with veth pairs cannot be made here, or ""."""
    name = f"swarm-check-{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip (iproute2) is not available: {exc}"
    if made.returncode != 0:
        return f"network namespaces not permitted: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return ""


def faketime_library() -> str:
    """The libfaketime shared library, or "" (``apt-get install faketime``)."""
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                    "/usr/local/lib/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return ""


def faketime_reason(offset: float = 30.0) -> str:
    """Why a Python process with threads cannot run under libfaketime here, or "": it must
    sleep and wait on a condition with a timeout, with its wall clock ``offset`` seconds
    ahead (libfaketime 0.9.10 makes ``time.sleep`` fail with EINVAL when it leaves the
    monotonic clock alone, and hangs a timed ``threading.Event.wait`` when it fakes it:
    :func:`host_env` leaves it alone and turns ``time.sleep`` into a timed wait)."""
    library = faketime_library()
    if not library:
        return "libfaketime is not installed (apt-get install faketime)"
    probe = ("import threading, time; threading.Event().wait(0.05); time.sleep(0.05); "
             "print(time.time())")
    env = host_env(HostSpec("probe", clock_ahead=offset), os.environ)
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "a timed wait hangs under libfaketime"
    if done.returncode != 0:
        return f"Python fails under libfaketime: {done.stderr.strip().splitlines()[-1:]}"
    ahead = float(done.stdout) - time.time()
    if abs(ahead - offset) > 5:
        return f"libfaketime set the clock {ahead:+.0f} s off, not {offset:+g} s"
    return ""


@dataclass
class HostSpec:
    """One simulated machine."""

    name: str
    """Its host name (``socket.gethostname()`` in it)."""
    disk: Path | None = None
    """A folder bound over ``home`` (needs a mount namespace)."""
    home: Path | None = None
    hide: tuple[Path, ...] = ()
    """Folders replaced by an empty tmpfs (needs a mount namespace)."""
    netns: str = ""
    """The network namespace it runs in ("": this one's)."""
    clock_ahead: float = 0.0
    """Seconds its clock runs ahead (libfaketime)."""

    @property
    def mounts(self) -> bool:
        return self.disk is not None or bool(self.hide)


def host_argv(spec: HostSpec, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` on the host ``spec`` (``exec``: the pid of the
    process started is the pid of ``argv``'s program)."""
    steps = [f"hostname {shlex.quote(spec.name)}"]
    if spec.disk is not None and spec.home is not None:
        steps.append(f"mount --bind {shlex.quote(str(spec.disk))} {shlex.quote(str(spec.home))}")
    steps += [f"mount -t tmpfs tmpfs {shlex.quote(str(p))}" for p in spec.hide]
    script = " && ".join([*steps, 'exec "$@"'])
    flags = ["--mount", "--uts", "--propagation", "private"] if spec.mounts else ["--uts"]
    out = ["unshare", *flags, "sh", "-c", script, "sh", *argv]
    if spec.netns:
        out = ["ip", "netns", "exec", spec.netns, *out]
    return out


def host_env(spec: HostSpec, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the host's clock offset (libfaketime preloaded), if it has one."""
    out = dict(env)
    if spec.clock_ahead:
        library = faketime_library()
        if not library:
            raise RuntimeError("libfaketime is not installed (apt-get install faketime)")
        # time.sleep becomes a timed wait (bench/faketime/sitecustomize.py: 0.9.10 fails
        # clock_nanosleep on the monotonic clock it leaves alone).
        site = str(Path(__file__).resolve().parent / "faketime")
        path = [p for p in (site, out.get("PYTHONPATH", "")) if p]
        out.update(LD_PRELOAD=library, FAKETIME=f"+{spec.clock_ahead:g}s",
                   FAKETIME_DONT_FAKE_MONOTONIC="1", PYTHONPATH=os.pathsep.join(path))
    return out


class IpFailed(subprocess.CalledProcessError):
    """An ``ip`` command that failed, with what it said."""

    def __str__(self) -> str:
        return f"{super().__str__()}: {str(self.stderr or '').strip()}"


@dataclass
class Network:
    """A bridge on this side (address ``.1`` of a /24) and one network namespace per host,
    each joined to it by a veth pair. Names carry ``tag`` (unique per process: other
    programs on the machine make their own); :meth:`close` removes everything."""

    tag: str
    subnet: str = ""
    """``10.A.B`` (the first three octets); default derived from the pid."""
    hosts: dict[str, str] = field(default_factory=dict)
    """Short name -> its namespace."""

    def __post_init__(self) -> None:
        if not self.subnet:
            pid = os.getpid()
            self.subnet = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.bridge = f"br{self.tag}"[:15]
        self._index: dict[str, int] = {}
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")

    @property
    def gateway(self) -> str:
        """This side's address: where hosts reach the services of the laptop."""
        return f"{self.subnet}.1"

    def _veth(self, short: str) -> str:
        return f"v{self._index[short]}{self.tag}"[:15]

    def add(self, short: str) -> str:
        """A namespace for host ``short``, linked and up; returns its name."""
        index = len(self._index) + 1
        self._index[short] = index
        ns, outer = f"swarm-{self.tag}-{short}", self._veth(short)
        inner = f"i{index}{self.tag}"[:15]
        self._ip("netns", "add", ns)
        self.hosts[short] = ns
        self._ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._ip("link", "set", inner, "netns", ns)
        self._ip("link", "set", outer, "master", self.bridge)
        self._ip("link", "set", outer, "up")
        self._ip("-n", ns, "addr", "add", f"{self.subnet}.{10 + index}/24", "dev", inner)
        self._ip("-n", ns, "link", "set", inner, "up")
        self._ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def cut(self, short: str) -> None:
        """Take the host's link down: its packets go nowhere (connections stall, as when a
        cable is pulled; nothing is closed)."""
        self._ip("link", "set", self._veth(short), "down")

    def heal(self, short: str) -> None:
        self._ip("link", "set", self._veth(short), "up")

    def close(self) -> None:
        for short, ns in list(self.hosts.items()):
            with contextlib.suppress(subprocess.CalledProcessError):
                self._ip("link", "del", self._veth(short))
            with contextlib.suppress(subprocess.CalledProcessError):
                self._ip("netns", "del", ns)
        self.hosts.clear()
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ip("link", "del", self.bridge)

    @staticmethod
    def _ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                              check=False)
        if done.returncode:  # what ip said, not only its exit status
            raise IpFailed(done.returncode, done.args, done.stdout, done.stderr)
