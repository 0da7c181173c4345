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
  (:mod:`swarm.workspace.sweep`), or at once with ``swarm land --clean``.
- A call with ``land: keep`` keeps the child's changes aside, unlanded.
- A check command (the call's ``check``, else ``SWARM_LAND_CHECK``) runs in the parent's
  workspace, as the parent's commands run, after each landing; a landing it fails is
  undone, and the child's result carries the end of its output.

The merges are made in git's object store (``git merge-tree``), one after the other over
the tree the previous landing left; the work tree is written once, at the end (before each
check, when there is one).

Over 400 lines because landing is one sequence over one merge state (:class:`_Tree`): each
child merged over the tree the previous landing left, checked, undone on a failed check,
written once; and a continued child's :func:`rebase` is the same three-way merge seen from
the child's side.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.agent.protocols import Environment
from swarm.domain.messages import tool_body
from swarm.domain.session import Session
from swarm.domain.spawn import BACKGROUND_SETTLED, joined_body
from swarm.errors import WorkspaceError
from swarm.workspace import gitstate as g
from swarm.workspace.seed import EMPTY, Seeds, Workspace, folder_cache

#: Characters of a conflicting child's hunks its result carries.
HUNKS_CAP = 4000
#: Characters of a failed check's output a child's result carries (its end).
CHECK_TAIL = 2000
#: Landing states a child's result carries (``landing``).
LANDED, CONFLICT, KEPT, NONE, FAILED = "landed", "conflict", "kept", "no changes", "failed"
CHECK_FAILED = "check failed"


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

    def snapshot(self, keep: Path | None = None) -> str:
        """Its tree as it is now (as its children were seeded: ignored and secret files
        left out); ``keep``: where to copy the index that holds it (:func:`write_changes`)."""
        if self.tree_of is not None:
            return g.write_tree(self.tree_of, keep=keep)
        assert self.index is not None
        return g.write_tree(self.top, odb=self.odb, index=self.index, keep=keep)


def parent_of(seeds: Seeds, workspace: Path, tree_of: g.WorkTree | None,
              own: Workspace | None, make: bool = True) -> Parent:
    """The :class:`Parent` for a workspace: a git work tree (``tree_of``), a seeded
    child's (``own``), else a plain folder read into its cache on this host (made on first
    use unless ``make`` is False: no landing will read it)."""
    if tree_of is not None:
        return Parent(tree_of.top, tree_of.repo, tree_of=tree_of)
    if own is not None and own.odb is not None and own.index is not None:
        return Parent(own.top, own.odb, index=own.index)
    cache = seeds.folder_cache(workspace) if make else folder_cache(seeds.home, workspace)
    return parent_of_folder(workspace, cache, None, seeds.home)


def parent_of_folder(top: Path, odb: Path, tree_of: g.WorkTree | None, home: Path) -> Parent:
    """The :class:`Parent` of a root's or a job's folder ``top``: its git work tree, else a
    plain folder read into ``odb`` (the host's cache) with the index seeding keeps."""
    if tree_of is not None:
        return Parent(tree_of.top, tree_of.repo, tree_of=tree_of)
    key = hashlib.sha256(str(top.resolve()).encode()).hexdigest()[:16]
    return Parent(top, odb, index=home / "seeds" / "index" / key)


@dataclass
class Landing:
    """What landing a parent's children did: per child, its id and landing state."""

    children: list[tuple[str, str]] = field(default_factory=list)
    files: int = 0
    """Files written or removed in the parent's work tree."""
    added: int = 0
    removed: int = 0
    """Lines the landings added and removed (text files)."""
    conflicts: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        """One line for a person ("" when no child sent changes)."""
        return summary([self])


def summary(landings: list[Landing]) -> str:
    """One line on what ``landings`` did, with the command that shows each conflict ("" when
    no child sent changes)."""
    states = [state for one in landings for _, state in one.children]
    landed = states.count(LANDED)
    conflicts = [item for one in landings for item in one.conflicts]
    failed = [agent for one in landings for agent, state in one.children
              if state == CHECK_FAILED]
    if not landed and not conflicts and not failed:
        return ""
    files = sum(one.files for one in landings)
    text = (f"{landed} child{'ren' if landed != 1 else ''} landed: {files} "
            f"file{'s' if files != 1 else ''} changed in your working tree, "
            f"+{sum(one.added for one in landings)} -{sum(one.removed for one in landings)} "
            "lines, uncommitted")
    for item in conflicts:
        text += (f"; {item['agent_id']} conflicts in {', '.join(item['conflicts'][:5])}"
                 f" (see: {item['show']})")
    for agent in failed:
        text += f"; {agent} failed the check (`swarm logs {agent}` shows its output)"
    return text


def bring_home(seeds: Seeds, session: Session, workspace: Path, swarm_id: str,
               tree_of: g.WorkTree | None = None, own: Workspace | None = None,
               run_check: Check | None = None, check: str = "") -> Landing | None:
    """Before a parent resumes: land its children's work (the results just appended to
    its session) in its workspace (``tree_of``: its git work tree as its caller knows it;
    ``own``: a seeded child's workspace); each result is rewritten to say how it landed.
    ``run_check`` runs a call's ``check`` (else ``check``) after its landing (see
    :func:`land`). None when no result had work to bring (nothing to save)."""
    todo: list[tuple[str, dict[str, Any]]] = []
    joins: list[tuple[dict[str, Any], dict[str, Any]]] = []
    calls: dict[str, dict[str, Any]] = {}
    for message in reversed(session.messages):
        if message.get("role") == "assistant":
            calls = _arguments(message)
            break
        joined = joined_body(message)
        if joined is not None:  # background children's results, as the parent took them
            joins.append((message, joined))
            todo.extend((str(b.get("call_id", "")), b) for b in reversed(joined["results"])
                        if isinstance(b, dict) and _has_work(b))
            continue
        body = tool_body(message)
        if body is not None and _has_work(body):
            todo.append((str(message.get("tool_call_id", "")), body))
            joins.append((message, body))
    if not todo:
        return None
    todo.reverse()  # call order
    for call_id, body in todo:
        args = calls.get(call_id) or _call_arguments(session, call_id)
        body["land"] = str(args.get("land") or "merge")
        if isinstance(args.get("check"), str):
            body["check"] = args["check"]
    # Results that need nothing of the parent's tree (no changes, or files left in the
    # child's own folder here) make no cache for a plain folder: a git init at each new one.
    parent = parent_of(seeds, workspace, tree_of, own,
                       make=not all(_lands_alone(seeds, b) for _, b in todo))
    done = land(seeds, parent, [body for _, body in todo], swarm_id, run_check, check)
    for message, body in joins:
        text = json.dumps(body, ensure_ascii=False, indent=1)
        settled = str(message.get("content", "")).startswith(BACKGROUND_SETTLED)
        message["content"] = BACKGROUND_SETTLED + text if settled else text
    return done


def _has_work(body: dict[str, Any]) -> bool:
    """A child's result with work to bring: a delta, or "none: ..." (NO_CHANGES) when it
    changed nothing."""
    return "delta" in body or str(body.get("changes", "")).split(":")[0] == "none"


def _call_arguments(session: Session, call_id: str) -> dict[str, Any]:
    """The arguments of an earlier call (a background ``agent`` call, whose result the
    parent took later); ``{}`` once compaction dropped it."""
    for message in reversed(session.messages):
        if message.get("role") == "assistant":
            args = _arguments(message)
            if call_id in args:
                return args[call_id]
    return {}


def _arguments(message: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The parsed arguments of an assistant message's tool calls, by call id."""
    out: dict[str, dict[str, Any]] = {}
    for call in message.get("tool_calls") or []:
        with contextlib.suppress(ValueError, TypeError, KeyError):
            args = json.loads(call["function"]["arguments"] or "{}")
            if isinstance(args, dict):
                out[str(call.get("id", ""))] = args
    return out


#: Runs a check command in the parent's workspace (as its own commands run): whether it
#: passed, and the tail of its output.
Check = Callable[[str], tuple[bool, str]]


def land(seeds: Seeds | None, parent: Parent, bodies: list[dict[str, Any]], swarm_id: str,
         run_check: Check | None = None, check: str = "") -> Landing:
    """Land each result's ``delta`` (in order) in ``parent``; rewrite each ``body``.
    Without ``seeds`` (``swarm land``), the deltas must be in the parent's repository.
    With ``run_check``, a landing whose check command (the body's ``check``, else
    ``check``) fails is undone."""
    done = Landing()
    odb = parent.odb

    def fetch(item: tuple[Path, dict[str, Any]]) -> None:
        repo, body = item
        try:
            assert seeds is not None
            seeds.fetch(str(body["delta"]), repo)
        except WorkspaceError as exc:
            body["home_error"] = f"its work could not be brought home: {exc}"

    # Each delta is fetched only where its landing reads it: a child that started empty
    # and worked on this host has its files where it left them, nothing to fetch.
    wanted: dict[Path, list[dict[str, Any]]] = {}
    for body in bodies:
        repo = _read_from(seeds, odb, body)
        if body.get("delta") and repo is not None:
            wanted.setdefault(repo, []).append(body)
    missing: list[tuple[Path, dict[str, Any]]] = []
    for repo, group in wanted.items():
        present = _present(repo, [str(b["delta"]) for b in group])
        missing += [(repo, b) for b in group if str(b["delta"]) not in present]
    if missing and seeds is not None:
        with ThreadPoolExecutor(max_workers=min(8, len(missing))) as pool:
            list(pool.map(fetch, missing))
    tree = _Tree(parent)
    tree.changes = _changes(odb, [str(b["delta"]) for b in wanted.get(odb, [])
                                  if "home_error" not in b])
    for body in bodies:
        agent = str(body.get("agent_id", ""))
        try:
            state = _land_one(seeds, parent, tree, body, swarm_id, run_check, check)
        except WorkspaceError as exc:
            body["home_error"] = f"its work could not be landed: {exc}"
            state = FAILED
        body["landing"] = state
        done.children.append((agent, state))
        if state == CONFLICT:
            done.conflicts.append({"agent_id": agent, "conflicts": body["conflicts"],
                                   "show": body["show"]})
    _hunks(odb, [b for b in bodies if b.get("landing") == CONFLICT])
    if tree.refs:
        g.git("update-ref", "--stdin", repo=odb,
              input="".join(f"update {ref} {sha}\n" for ref, sha in tree.refs))
    try:
        done.files, done.added, done.removed = tree.finish()
    except WorkspaceError as exc:  # a file changed or appeared meanwhile: nothing written
        for i, (agent, state) in enumerate(done.children):
            if state == LANDED:
                done.children[i] = (agent, FAILED)
        for body in bodies:
            if body.get("landing") == LANDED:
                body.update(landing=FAILED, home_error=(
                    f"its work could not be written into your workspace ({exc}); it is "
                    f"kept: `swarm land {body.get('agent_id', '')}` lands it later"))
    return done


def _read_from(seeds: Seeds | None, odb: Path, body: dict[str, Any]) -> Path | None:
    """The repository a result's delta is read from when it lands: the parent's
    (``odb``), the host's cache for a child that started empty (its files are kept
    aside), or None for one that did so on this host (its files are where it left them)."""
    if seeds is None or str(body.get("seed") or "") not in ("", EMPTY):
        return odb
    return None if _left_here(seeds, body) else seeds.cache


def _lands_alone(seeds: Seeds, body: dict[str, Any]) -> bool:
    """A result whose landing reads nothing of the parent's workspace (see
    :func:`_land_one`): an error, no changes, or the files of a child that started empty,
    left in its own folder on this host."""
    return "home_error" in body or not body.get("delta") or (
        str(body.get("seed", "") or "") in ("", EMPTY) and _left_here(seeds, body))


def _left_here(seeds: Seeds, body: dict[str, Any]) -> bool:
    """Whether a child that started empty left its files on this host, in its own folder."""
    return body.get("host") == seeds.host and Path(str(body.get("workspace", ""))).is_dir()


def _present(repo: Path, commits: list[str]) -> set[str]:
    """Which of ``commits`` ``repo`` has (one git process)."""
    if not commits:
        return set()
    out = g.git("cat-file", "--batch-check=%(objectname) %(objecttype)", repo=repo,
                input="".join(f"{c}\n" for c in commits))
    return {line.split()[0] for line in out.splitlines() if line.endswith(" commit")}


def _hunks(repo: Path, bodies: list[dict[str, Any]]) -> None:
    """Each conflicting result's ``hunks``: its own changes to the files in conflict (its
    capture against its seed, capped), for all of them in one git process."""
    if not bodies:
        return
    deltas: dict[str, list[dict[str, Any]]] = {}
    for body in bodies:
        deltas.setdefault(str(body.pop("delta_of_hunks")), []).append(body)
    paths = sorted({p for b in bodies for p in b["conflicts"]})
    out = g.git("diff-tree", "--stdin", "-p", "--no-renames", "--no-ext-diff", "--no-textconv",
                "--", *paths, repo=repo, input="".join(f"{d}\n" for d in deltas))
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.splitlines(keepends=True):
        key = line.strip()
        if key in deltas:
            current = found.setdefault(key, [])
        elif current is not None:
            current.append(line)
    for delta, body in ((d, b) for d, group in deltas.items() for b in group):
        mine = set(body["conflicts"])
        text, keep = "", False
        for line in found.get(delta, []):
            if line.startswith("diff --git "):
                keep = line.rstrip("\n").rsplit(" b/", 1)[-1] in mine
            if keep:
                text += line
        if len(text) > HUNKS_CAP:
            text = text[:HUNKS_CAP] + f"\n[... {len(text) - HUNKS_CAP} more characters cut]"
        body["hunks"] = text.rstrip("\n")


def checker(env: Environment, timeout: int) -> Check:
    """A :data:`Check` that runs the command as the parent's own commands run (its box)."""
    def run(command: str) -> tuple[bool, str]:
        done = env.execute(command, timeout)
        return done.exit_code == 0 and not done.timed_out, done.for_model()
    return run


#: One path a child changed: (its new mode, its new object, git's status letter, the path).
Change = tuple[str, str, str, str]


def _changes(repo: Path, commits: list[str]) -> dict[str, list[Change]]:
    """What each commit changed over its parent (a child's capture, over its seed), in
    one git process."""
    out: dict[str, list[Change]] = {c: [] for c in commits}
    if not commits:
        return out
    raw = g.git("diff-tree", "--stdin", "-r", "-z", "--no-renames", "--raw", repo=repo,
                input="".join(f"{c}\n" for c in commits), raw=True)
    tokens = raw.split("\0")
    current: list[Change] | None = None
    i = 0
    while i < len(tokens):
        token = tokens[i].strip("\n")
        if token.startswith(":") and current is not None and i + 1 < len(tokens):
            _, new_mode, _, new_sha, status = token[1:].split(" ")
            current.append((new_mode, new_sha, status[:1], tokens[i + 1]))
            i += 2
            continue
        if token:
            current = out.get(token)
        i += 1
    return out


class _Tree:
    """The parent's tree as landings leave it: ``ours`` (a tree) with ``pending`` changes
    of children whose paths no one else touched, staged over it without a merge; what of
    it is written in its work tree (``written``); what it was before (``start``)."""

    def __init__(self, parent: Parent) -> None:
        self.parent = parent
        self.start = self.ours = self.written = ""
        self._tmp = tempfile.TemporaryDirectory(prefix="swarm-land-")
        self.index = Path(self._tmp.name) / "index"
        """An index of ``written``, its file times fresh: what the work tree is written
        through (:func:`write_changes`)."""
        self.pending: dict[str, Change] = {}
        self.changes: dict[str, list[Change]] = {}
        self.refs: list[tuple[str, str]] = []
        self._listing: set[str] | None = None
        self._touched: dict[str, tuple[set[str], set[str]]] = {}

    def _begin(self) -> None:
        if not self.ours:
            self.start = self.ours = self.written = self.parent.snapshot(keep=self.index)

    def now(self) -> str:
        """The parent's tree, all landings so far in it."""
        self._begin()
        if self.pending:
            self.flush()
        return self.ours

    def listed(self, name: str) -> bool:
        """Whether the parent's snapshot (before the landings) holds ``name``."""
        if self._listing is None:
            self._listing = set(g.git("ls-tree", "-r", "-z", "--name-only", self.start,
                                      repo=self.parent.odb, raw=True).split("\0"))
        return name in self._listing

    def in_the_way(self, name: str) -> bool:
        """Whether writing ``name`` would replace something of the parent's its snapshot
        left out (an ignored or secret file, or one such at a folder of its path)."""
        top = self.parent.top
        if os.path.lexists(top / name) and not self.listed(name):
            return True
        for folder in Path(name).parents:
            part = str(folder)
            if part == ".":
                break
            path = top / part
            if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()) \
                    and not self.listed(part):
                return True
        return False

    def apart(self, seed: str, changes: list[Change]) -> bool:
        """Whether no path of ``changes`` (or a folder of one, or one under it) differs
        between the seed and the parent's tree with what is staged: then they apply as
        they are, and a merge could only agree."""
        self._begin()
        if seed not in self._touched:
            if self.pending:  # a seed seen first now: measured against what is staged too
                self.flush()
            names = {p for p in g.git("diff-tree", "-r", "-z", "--no-renames", "--name-only",
                                      seed, self.ours, repo=self.parent.odb, raw=True
                                      ).split("\0") if p}
            self._touched[seed] = (names, {str(d) for n in names for d in Path(n).parents})
        touched, folders = self._touched[seed]
        for change in changes:
            name = change[3]
            staged = self.pending.get(name)
            if staged is not None and staged[:3] == change[:3]:
                continue  # an earlier sibling made the very same change
            if name in touched or name in folders or staged is not None or \
                    any(str(d) in touched for d in Path(name).parents):
                return False
        return True

    def clashes(self, changes: list[Change]) -> list[str]:
        """Files ``changes`` add that an earlier sibling's staged landing added otherwise:
        conflicts without a merge to ask."""
        return [c[3] for c in changes if c[2] == "A" and c[3] in self.pending
                and self.pending[c[3]][2] == "A" and self.pending[c[3]][:2] != c[:2]]

    def stage(self, changes: list[Change]) -> None:
        for change in changes:
            self.pending[change[3]] = change
            for names, folders in self._touched.values():
                names.add(change[3])
                folders.update(str(d) for d in Path(change[3]).parents)

    def flush(self) -> None:
        """Make ``ours`` hold what is staged (one temporary index)."""
        gone = [c for c in self.pending.values() if c[2] == "D"]
        kept = [c for c in self.pending.values() if c[2] != "D"]
        lines = [f"0 {'0' * 40}\t{c[3]}\0" for c in gone] + \
            [f"{c[0]} {c[1]}\t{c[3]}\0" for c in kept]
        with tempfile.TemporaryDirectory(prefix="swarm-land-") as tmp:
            env = {"GIT_DIR": str(self.parent.odb), "GIT_COMMON_DIR": str(self.parent.odb),
                   "GIT_INDEX_FILE": str(Path(tmp) / "index")}
            g.git("read-tree", self.ours, env=env, cwd=self.parent.odb)
            g.git("update-index", "-z", "--index-info", env=env, cwd=self.parent.odb,
                  input="".join(lines))
            self.ours = g.git("write-tree", env=env, cwd=self.parent.odb)
        self.pending = {}

    def merged(self, tree: str) -> None:
        """A merge made ``tree`` the parent's tree."""
        self.ours = tree
        self._touched.clear()

    def write(self, tree: str) -> None:
        """Make the work tree hold ``tree`` now."""
        if tree != self.written:
            write_changes(self.parent.odb, self.parent.top, self.written, tree, self.index,
                          trust_ctime=self.parent.tree_of is not None)
            self.written = tree

    def finish(self) -> tuple[int, int, int]:
        """Write what is left; the paths the landings changed, and the lines they added
        and removed."""
        if not self.ours:
            self._tmp.cleanup()
            return 0, 0, 0
        try:
            self.write(self.now())
        finally:
            self._tmp.cleanup()
        if self.ours == self.start:
            return 0, 0, 0
        files = added = removed = 0
        for line in g.git("diff-tree", "-r", "--no-renames", "--numstat", self.start, self.ours,
                          repo=self.parent.odb).splitlines():
            plus, minus, _ = line.split("\t", 2)
            files += 1
            added += int(plus) if plus.isdigit() else 0
            removed += int(minus) if minus.isdigit() else 0
        return files, added, removed


def _land_one(seeds: Seeds | None, parent: Parent, tree: _Tree, body: dict[str, Any],
              swarm_id: str, run_check: Check | None, default_check: str) -> str:
    """Land one child's result over ``tree``; its landing state (``body`` says more)."""
    odb = parent.odb
    agent = str(body.get("agent_id", ""))
    delta, seed = str(body.pop("delta", "") or ""), str(body.pop("seed", "") or "")
    mode = body.pop("land", "merge")
    check = str(body.pop("check", "") or default_check)
    here = seeds is not None and _left_here(seeds, body)
    body.pop("host", None)
    seed = "" if seed == EMPTY else seed
    if "home_error" in body:
        return FAILED
    if not delta:
        return NONE
    if not seed and seeds is not None:  # started empty: its files are kept aside
        if here:
            body["files_at"] = str(body["workspace"])  # its own folder, here: nothing moves
        else:
            _files_aside(seeds, body, delta, swarm_id, agent)
        return KEPT
    ref = ref_of(swarm_id, agent)
    tree.refs.append((ref, delta))
    # In the user's repository, git finds it from their folder.
    body["kept"] = ref
    body["show"] = f"git diff {seed[:12]} {ref}" if parent.tree_of is not None else \
        f"git --git-dir={odb} diff {seed[:12]} {ref}"
    if mode == "keep":
        return KEPT
    changes = tree.changes.get(delta)
    if changes is None:
        changes = _changes(odb, [delta])[delta]
    gated = bool(check and run_check is not None)
    conflicts: list[str] = [] if gated else tree.clashes(changes)
    merged = ""
    if conflicts or (not gated and tree.apart(seed, changes)):
        pass  # a clash of added files is reported below; apart, staged as it is
    else:
        ours = tree.now()
        mine = g.commit(odb, ours, [seed], "swarm: the parent's workspace")
        merged, conflicts = g.merge_trees(odb, mine, delta)
    if not conflicts:
        # A file the parent's snapshot leaves out (ignored, a secret) is never overwritten.
        conflicts = [c[3] for c in changes if c[2] != "D" and tree.in_the_way(c[3])]
    if conflicts:
        body["delta_of_hunks"] = delta  # its hunks, for all conflicts at once (_hunks)
        body.update(conflicts=conflicts, how=(
            "not landed: these files changed in your workspace too. Continue this child "
            "(agent_id) to redo its change over your workspace as it is now, or make it "
            "yourself"))
        return CONFLICT
    if not merged:
        tree.stage(changes)
        return LANDED
    if gated:
        assert run_check is not None
        before = tree.ours
        tree.write(merged)
        passed, output = run_check(check)
        if not passed:
            body.update(check=check, check_output=output[-CHECK_TAIL:])
            try:
                tree.write(before)  # undone: the work tree as it was before this landing
            except WorkspaceError as exc:  # the check changed the files it brought
                tree.merged(merged)
                body["how"] = (f"the check failed, and its changes could not be taken back "
                               f"({exc}): they are in your workspace; fix them or undo them")
                return CHECK_FAILED
            body["how"] = ("not landed: the check failed with its changes in your workspace "
                           "(they were taken back). Continue this child (agent_id) with the "
                           "check's output, or make the change yourself")
            return CHECK_FAILED
    tree.merged(merged)
    return LANDED


def write_changes(repo: Path, top: Path, old: str, new: str, index: Path,
                  trust_ctime: bool = True) -> None:
    """Make the work tree ``top`` go from tree ``old`` to tree ``new`` of ``repo`` through
    ``index`` (an index of ``old`` whose file times are the work tree's: the work tree's
    own index is not touched), by git's two-tree merge: it writes and removes only the
    paths that differ, never through a link in a folder of their path, never a file
    changed since ``old`` was read or one it does not know (``WorkspaceError`` instead:
    nothing is written), and leaves a folder that is not empty (a submodule's) in place.
    ``index`` then holds ``new``. ``trust_ctime``: False for an index swarm keeps
    (:data:`~swarm.workspace.gitstate.UNTRUSTED_CTIME`)."""
    env = {"GIT_DIR": str(repo), "GIT_COMMON_DIR": str(repo), "GIT_WORK_TREE": str(top),
           "GIT_INDEX_FILE": str(index)}
    config = () if trust_ctime else g.UNTRUSTED_CTIME
    g.git(*config, "read-tree", "-m", "-u", old, new, cwd=top, env=env)


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


def rebase(seeds: Seeds, ws: Workspace, seed: str, swarm_id: str,
           agent_id: str) -> tuple[Workspace, list[str]]:
    """A continued child's workspace ``ws`` made anew from its parent's snapshot ``seed``
    (a repository of its own again), its own changes over its old seed re-applied by a
    three-way merge; the files where they did not fit (the parent's version is there)."""
    old = ws.seed
    delta = seeds.capture(ws, swarm_id)
    seeds.unmount(ws)
    top = ws.top
    seeds.unmount_view(top.parent / ".views" / top.name, top, remove=True)
    shutil.rmtree(top, ignore_errors=True)
    new = seeds.child(swarm_id, agent_id, seed)
    if not delta or new.odb is None:
        return new, []
    odb = new.odb
    seeds.fetch(delta, odb)
    fresh = g.git("rev-parse", f"{seed}^{{tree}}", repo=odb)
    mine = g.commit(odb, fresh, [old], "swarm: the parent's workspace")
    merged, conflicts = g.merge_trees(odb, mine, delta)
    if conflicts:  # the parent's version of those files, no conflict marker
        with tempfile.TemporaryDirectory(prefix="swarm-rebase-") as tmp:
            env = {"GIT_DIR": str(odb), "GIT_COMMON_DIR": str(odb),
                   "GIT_INDEX_FILE": str(Path(tmp) / "index")}
            g.git("read-tree", merged, env=env, cwd=odb)
            g.git("rm", "-q", "--cached", "--ignore-unmatch", "--", *conflicts, env=env,
                  cwd=odb)
            listed = g.git("ls-tree", "-r", "-z", fresh, "--", *conflicts, repo=odb, raw=True)
            lines = []
            for entry in listed.split("\0"):
                meta, tab, name = entry.partition("\t")
                if tab:
                    mode, _, sha = meta.split()
                    lines.append(f"{mode} {sha}\t{name}\0")
            if lines:
                g.git("update-index", "-z", "--index-info", env=env, cwd=odb,
                      input="".join(lines))
            merged = g.git("write-tree", env=env, cwd=odb)
    with tempfile.TemporaryDirectory(prefix="swarm-rebase-") as tmp:
        index = Path(tmp) / "index"
        assert new.index is not None
        shutil.copy2(new.index, index)  # the fresh checkout's, file times included
        env = {"GIT_DIR": str(odb), "GIT_COMMON_DIR": str(odb), "GIT_WORK_TREE": str(new.top),
               "GIT_INDEX_FILE": str(index)}
        g.ok(*g.UNTRUSTED_CTIME, "update-index", "-q", "--refresh", cwd=new.top, env=env)
        write_changes(odb, new.top, fresh, merged, index, trust_ctime=False)
    return new, conflicts
