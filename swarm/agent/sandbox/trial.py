"""The trial of the box on this host: a real command run in it once per process, checked
to be confined (uid, capabilities, seccomp, what it may read and write, its network), with
why not and how to fix it when it is not (:func:`probe`)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from swarm.agent import boxnet
from swarm.agent.boxnet import Network
from swarm.agent.cgroups import Limits
from swarm.agent.sandbox.box import NO_NETWORK, UID, Box
from swarm.agent.sandbox.envvars import environment
from swarm.agent.sandbox.launch import Launch
from swarm.agent.sandbox.seccomp import program_fd

_TRIAL = ('id -u; grep -E "^(CapEff|NoNewPrivs|Seccomp):" /proc/self/status; '
          'touch /.swarm-sandbox-trial 2>/dev/null && echo root-writable; '
          'cat .trial-secret 2>/dev/null && echo secret-readable; '
          'touch trial && echo workspace-writable')
_FIX = ("install bubblewrap and slirp4netns (apt-get install bubblewrap slirp4netns); in a "
        "container, allow user namespaces (docs/deploy.md, 'The sandbox')")
_USERNS_FIX = ("a root worker runs the box as SWARM_SANDBOX_UID, which needs unprivileged user "
               "namespaces: sysctl user.max_user_namespaces above 0, "
               "kernel.unprivileged_userns_clone=1 where it exists, "
               "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04")
_ACL_FIX = ("put SWARM_HOME (and the workspace) on a filesystem with POSIX ACLs (ext4, xfs, "
            "btrfs, tmpfs), or run the worker as a user of its own")


@dataclass(frozen=True)
class Probe:
    """What a trial command in the box showed: ``ok``, else why not and how to fix it;
    the network its boxes get (``user`` falls back to ``none`` where slirp4netns fails,
    ``net_note`` says why) and, where its cgroup limits cannot be had, why."""

    ok: bool
    reason: str = ""
    net: Network | None = None
    net_note: str = ""
    limits_note: str = ""


def run_as(uid: int = UID) -> int | None:
    """The host uid boxes run as here: ``uid`` for a root runner, else None (its own)."""
    return uid if os.geteuid() == 0 else None


_NET_TRIAL = ('while read -r i d _; do [ "$i $d" = "tap0 00000000" ] && echo net-up; '
              'done < /proc/net/route\n')


@functools.cache
def probe(net: Network | None = None, uid: int = UID, base: Path | None = None,
          limits: Limits | None = None, show: tuple[str, ...] = ()) -> Probe:
    """Run a trial command in the box (as host ``uid`` when root; with network ``net``,
    default ``user``, and cgroup ``limits``) and check it is confined (once per process).
    The trial's workspace is made in ``base`` (a worker's ``SWARM_HOME``, where its
    children's are) when that exists, else in the temp folder."""
    net = net if net is not None else Network()
    binary = shutil.which("bwrap")
    if binary is None:
        return Probe(False, f"bubblewrap is not installed: {_FIX}")
    try:
        fd = program_fd()
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        return Probe(False, f"no seccomp filter ({type(exc).__name__}: {exc}): install "
                            "libseccomp2 (apt-get install libseccomp2) and pyseccomp")
    box = Box(binary, net, run_as=run_as(uid), limits=limits, show=show)
    fix = _FIX if box.run_as is None else f"{_FIX}; {_USERNS_FIX}"
    if box.run_as is not None and shutil.which("setpriv") is None:
        os.close(fd)
        return Probe(False, "setpriv is not installed (a root worker starts the box as "
                            "SWARM_SANDBOX_UID with it): apt-get install util-linux")
    if net.mode == "user" and net.rules() and shutil.which("nft") is None:
        os.close(fd)
        return Probe(False, "SWARM_SANDBOX_ALLOW names ports, which the box's network "
                            "namespace filters with nftables: apt-get install nftables, or "
                            "allow whole addresses")
    where = str(base) if base is not None and base.is_dir() else None
    launch: Launch | None = None
    with tempfile.TemporaryDirectory(prefix="swarm-sandbox-trial-", dir=where) as trial:
        try:
            box.prepare(Path(trial))
            if box.run_as is not None:  # a file only root may read (a key): the box must not
                secret = os.open(Path(trial) / ".trial-secret", os.O_CREAT | os.O_WRONLY, 0o600)
                os.write(secret, b"secret\n")
                os.close(secret)
        except OSError as exc:
            os.close(fd)
            return Probe(False, f"cannot give uid {box.run_as} a workspace ({exc}): {_ACL_FIX}")
        try:
            trial_command = (_NET_TRIAL if net.mode == "user" else "") + _TRIAL
            launch = Launch(box, lambda hs: box.argv(trial_command, Path(trial), fd,
                                                     handshake=hs),
                            pass_fds=(fd,), cwd=trial, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env=environment(os.environ))
            stdout, stderr = launch.proc.communicate(timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            if launch is not None:
                launch.proc.kill()
                launch.proc.wait()
            return Probe(False, f"bubblewrap did not run ({exc}): {fix}")
        finally:
            os.close(fd)
            notes = launch.finish() if launch is not None else ""
        out = stdout.split()
        owner = (Path(trial) / "trial").stat().st_uid if (Path(trial) / "trial").exists() \
            else None
    if launch.proc.returncode != 0:
        said = (stderr.strip().splitlines() or notes.splitlines()
                or [f"exit code {launch.proc.returncode}"])[-1]
        return Probe(False, f"bubblewrap failed here ({said}): {fix}")
    net_up = "net-up" in out
    out = [w for w in out if w != "net-up"]
    expected = [str(UID), "CapEff:", "0000000000000000", "NoNewPrivs:", "1", "Seccomp:", "2"]
    want = box.run_as or os.geteuid()
    failed = [what for what, bad in (
        ("it was not uid, capabilities, no_new_privs and seccomp as set", out[:7] != expected),
        ("it could write /", "root-writable" in out),
        ("it could read a file only root may read", "secret-readable" in out),
        ("it could not write its workspace", out[-1:] != ["workspace-writable"]),
        (f"its file's owner was uid {owner}, not {want}", owner != want)) if bad]
    if failed:
        return Probe(False, f"a trial command was not confined as expected: "
                            f"{'; '.join(failed)} (it said: {' '.join(out)})")
    net_note = ""
    if net.mode == "user" and not net_up:
        found = [line for line in notes.splitlines() if line.startswith("[no network")]
        net_note = found[0].strip("[]") if found else \
            f"no network: slirp4netns gave the box no route; {boxnet.SLIRP_FIX}"
        net = NO_NETWORK
    limits_note = next((line.strip("[]") for line in notes.splitlines()
                        if line.startswith("[no cgroup")), "")
    return Probe(True, net=net, net_note=net_note, limits_note=limits_note)

