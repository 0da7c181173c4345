"""Bringing children's work home: before a parent resumes, each settled child's changes
(its workspace against the seed it started from) *land* in the parent's working tree, in
call order, as a three-way merge with the seed as base.

- What the parent's workspace holds now (its own edits since the call, the user's
  uncommitted and untracked files, earlier siblings' landings) is kept: a child whose
  changes conflict with it is not landed, and its result names the files and carries
  its hunks (capped). No conflict marker is ever written into the parent's files.
- What lands is written into the work tree only, as if the parent had made the edits
  itself: no commit, no branch, the parent's index untouched.
- Every child's changes are kept as ``refs/swarm/<swarm>/<agent>`` of the repository the
  parent's workspace is read through (the user's own, or the host's cache for a plain
  folder and a child), a namespace ``git branch`` does not show; they go with the swarm
  (:mod:`swarm.runtime.sweep`), or at once with ``swarm land --clean``.
- A call with ``land: keep`` keeps the child's changes aside, unlanded.

The merges are made in git's object store (``git merge-tree``), one after the other over
the tree the previous landing left; the work tree is written once, at the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.domain.messages import tool_body
from swarm.domain.session import Session
from swarm.errors import WorkspaceError
from swarm.runtime import gitstate as g
from swarm.runtime.seed import EMPTY, Seeds, Workspace

#: Characters of a conflicting child's hunks its result carries.
HUNKS_CAP = 4000
#: Landing states a child's result carries (``landing``).
LANDED, CONFLICT, KEPT, NONE, FAILED = "landed", "conflict", "kept", "no changes", "failed"


def ref_of(swarm_id: str, agent_id: str) -> str:
    """Where a child's changes are kept in the parent's repository."""
    return f"refs/swarm/{swarm_id}/{agent_id}"


@dataclass
class Parent:
    """The workspace children land in: its top folder, the repository it is read through
    (chosen by the worker or found before its commands ran, never from the folder), and
    how to read its tree."""

    top: Path
    odb: Path
    tree_of: g.WorkTree | None = None
    index: Path | None = None
    """The worker's own index of it (a child's, or a plain folder's)."""

    def snapshot(self) -> str:
        """Its tree as it is now (as its children were seeded: ignored and secret files
        left out)."""
        if self.tree_of is not None:
            return g.write_tree(self.tree_of)
        assert self.index is not None
        return g.write_tree(self.top, odb=self.odb, index=self.index)


def parent_of(seeds: Seeds, workspace: Path, tree_of: g.WorkTree | None,
              own: Workspace | None) -> Parent:
    """The :class:`Parent` for a workspace: a git work tree (``tree_of``), a seeded
    child's (``own``), else a plain folder read into the host's cache."""
    if tree_of is not None:
        return Parent(tree_of.top, tree_of.repo, tree_of=tree_of)
    if own is not None and own.odb is not None and own.index is not None:
        return Parent(own.top, own.odb, index=own.index)
    key = hashlib.sha256(str(workspace.resolve()).encode()).hexdigest()[:16]
    return Parent(workspace, seeds.cache, index=seeds.home / "seeds" / "index" / key)


@dataclass
class Landing:
    """What landing a parent's children did: per child, its id and landing state."""

    children: list[tuple[str, str]] = field(default_factory=list)
    files: int = 0
    """Files written or removed in the parent's work tree."""
    conflicts: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        """One line for a person ("" when no child sent changes)."""
        landed = sum(1 for _, state in self.children if state == LANDED)
        if not landed and not self.conflicts:
            return ""
        text = f"{landed} child{'ren' if landed != 1 else ''} landed ({self.files} files " \
               "changed in your working tree, uncommitted)"
        for item in self.conflicts:
            text += (f"; {item['agent_id']} conflicts in {', '.join(item['conflicts'][:5])}"
                     f" (see: {item['show']})")
        return text


def bring_home(seeds: Seeds, session: Session, workspace: Path, swarm_id: str,
               tree_of: g.WorkTree | None = None, own: Workspace | None = None) -> Landing | None:
    """Before a parent resumes: land its children's work (the results just appended to
    its session) in its workspace (``tree_of``: its git work tree as its caller knows it;
    ``own``: a seeded child's workspace); each result is rewritten to say how it landed.
    None when no result had work to bring (nothing to save)."""
    todo: list[tuple[dict[str, Any], dict[str, Any]]] = []
    calls: dict[str, dict[str, Any]] = {}
    for message in reversed(session.messages):
        if message.get("role") == "assistant":
            calls = _arguments(message)
            break
        body = tool_body(message)
        # A worker's result says "none: ..." (NO_CHANGES) when its child changed nothing.
        if body is not None and ("delta" in body or
                                 str(body.get("changes", "")).split(":")[0] == "none"):
            todo.append((message, body))
    if not todo:
        return None
    todo.reverse()  # call order
    for message, body in todo:
        body["land"] = str(calls.get(str(message.get("tool_call_id", "")), {}).get("land")
                           or "merge")
    parent = parent_of(seeds, workspace, tree_of, own)
    done = land(seeds, parent, [body for _, body in todo], swarm_id)
    for message, body in todo:
        message["content"] = json.dumps(body, ensure_ascii=False, indent=1)
    return done


