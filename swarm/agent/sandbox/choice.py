"""Which sandbox a process uses (:func:`choose`, :func:`for_worker`): ``SWARM_SANDBOX``'s
mode against what the trial found here, the box's network, limits and folders from the
settings, and how a worker that cannot box says so (:class:`Choice`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from swarm.agent import boxnet
from swarm.agent.boxnet import Network
from swarm.agent.cgroups import Limits
from swarm.agent.sandbox.box import UID, Box
from swarm.agent.sandbox.trial import probe, run_as
from swarm.config import Settings, parse_size
from swarm.errors import ConfigError

FALLBACK = "SWARM_SANDBOX_FALLBACK"
"""Set to ``1`` by a root in a terminal that runs its commands unconfined (no
``SWARM_SANDBOX`` given) in the environment of the local workers it starts on its own
embedded server: where the box cannot be had, they run the children of such roots
unconfined too, rather than refuse them (:attr:`Choice.fallback`). Never set on a
deployment's workers, and out of reach of the commands they run."""
UNBOXED = "none for unconfined roots' children, others refused: "
"""How :attr:`Choice.summary` begins on a worker that falls back (:func:`unboxed`)."""


def network_mode(value: bool | str) -> str:
    """``SWARM_SANDBOX_NETWORK``'s box network: ``user`` (1, the default), ``none`` (0)
    or ``host``."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "user"):
        return "user"
    if text in ("0", "false", "no", "off", "none"):
        return "none"
    if text == "host":
        return "host"
    raise ConfigError(f"SWARM_SANDBOX_NETWORK={value!r} is not one of 1, 0, host")


@dataclass(frozen=True)
class Choice:
    """Where a process runs its commands: in ``box``, or unconfined."""

    box: Box | None
    refuse: str = ""
    """Set on a worker that cannot sandbox: why, and how to fix it (it runs no children)."""
    notice: str = ""
    """A line to tell the person or the log when commands run unconfined."""
    lacks: tuple[str, ...] = ()
    """What the box goes without here (its network, its cgroup limits): why, and the fix."""
    fallback: str = ""
    """Set with ``refuse`` on a terminal root's local worker (:data:`FALLBACK`): why there is
    no box. The children of a swarm whose root runs its commands unconfined run unconfined
    too; the others (jobs, roots that asked for a sandbox) are refused."""

    @property
    def summary(self) -> str:
        """One line for ``swarm status`` and Flower's worker info."""
        if self.fallback:
            return f"{UNBOXED}{self.fallback}"
        if self.refuse:
            return f"unavailable, children refused: {self.refuse}"
        if self.box is None:
            return "none (commands run unconfined)"
        host = self.box.run_as
        net = {"user": "network: user-mode, host and Redis unreachable",
               "none": "no network", "host": "network: the host's (its ports exposed)"}
        limits = self.box.limits
        parts = [f"uid {UID}{'' if host in (None, UID) else f', host uid {host}'}",
                 "no capabilities", "seccomp", net[self.box.net.mode]]
        if limits is not None:
            memory = f"{limits.memory >> 20} MiB" if limits.memory else "no memory limit"
            parts.append(f"cgroup: {memory}, {limits.pids} pids, cpu weight {limits.cpu}")
        return f"bwrap ({', '.join(parts)}){''.join(f'; {n}' for n in self.lacks)}"


def choose(mode: str, *, worker: bool = False, network: bool | str | Network = True,
           hide: Iterable[Path] = (), read_only: Iterable[Path] = (), uid: int = UID,
           trial_in: Path | None = None, limits: Limits | None = None,
           show: Iterable[str] = (), fallback: bool = False) -> Choice:
    """The sandbox for ``SWARM_SANDBOX`` ``mode`` (run as host ``uid`` when root; tried in
    ``trial_in`` when given: :func:`probe`; ``network``: a :class:`Network`, or
    ``SWARM_SANDBOX_NETWORK``'s value, then denying this host; ``limits``: its cgroup's).
    ``auto`` uses bubblewrap when the trial works; when it does not, a worker refuses
    children (but, with ``fallback``, an unconfined root's: :attr:`Choice.fallback`) and a
    root runs unconfined with a notice. ``bwrap`` that does not work raises
    :class:`ConfigError` (refuses, on a worker)."""
    unconfined = (f"commands run unconfined as uid {os.getuid()} (SWARM_SANDBOX=none); "
                  "SWARM_SANDBOX=auto runs them in bubblewrap")
    if mode == "none":
        return Choice(None, notice=unconfined)
    net = network if isinstance(network, Network) else Network(network_mode(network))
    if net.mode != "user":
        net = Network(net.mode, ())
    shown = tuple(show)
    found = probe(net, uid, trial_in, limits, shown)
    if found.ok:
        binary = shutil.which("bwrap")
        assert binary is not None
        lacks = tuple(n for n in (found.net_note, found.limits_note) if n)
        return Choice(Box(binary, found.net or net, tuple(str(p) for p in hide),
                          os.environ.get("HOME", ""), tuple(str(p) for p in read_only),
                          run_as(uid), None if found.limits_note else limits, shown),
                      lacks=lacks)
    if worker:
        return Choice(None, refuse=f"{found.reason}; or set SWARM_SANDBOX=none on this "
                                   "worker to run commands unconfined",
                      fallback=found.reason if fallback else "")
    if mode == "bwrap":
        raise ConfigError(f"SWARM_SANDBOX=bwrap but {found.reason}; or set "
                          "SWARM_SANDBOX=auto or none")
    return Choice(None, notice=f"commands run unconfined: {found.reason}")


def network_of(settings: Settings) -> Network:
    """The box network ``settings`` ask for: ``user`` denies this host, the Redis hosts
    of ``SWARM_REDIS_URL``, link-local addresses and ``SWARM_SANDBOX_DENY``."""
    mode = network_mode(settings.sandbox_network)
    if mode != "user":
        return Network(mode, ())
    return Network(mode, boxnet.deny_list(settings.redis_url, _listed(settings.sandbox_deny)),
                   _listed(settings.sandbox_allow))


def limits_of(settings: Settings) -> Limits:
    """The cgroup limits of each box (``SWARM_SANDBOX_MEMORY``, ``_PIDS``, ``_CPU``)."""
    return Limits(parse_size(settings.sandbox_memory), settings.sandbox_pids,
                  settings.sandbox_cpu)


def shown_of(settings: Settings) -> tuple[str, ...]:
    """``SWARM_SANDBOX_SHOW``'s folders."""
    return _listed(settings.sandbox_show)


def _listed(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def for_worker(settings: Settings) -> Choice:
    """A worker's sandbox: its own ``SWARM_SANDBOX`` (never a swarm's), ``auto`` when unset;
    then, on a terminal root's local worker (:data:`FALLBACK`), unconfined roots' children
    run unconfined where the box cannot be had."""
    explicit = "sandbox" in settings.explicit
    return choose(settings.sandbox if explicit else "auto", worker=True,
                  network=network_of(settings), hide=(settings.home,),
                  uid=settings.sandbox_uid, trial_in=settings.home,
                  limits=limits_of(settings), show=shown_of(settings),
                  fallback=not explicit and os.environ.get(FALLBACK) == "1")


def unboxed(summaries: Iterable[str]) -> str:
    """Why there is no box, from the :attr:`Choice.summary` of workers: "" unless one of
    them runs unconfined roots' children unconfined (:attr:`Choice.fallback`)."""
    return next((s.removeprefix(UNBOXED) for s in summaries if s.startswith(UNBOXED)), "")
