"""Bringing children's work home: before a parent resumes, each child's delta becomes
branch ``swarm/<agent_id>`` of the parent's repository (over the commit of the parent's
workspace the child started from), or, for a parent in a plain folder, its changed files
at a path on the parent's host named in its result.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from swarm.domain.messages import tool_body
from swarm.domain.session import Session
from swarm.errors import WorkspaceError
from swarm.runtime import gitstate as g
from swarm.runtime.seed import EMPTY, Seeds


def bring_home(seeds: Seeds, session: Session, workspace: Path, swarm_id: str,
               tree_of: g.WorkTree | None = None) -> bool:
    """Before a parent resumes: its children's work (the results just appended to
    its session) as branches of its repository (``tree_of``: the parent's work tree, as
    its caller knows it, never found from the folder) or files on this host; each result
    is rewritten to say where. True when the session changed (save it)."""
    todo: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for message in reversed(session.messages):
        if message.get("role") == "assistant":
            break
        body = tool_body(message)
        if body is not None and "delta" in body:
            todo.append((message, body))
    # Each delivery is a few git processes: a wide fan-in runs them side by side.
    with ThreadPoolExecutor(max_workers=min(8, len(todo) or 1)) as pool:
        list(pool.map(lambda item: deliver(seeds, item[1], workspace, swarm_id, tree_of),
                      todo))
    for message, body in todo:
        message["content"] = json.dumps(body, ensure_ascii=False, indent=1)
    return bool(todo)

def deliver(seeds: Seeds, body: dict[str, Any], workspace: Path, swarm_id: str,
            tree_of: g.WorkTree | None = None) -> None:
    """One child's result: its ``delta`` made a branch of ``tree_of``'s repository or
    files here; ``body`` says where (or why it could not be)."""
    delta, seed = str(body.pop("delta")), str(body.pop("seed", "") or "")
    seed = "" if seed == EMPTY else seed
    agent = str(body.get("agent_id", ""))
    on_branch = bool(body.pop("home_branch", False))
    branch = f"swarm/{agent}"
    top = tree_of.top if tree_of is not None else None
    here = body.pop("host", "") == seeds.host and Path(str(body.get("workspace", ""))).is_dir()
    try:
        if (top is None or not seed) and here:
            # The child's folder is on this host: its files are there, nothing moves.
            body["files_at"] = str(body["workspace"])
            return
        if tree_of is not None and seed:
            repo = tree_of.repo
            if on_branch and g.ok("rev-parse", "--verify", "-q", f"refs/heads/{branch}",
                                  repo=repo):
                body["merge"] = _MERGE.format(branch=branch)
                return  # committed there by the child itself (same host)
            seeds.fetch(delta, repo)
            local = seed
            with contextlib.suppress(WorkspaceError):
                local = g.git("rev-parse", "--verify", "-q", f"refs/swarm/local/{seed}",
                              repo=repo)
            tree = g.git("rev-parse", f"{delta}^{{tree}}", repo=repo)
            head = g.commit(repo, tree, [local], f"swarm {agent}: {body.get('answer', '')}"
                            [:200].strip() or f"swarm {agent}", deterministic=False)
            g.git("update-ref", f"refs/heads/{branch}", head, repo=repo)
            body["git_branch"] = branch
            body["diffstat"] = g.diffstat(repo, local, head)
            body["merge"] = _MERGE.format(branch=branch)
            return
        repo = seeds.cache
        seeds.fetch(delta, repo)
        if seed:
            files, deleted = g.changes(repo, seed, delta)
        else:
            files = g.git("ls-tree", "-r", "-z", "--name-only", delta,
                          repo=repo).split("\0")
            files, deleted = [f for f in files if f], []
        dest = seeds.home / "returned" / swarm_id / agent
        if dest.exists():
            shutil.rmtree(dest)
        g.checkout_files(repo, delta, dest, files)
        body.pop("git_branch", None)
        body["files_at"] = str(dest)
        if deleted:
            body["deleted"] = deleted[:200]
    except WorkspaceError as exc:
        body["home_error"] = f"its work could not be brought home: {exc}"


_MERGE = ("its work is branch {branch} of your repository: commit your own changes first, "
      "then `git merge {branch}`")