def _arguments(message: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The parsed arguments of an assistant message's tool calls, by call id."""
    out: dict[str, dict[str, Any]] = {}
    for call in message.get("tool_calls") or []:
        with contextlib.suppress(ValueError, TypeError, KeyError):
            args = json.loads(call["function"]["arguments"] or "{}")
            if isinstance(args, dict):
                out[str(call.get("id", ""))] = args
    return out


def land(seeds: Seeds, parent: Parent, bodies: list[dict[str, Any]], swarm_id: str) -> Landing:
    """Land each result's ``delta`` (in order) in ``parent``; rewrite each ``body``."""
    done = Landing()
    odb = parent.odb

    def fetch(body: dict[str, Any]) -> None:
        if body.get("delta"):
            try:
                seeds.fetch(str(body["delta"]), odb)
            except WorkspaceError as exc:
                body["home_error"] = f"its work could not be brought home: {exc}"

    with ThreadPoolExecutor(max_workers=min(8, len(bodies) or 1)) as pool:
        list(pool.map(fetch, bodies))
    start = ours = ""
    listing: set[str] | None = None
    for body in bodies:
        agent = str(body.get("agent_id", ""))
        delta, seed = str(body.pop("delta", "") or ""), str(body.pop("seed", "") or "")
        mode = body.pop("land", "merge")
        body.pop("host", None)
        seed = "" if seed == EMPTY else seed
        if not delta or "home_error" in body:
            body["landing"] = FAILED if "home_error" in body else NONE
            done.children.append((agent, body["landing"]))
            continue
        try:
            if not seed:  # started empty (seed: false): its files are kept aside
                _files_aside(seeds, body, delta, swarm_id, agent)
                body["landing"] = KEPT
                done.children.append((agent, KEPT))
                continue
            ref = ref_of(swarm_id, agent)
            g.git("update-ref", ref, delta, repo=odb)
            # In the user's repository, git finds it from their folder.
            show = f"git diff {seed[:12]} {ref}" if parent.tree_of is not None else \
                f"git --git-dir={odb} diff {seed[:12]} {ref}"
            body.update(kept=ref, show=show)
            if mode == "keep":
                body["landing"] = KEPT
                done.children.append((agent, KEPT))
                continue
            if not ours:
                start = ours = parent.snapshot()
            base = g.git("rev-parse", f"{seed}^{{tree}}", repo=odb)
            if ours == base:
                merged = g.git("rev-parse", f"{delta}^{{tree}}", repo=odb)
                conflicts: list[str] = []
            else:
                mine = g.commit(odb, ours, [seed], "swarm: the parent's workspace")
                merged, conflicts = g.merge_trees(odb, mine, delta)
            added, _ = g.changes(odb, seed, delta)
            if not conflicts:
                # A file the parent's snapshot leaves out (ignored, a secret) is never
                # overwritten.
                on_disk = [f for f in added if os.path.lexists(parent.top / f)]
                if on_disk:
                    if listing is None:
                        listing = set(g.git("ls-tree", "-r", "-z", "--name-only", start,
                                            repo=odb).split("\0"))
                    conflicts = [f for f in on_disk if f not in listing]
            if conflicts:
                hunks = g.git("diff", "--no-ext-diff", "--no-textconv", seed, delta, "--",
                              *conflicts, repo=odb)
                if len(hunks) > HUNKS_CAP:
                    hunks = hunks[:HUNKS_CAP] + f"\n[... {len(hunks) - HUNKS_CAP} more " \
                                                "characters cut]"
                body.update(landing=CONFLICT, conflicts=conflicts, hunks=hunks,
                            how=("not landed: these files changed in your workspace too. "
                                 "Continue this child (agent_id) to redo its change over "
                                 "your workspace as it is now, or make it yourself"))
                done.conflicts.append({"agent_id": agent, "conflicts": conflicts,
                                       "show": show})
                done.children.append((agent, CONFLICT))
                continue
            ours = merged
            body["landing"] = LANDED
            done.children.append((agent, LANDED))
        except WorkspaceError as exc:
            body.update(landing=FAILED, home_error=f"its work could not be landed: {exc}")
            done.children.append((agent, FAILED))
    if ours and ours != start:
        done.files = write_changes(odb, parent.top, start, ours)
    return done


def write_changes(repo: Path, top: Path, old: str, new: str) -> int:
    """Make the work tree ``top`` go from tree ``old`` to tree ``new`` of ``repo``, path
    by path, through a temporary index (the work tree's own is not touched); the number
    of paths written or removed."""
    out = g.git("diff-tree", "-r", "-z", "--no-renames", "--name-status", old, new, repo=repo)
    parts = out.split("\0")
    pairs = list(zip(parts[::2], parts[1::2], strict=False))
    gone = [name for status, name in pairs if status.startswith("D")]
    written = [name for status, name in pairs if name and not status.startswith("D")]
    for name in gone:
        path = top / name
        with contextlib.suppress(FileNotFoundError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        for folder in Path(name).parents:  # folders left empty go, as git's checkout does
            if str(folder) == ".":
                break
            with contextlib.suppress(OSError):
                (top / folder).rmdir()
    if written:
        with tempfile.TemporaryDirectory(prefix="swarm-land-") as tmp:
            env = {"GIT_DIR": str(repo), "GIT_COMMON_DIR": str(repo),
                   "GIT_WORK_TREE": str(top), "GIT_INDEX_FILE": str(Path(tmp) / "index")}
            g.git("read-tree", new, cwd=top, env=env)
            for at in range(0, len(written), 500):
                g.git("checkout-index", "-f", "--", *written[at:at + 500], cwd=top, env=env)
    return len(gone) + len(written)


def _files_aside(seeds: Seeds, body: dict[str, Any], delta: str, swarm_id: str,
                 agent: str) -> None:
    """A child that started empty: its files at ``SWARM_HOME/returned/<swarm>/<agent>``."""
    repo = seeds.cache
    seeds.fetch(delta, repo)
    files = [f for f in g.git("ls-tree", "-r", "-z", "--name-only", delta,
                              repo=repo).split("\0") if f]
    dest = seeds.home / "returned" / swarm_id / agent
    if dest.exists():
        shutil.rmtree(dest)
    g.checkout_files(repo, delta, dest, files)
    body["files_at"] = str(dest)
