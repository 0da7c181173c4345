"""The box's network: a network namespace per box, with user-mode internet from
slirp4netns, where the worker's host and the swarm's Redis are unreachable. (A worker keeps
such namespaces set up and lends each to one box at a time:
:mod:`swarm.agent.sandbox.netslots`; a box makes its own, as below, where none can be.)

A box command starts as ``unshare --net`` (``--user --map-root-user --net`` for a worker
that is not root) running :data:`WRAPPER`: still privileged in the new namespace (root,
or root of its own user namespace), it says it is up on one pipe and waits for the word on
another. Meanwhile the worker moves it into its cgroup (:mod:`swarm.agent.cgroups`) and
starts ``slirp4netns`` on its namespace (``--disable-host-loopback``: the host's
127.0.0.1, through the gateway 10.0.2.2, refuses; ``--exit-fd``: it ends when the worker
closes its end, after the command, or dies). Then the wrapper adds ``prohibit`` routes for
every address to deny (:func:`deny_list`: the host's own addresses, the Redis hosts,
link-local addresses as a cloud's metadata service, the operator's ``SWARM_SANDBOX_DENY``),
routes and nftables rules for what ``SWARM_SANDBOX_ALLOW`` lets through, and only then
runs the box, which drops every capability: it cannot change them. The box's own
loopback is its own. (A box in a slot, or with no network of its own to set up, runs
:data:`WRAPPER` after ``setpriv``, unprivileged, or, a worker's, has bubblewrap itself
wait: :meth:`~swarm.agent.sandbox.Box.argv`.)
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from swarm.agent import later
from swarm.agent.fds import readable

T = TypeVar("T")

GATEWAY = "10.0.2.2"
DNS = "10.0.2.3"
RESOLV = f"nameserver {DNS}\n"
#: Denied whatever the host: link-local addresses (a cloud's metadata service, with the
#: machine's credentials, is 169.254.169.254).
ALWAYS_DENIED = ("169.254.0.0/16",)
#: Seconds slirp4netns has to configure the namespace.
READY_TIMEOUT = 10.0
SLIRP_FIX = ("install slirp4netns (apt-get install slirp4netns); a worker that is not root "
             "needs /dev/net/tun readable and writable by its user (chmod 0666 /dev/net/tun, "
             "its default on most distributions; in a container, add --device /dev/net/tun)")

#: The box's first process, privileged in its network namespace: ``$1`` the fd it says
#: "up" on, ``$2`` the one it reads "go" from, ``$3`` the routes for ``ip -batch`` ("" for
#: none), ``$4`` the nftables rules ("" for none), then the box's command. Without the
#: word (the worker died) it runs nothing.
WRAPPER = ('u=$1 g=$2 r=$3 f=$4; shift 4; echo up >&"$u" && eval "exec $u>&-" || exit 137; '
           'read -r go <&"$g"; eval "exec $g<&-"; [ "$go" = go ] || exit 137; '
           'if [ -n "$r" ]; then printf %s "$r" | ip -batch - || exit 126; fi; '
           'if [ -n "$f" ]; then printf %s "$f" | nft -f - || exit 126; fi; exec "$@"')


@dataclass(frozen=True)
class Network:
    """A box's network: ``mode`` ``user`` (slirp4netns, ``deny`` prohibited), ``none`` (an
    empty namespace) or ``host`` (the host's own, every port of it); ``allow``: addresses
    (``ADDR`` or ``ADDR/N``) and ports (``ADDR:PORT``) let through the deny list."""

    mode: str = "user"
    deny: tuple[str, ...] = field(default_factory=lambda: deny_list())
    allow: tuple[str, ...] = ()

    def routes(self) -> str:
        """``ip -batch`` lines: ``prohibit`` routes, and a route through the gateway for
        each allowed address inside a denied network."""
        allowed = {str(net) for net in _allow_nets(self.allow)}
        lines = [f"route add prohibit {net}" for net in _collapse(self.deny)
                 if str(net) not in allowed]
        lines += [f"route add {net} via {GATEWAY}" for net in _allow_nets(self.allow)
                  if any(net != d and net.subnet_of(d) for d in _collapse(self.deny))]
        return "".join(f"{line}\n" for line in lines)

    def rules(self) -> str:
        """nftables rules: to an address allowed by port, only those ports."""
        ports: dict[str, list[int]] = {}
        for entry in self.allow:
            if ":" in entry:
                address, port = entry.rsplit(":", 1)
                ports.setdefault(address, []).append(int(port))
        if not ports:
            return ""
        lines = ["table ip swarm_box {", "chain out {",
                 "type filter hook output priority 0; policy accept;"]
        for address, numbers in ports.items():
            listed = ", ".join(str(p) for p in sorted(set(numbers)))
            lines += [f"ip daddr {address} tcp dport {{ {listed} }} accept",
                      f"ip daddr {address} udp dport {{ {listed} }} accept",
                      f"ip daddr {address} reject"]
        return "\n".join([*lines, "}", "}", ""])


def _allow_nets(allow: Iterable[str]) -> list[ipaddress.IPv4Network]:
    return [ipaddress.IPv4Network(e.split(":")[0], strict=False) for e in allow]


def _collapse(deny: Iterable[str]) -> list[ipaddress.IPv4Network]:
    nets = (ipaddress.IPv4Network(d, strict=False) for d in deny)
    return list(ipaddress.collapse_addresses(n for n in nets if not n.is_loopback))


@functools.cache
def host_addresses() -> tuple[str, ...]:
    """The IPv4 addresses of every interface of this host (once per process; the kernel's
    local routes, ``/proc/net/fib_trie``), loopback ones left out (the box has its own)."""
    found: set[str] = set()
    last = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/fib_trie").read_text().splitlines():
            text = line.strip()
            if text.startswith(("|--", "+--")):
                last = text.split()[-1]
            elif text == "/32 host LOCAL" and last:
                found.add(last)
    return tuple(sorted(a for a in found if not ipaddress.IPv4Address(a).is_loopback))


@functools.cache
def redis_addresses(url: str) -> tuple[str, ...]:
    """The IPv4 addresses of the Redis hosts (or sentinels) of ``url`` (resolved once per
    process)."""
    if not url:
        return ()
    hosts: list[str] = []
    for chunk in filter(None, (c.strip() for c in url.split(";"))):
        with contextlib.suppress(ValueError):
            name = urlsplit(chunk).hostname
            if name:
                hosts.append(name)
    found: set[str] = set()
    for host in hosts:
        with contextlib.suppress(OSError, UnicodeError):
            for info in socket.getaddrinfo(host, None, socket.AF_INET):
                found.add(str(info[4][0]))
    return tuple(sorted(found))


def deny_list(redis_url: str = "", extra: Iterable[str] = ()) -> tuple[str, ...]:
    """What a box may not reach: this host, the Redis hosts of ``redis_url``, link-local
    addresses and ``extra`` (``SWARM_SANDBOX_DENY``)."""
    return tuple(dict.fromkeys([*host_addresses(), *redis_addresses(redis_url),
                                *ALWAYS_DENIED, *extra]))


def wrapper(up: int, go: int, net: Network | None) -> list[str]:
    """The start of a box command that waits for the worker (:data:`WRAPPER`), in a new
    network namespace when ``net`` says so (whose routes it sets, privileged there)."""
    argv = ["bash", "-c", WRAPPER, "bash", str(up), str(go),
            net.routes() if net is not None else "", net.rules() if net is not None else ""]
    if net is None:
        return argv
    own = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
    return ["unshare", *own, "--net", "--", *argv]


def enter(holder: int) -> list[str]:
    """The start of a box command in the network namespace of the slot ``holder`` holds (its
    pid: :mod:`~swarm.agent.sandbox.netslots`, whose routes are set already)."""
    ns = f"/proc/{holder}/ns"
    own = [f"--user={ns}/user"] if os.geteuid() != 0 else []
    return ["nsenter", *own, f"--net={ns}/net", "--"]


class Slirp:
    """slirp4netns serving the network namespace of process ``pid``."""

    def __init__(self, pid: int, *, lasting: bool = False, prefix: list[str] | None = None
                 ) -> None:
        """Serve ``pid``'s namespace; ``lasting``: for as long as a slot lives
        (:mod:`~swarm.agent.sandbox.netslots`), where what it says is not read (a pipe
        nobody reads would stop it once full): a failure then says only its exit code.
        ``prefix``: what it starts under (``nsenter`` into the worker's mount namespace)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.error = ""
        binary = shutil.which("slirp4netns")
        if binary is None:
            self.error = "slirp4netns is not installed"
            return
        ready_r, ready_w = os.pipe()
        self.exit_r, self.exit_w = os.pipe()
        own = [f"--userns-path=/proc/{pid}/ns/user"] if os.geteuid() != 0 else []
        try:
            self.proc = subprocess.Popen(
                [*(prefix or []), binary, "--configure", "--mtu=65520", "--disable-host-loopback",
                 "--enable-sandbox", "--enable-seccomp", f"--ready-fd={ready_w}",
                 f"--exit-fd={self.exit_r}", *own, str(pid), "tap0"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL if lasting else subprocess.PIPE,
                pass_fds=(ready_w, self.exit_r), bufsize=0)  # read only if it fails: no buffer
        except OSError as exc:
            self.error = f"slirp4netns did not start ({exc})"
            os.close(ready_r)
            os.close(self.exit_w)
            return
        finally:
            os.close(ready_w)
            os.close(self.exit_r)
        try:
            if not readable(ready_r, READY_TIMEOUT) or os.read(ready_r, 1) != b"1":
                self.error = "slirp4netns failed: " + self._said()
        finally:
            os.close(ready_r)

    def _said(self) -> str:
        """The last line slirp4netns wrote (it has exited, or is killed now)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.stderr is None:
            return f"exit code {self.proc.returncode}"
        lines = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
        useful = [line for line in lines if "WARNING" not in line]
        return (useful or lines or [f"exit code {self.proc.returncode}"])[-1]

    def stop(self) -> None:
        """End it, without waiting for it to be gone: its exit takes the kernel 15-35 ms
        (its tap device goes), reaped by a thread. (Its exit fd, closed, ends it too, a
        worker's death included, but it notices that only at its next poll.)"""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            os.close(self.exit_w)
        with contextlib.suppress(OSError):
            proc.terminate()
        if proc.stderr is not None:  # what it says from now on is not read
            proc.stderr.close()
        later.soon(lambda: _reap(proc))


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: Seconds a box has to say it is up.
UP_TIMEOUT = 30.0


def await_word(fd: int, timeout: float = UP_TIMEOUT) -> bool:
    """Whether the box said "up" on ``fd`` within ``timeout`` (False: it died first)."""
    return read_line(fd, timeout) == b"up"


def read_json(fd: int, timeout: float) -> object:
    """The JSON document a helper process writes on ``fd`` within ``timeout`` seconds
    (bubblewrap's ``--info-fd``, which its box's first process may hold open past it), or
    None when it ended or said nothing whole in time."""
    def whole(data: bytes) -> tuple[object] | None:
        try:
            return (json.loads(data),)
        except ValueError:
            return None

    said = _read_until(fd, timeout, 4096, whole)
    return said[0] if said is not None else None


def read_line(fd: int, timeout: float) -> bytes:
    """The line a helper process says on ``fd`` within ``timeout`` seconds, without its end
    (b"" when it ended, or said nothing whole in time)."""
    line = _read_until(fd, timeout, 64, lambda data: data[:-1] if data.endswith(b"\n") else None)
    return line if line is not None else b""


def _read_until(fd: int, timeout: float, size: int, whole: Callable[[bytes], T | None]
                ) -> T | None:
    """``whole(data)`` of what ``fd`` said so far, once it is not None, within ``timeout``
    seconds (reads of ``size`` bytes); None when ``fd`` ended or the time ran out first."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not readable(fd, left):
            return None
        chunk = os.read(fd, size)
        if not chunk:
            return None
        data += chunk
        done = whole(data)
        if done is not None:
            return done
