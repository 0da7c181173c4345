"""``python -m bench.boxes``: what the sandbox costs a command, a box per command against a
box per child (:mod:`swarm.agent.sandbox.lasting`), beside unconfined commands.

Each "child" is a fresh :class:`~swarm.agent.shell.LocalEnvironment` set up as a worker's
(``bwrap``, the worker's network and cgroup limits, dying with its runner) running
``--commands`` commands, then closed; ``--children`` of them one after the other. Prints,
per way: the median and p90 wall of a command (a box per child's first command starts its
box), and the CPU per command: this process's and every process it reaped (the boxes,
slirp4netns, the commands), over all the commands, box start and end included.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from swarm.agent import sandbox
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings

ACCT = Path("/sys/fs/cgroup/cpuacct")


class Meter:
    """CPU seconds of this process and all it starts: a cgroup v1 ``cpuacct`` group of its
    own where it may make one (root), which counts the boxes' processes however they end;
    else this process's and its reaped children's (a box's processes are then left out:
    its init does not wait for them)."""

    def __init__(self) -> None:
        self.group: Path | None = ACCT / f"bench-boxes-{os.getpid()}"
        try:
            self.group.mkdir()
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.group = None

    @property
    def how(self) -> str:
        return "cgroup cpuacct" if self.group else "rusage (box processes NOT counted)"

    def seconds(self) -> float:
        if self.group is not None:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    def close(self) -> None:
        if self.group is not None:
            (ACCT / "cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()


def measure(way: str, children: int, commands: int, command: str, base: Path,
            cpu: Meter) -> dict[str, float]:
    settings = Settings.from_env()
    walls: list[float] = []
    time.sleep(0.5)  # what earlier boxes left (slirp4netns, reaped by a thread) is reaped
    start_cpu, start = cpu.seconds(), time.monotonic()
    for i in range(children):
        ws = base / f"{way}-{i}"
        ws.mkdir()
        env = LocalEnvironment(
            ws, sandbox="none" if way == "unconfined" else "bwrap",
            network=sandbox.network_of(settings), limits=sandbox.limits_of(settings),
            hide=(settings.home,), die_with_runner=True, lasting=way == "box per child")
        for _ in range(commands):
            t = time.monotonic()
            result = env.execute(command, 30)
            walls.append(time.monotonic() - t)
            assert result.exit_code == 0, result.output
        env.close()
    wall = time.monotonic() - start
    time.sleep(0.5)
    spent = cpu.seconds() - start_cpu
    walls.sort()
    return {"median_ms": statistics.median(walls) * 1000,
            "p90_ms": walls[int(len(walls) * 0.9)] * 1000,
            "cpu_ms": spent / len(walls) * 1000, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.boxes", description=__doc__)
    p.add_argument("--children", type=int, default=20)
    p.add_argument("--commands", type=int, default=3, help="commands per child")
    p.add_argument("--command", default="echo hi; ls > /dev/null")
    args = p.parse_args()
    found = sandbox.probe()
    if not found.ok:
        raise SystemExit(f"no sandbox here: {found.reason}")
    ways = ["unconfined", "box per command", "box per child"]
    cpu = Meter()
    print(f"{args.children} children x {args.commands} commands ({args.command!r}), "
          f"uid {os.geteuid()}, CPU by {cpu.how}")
    print(f"{'way':<16} {'median ms':>10} {'p90 ms':>8} {'CPU ms/command':>15} {'wall s':>7}")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-boxes-", dir="/var/tmp") as tmp:
            os.chmod(tmp, 0o755)
            for way in ways:
                got = measure(way, args.children, args.commands, args.command, Path(tmp), cpu)
                print(f"{way:<16} {got['median_ms']:>10.1f} {got['p90_ms']:>8.1f} "
                      f"{got['cpu_ms']:>15.1f} {got['wall_s']:>7.2f}")
    finally:
        cpu.close()


if __name__ == "__main__":
    main()
