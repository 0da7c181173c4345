"""``python -m bench.capture``: what a child's capture costs as it settles
(:meth:`swarm.workspace.seed.Seeds.capture`: its workspace's tree, a commit over its
seed, the bundle stored), for small changed workspaces like a scaling bench child's.

Two kinds of child, ``--n`` of each, made through :class:`~swarm.workspace.seed.Seeds`
as a worker makes them (full checkouts, no views): one that started empty, and one
seeded from a small repository (``--files`` files, committed, and one uncommitted).
Each then appends ``--lines`` lines to ``out.txt`` (as the bench's children do, one
``echo`` a command) and is captured. Prints the median and p90 wall of a capture, the
median CPU (this process's and the git processes it reaped; this process's own beside),
and the processes a capture started; the last capture of each kind is fetched back from
the store into a fresh repository, checking its tree.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from swarm.store.connection import connect
from swarm.store.server import EmbeddedServer
from swarm.store.snapshots import SnapshotStore
from swarm.workspace import gitstate as g
from swarm.workspace.seed import Seeds

SWARM = "sbenchcapture"


def cpu() -> tuple[float, float]:
    """CPU seconds of this process, and of the processes it reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


class Spawns:
    """Counts the processes ``subprocess`` starts."""

    def __init__(self) -> None:
        self.count = 0
        init: Any = subprocess.Popen.__init__

        def counted(popen: Any, *args: Any, **kwargs: Any) -> None:
            self.count += 1
            init(popen, *args, **kwargs)

        subprocess.Popen.__init__ = counted  # type: ignore[method-assign,assignment]


def make_repo(path: Path, files: int) -> None:
    path.mkdir(parents=True)
    for i in range(files):
        (path / f"src{i % 10}").mkdir(exist_ok=True)
        (path / f"src{i % 10}" / f"f{i:04d}.py").write_text(f"# file {i}\n" + "x = 1\n" * 20)
    (path / "README.md").write_text("a small repository\n")
    run = ["git", "-c", "user.name=b", "-c", "user.email=b@b"]
    subprocess.run([*run, "init", "-q"], cwd=path, check=True)
    subprocess.run([*run, "add", "-A"], cwd=path, check=True)
    subprocess.run([*run, "commit", "-qm", "base"], cwd=path, check=True)
    (path / "notes.md").write_text("uncommitted\n")


def measure(seeds: Seeds, kind: str, seed: str, n: int, lines: int,
            spawns: Spawns) -> dict[str, object]:
    walls, cpus, owns, procs, last, ws = [], [], [], [], "", None
    for i in range(n):
        ws = seeds.child(SWARM, f"{kind}{i:04d}", seed)
        with open(ws.path / "out.txt", "a") as out:
            for k in range(lines):
                out.write(f"{i}.{k}\n")
        before, began, started = cpu(), time.perf_counter(), spawns.count
        last = seeds.capture(ws, SWARM)
        walls.append(time.perf_counter() - began)
        after = cpu()
        owns.append(after[0] - before[0])
        cpus.append(after[0] + after[1] - before[0] - before[1])
        procs.append(spawns.count - started)
        assert last, f"{kind} child {i}: nothing captured"
    assert ws is not None
    # The last capture, from the store into a repository that never saw it.
    with tempfile.TemporaryDirectory(prefix="bench-capture-far-") as tmp:
        far = Seeds(seeds.store, Path(tmp), "far-host", view="checkout")
        repo = far.cache_for(last) if seed else far.cache
        far.fetch(last, repo)
        files = sorted(f for f in g.git("ls-tree", "-r", "-z", "--name-only", last,
                                        repo=repo).split("\0") if f)
        want = sorted(str(p.relative_to(ws.top)) for p in ws.top.rglob("*")
                      if p.is_file() and ".git" not in p.relative_to(ws.top).parts)
        assert files == want, (files, want)
    walls.sort()
    return {"kind": kind, "n": n, "wall_ms": statistics.median(walls) * 1000,
            "p90_ms": walls[int(len(walls) * 0.9)] * 1000,
            "cpu_ms": statistics.median(cpus) * 1000,
            "own_ms": statistics.median(owns) * 1000, "procs": statistics.median(procs)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.capture", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100, help="captures of each kind (default 100)")
    p.add_argument("--lines", type=int, default=3, help="lines appended to out.txt (3)")
    p.add_argument("--files", type=int, default=50, help="files of the seed's repository")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    server = EmbeddedServer(base / "server")
    try:
        client = connect(server.ensure())
        seeds = Seeds(SnapshotStore(client), base / "home", "bench-host", view="checkout")
        make_repo(base / "repo", args.files)
        tree = g.discover(base / "repo")
        assert tree is not None
        sid = seeds.take(base / "repo", SWARM, tree_of=tree)
        spawns = Spawns()
        for row in (measure(seeds, "empty", "", args.n, args.lines, spawns),
                    measure(seeds, "seeded", sid, args.n, args.lines, spawns)):
            print(f"{row['kind']:>7}: {row['n']} captures, wall median {row['wall_ms']:.2f} ms "
                  f"(p90 {row['p90_ms']:.2f}), CPU median {row['cpu_ms']:.2f} ms "
                  f"(this process {row['own_ms']:.2f}), "
                  f"{row['procs']:g} processes a capture")
        client.close()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
