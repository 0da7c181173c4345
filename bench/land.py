"""Landing: N children's changes landed in a parent's dirty working tree.

A synthetic git repository (``--land-files`` files of random text, ``--land-mb`` MB in
all, committed and packed as a clone is: the ``seed`` part's) is the root's workspace,
made dirty as a user's is: one tracked file edited, one untracked file. Its snapshot is
taken as for an ``agent`` call; then N children's work, each an edit of a different file
of the repository committed over that snapshot (as a child's capture is), and N results
naming them in a parent's session. Measured: :func:`swarm.workspace.homecoming.bring_home`,
the whole of what stands between the last child settling and the parent's next model
request that grows with the children (the parent's snapshot, N merges in the object
store, the work tree written once; the session save and the resume are not included),
``--land-repeats`` times, each on a fresh copy of the dirty tree. Target: under 10 ms a
child (2 s for 200) on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import log, median
from bench.seed import make_repo
from swarm.domain.session import Session
from swarm.store.connection import connect
from swarm.store.server import EmbeddedServer
from swarm.store.snapshots import SnapshotStore
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming
from swarm.workspace.seed import Seeds

SWARM = "sbenchland"


def children_work(repo: Path, seed: str, n: int) -> list[str]:
    """N commits over ``seed``, each editing a different file of it (as captures are)."""
    names = [p for p in g.git("ls-tree", "-r", "-z", "--name-only", seed, repo=repo)
             .split("\0") if p.endswith(".txt") and p != "d000/f00000.txt"][:n]
    deltas = []
    with tempfile.TemporaryDirectory(prefix="bench-land-") as tmp:
        env = {"GIT_DIR": str(repo), "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        for i, name in enumerate(names):
            g.git("read-tree", seed, env=env, cwd=repo)
            blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo,
                                  input=f"edited by child {i}\n", capture_output=True,
                                  text=True, check=True, env={"GIT_DIR": str(repo),
                                                              "PATH": "/usr/bin:/bin"}
                                  ).stdout.strip()
            g.git("update-index", "--cacheinfo", f"100644,{blob},{name}", env=env, cwd=repo)
            tree = g.git("write-tree", env=env, cwd=repo)
            deltas.append(g.commit(repo, tree, [seed], f"child {i}"))
    return deltas


def session_of(workspace: Path, seed: str, deltas: list[str]) -> Session:
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "agent", "arguments": json.dumps({"message": f"part {i}"})}}
             for i in range(len(deltas))]
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": "", "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": f"c{i}", "content": json.dumps(
        {"agent_id": f"a{i:04d}", "state": "done", "delta": d, "seed": seed})}
        for i, d in enumerate(deltas)]
    return Session(id="bench", workspace=str(workspace), messages=messages, usage={},
                   created=0, updated=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.land_n
    base = Path(tempfile.mkdtemp(prefix="bench-land-"))
    server = EmbeddedServer(base / "home")
    try:
        client = connect(server.ensure())
        seeds = Seeds(SnapshotStore(client), base / "home", "bench-host")
        pristine = base / "pristine"
        files, size = make_repo(pristine, args.land_files, args.land_mb)
        log(f"land: repository of {files} files, {size / 1e6:.1f} MB")
        runs: list[dict[str, Any]] = []
        for k in range(args.land_repeats):
            repo = base / f"repo-{k}"
            shutil.copytree(pristine, repo, symlinks=True)
            (repo / "d000" / "f00000.txt").write_text("the user's own edit\n")
            (repo / "notes.md").write_text("the user's untracked file\n")
            tree = g.discover(repo)
            assert tree is not None
            seed = seeds.take(repo, SWARM, tree_of=tree)
            deltas = children_work(tree.repo, seed, n)
            session = session_of(repo, seed, deltas)
            began = time.perf_counter()
            landing = homecoming.bring_home(seeds, session, repo, SWARM, tree)
            took = time.perf_counter() - began
            assert landing is not None
            landed = sum(1 for _, s in landing.children if s == homecoming.LANDED)
            assert landed == len(deltas), landing.children
            assert (repo / "d000" / "f00000.txt").read_text() == "the user's own edit\n"
            runs.append({"seconds": took, "landed": landed, "files": landing.files,
                         "per_child_ms": took * 1000 / max(1, landed)})
            log(f"land: {landed} children landed in {took:.2f} s "
                f"({took * 1000 / max(1, landed):.1f} ms a child)")
            shutil.rmtree(repo, ignore_errors=True)
        client.close()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    walls = [r["seconds"] for r in runs]
    return {"config": {"n": n, "files": files, "bytes": size, "repeats": args.land_repeats},
            "runs": runs, "median_seconds": median(walls) or 0.0,
            "median_per_child_ms": (median(walls) or 0.0) * 1000 / max(1, n)}


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    lines = [f"8. landing: {cfg['n']} children, each editing a different file of a repository "
             f"of {cfg['files']} files ({cfg['bytes'] / 1e6:.1f} MB), landed in a dirty "
             "working tree (bring_home: the parent's snapshot, the merges, the writes)"]
    for r in out["runs"]:
        lines.append(f"  {r['landed']} landed, {r['files']} files written: {r['seconds']:.2f} s, "
                     f"{r['per_child_ms']:.1f} ms a child")
    lines.append(f"  median {out['median_seconds']:.2f} s, {out['median_per_child_ms']:.1f} ms "
                 "a child (target < 10 ms a child)")
    return lines
