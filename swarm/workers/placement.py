"""Where a child works on this host: its workspace found where it was made, restored from
its snapshot, or made from its parent's (:class:`~swarm.workspace.seed.Seeds`); a
continued child's brought up to its parent's; and what its run changed there."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import redis

from swarm import faults
from swarm.agent import grants
from swarm.errors import PathRefused, WorkspaceElsewhere, WorkspaceError, WorkspaceLost
from swarm.store import keys
from swarm.store.ledger import AgentRecord, Ledger, RunRecord
from swarm.workspace import homecoming, parked
from swarm.workspace.listing import LISTING_LIMIT, Listing, changed_files, listing
from swarm.workspace.seed import Planned, Seeds, Workspace


class Placement:
    """The workspaces of the children a worker runs on ``host``."""

    def __init__(self, redis_: redis.Redis, ledger: Ledger, host: str) -> None:
        self.redis = redis_
        self.ledger = ledger
        self.host = host

    def workspace(self, record: AgentRecord, swarm_id: str, seeds: Seeds) -> Workspace:
        """The agent's workspace on this host: found where it was made, restored from the
        snapshot taken as it parked or settled elsewhere, or made from its parent's
        snapshot. :class:`WorkspaceLost` when it must be restored and cannot be."""
        if record.workspace:
            path = Path(record.workspace)
            here = record.ws_host in ("", self.host)
            root = self.jobs_root(swarm_id) if record.kind == "job" and here else None
            if root is not None:
                open_job_workspace(path, root, create=not record.ws_state)
            if here and path.is_dir():
                return seeds.found(path, swarm_id, record.id, record.seed)
            if record.kind == "job" and not record.ws_state and not path.exists():
                # A job's folder is named by its submitter, on the worker's own disk.
                path.mkdir(parents=True)
                return seeds.found(path, swarm_id, record.id, record.seed)
            if not record.ws_state and not here and \
                    self.redis.exists(keys.worker_host(record.ws_host)):
                raise WorkspaceElsewhere(f"the workspace of {record.id} is on {record.ws_host}, "
                                         "where a worker runs: handed back for it")
            if not record.ws_state:
                where = f"on {record.ws_host}" if not here else f"at {path}"
                raise WorkspaceLost(f"the workspace of {record.id} was {where} and no "
                                    "snapshot of it was taken")
            workspace = parked.restore(seeds, swarm_id, record.id, record.seed,
                                       record.ws_state)
            self.ledger.place(record.id, str(workspace.path), self.host)
            return workspace
        return self.made(record, seeds, seeds.plan(swarm_id, record.id, record.seed))

    def made(self, record: AgentRecord, seeds: Seeds, planned: Planned) -> Workspace:
        """A new child's workspace, made from its parent's snapshot and placed here."""
        faults.point("worker-seeding")
        workspace = seeds.make(planned)
        self.ledger.place(record.id, str(workspace.path), self.host)
        return workspace

    def rebase(self, workspace: Workspace, seeds: Seeds, run: RunRecord,
               record: AgentRecord) -> tuple[Workspace, RunRecord]:
        """A continued child's workspace brought up to its parent's as the parent called it
        again (``run.rebase``), its own earlier changes re-applied where they still fit;
        the run's message says where they did not."""
        workspace, kept = homecoming.rebase(seeds, workspace, run.rebase, record.swarm,
                                            record.id)
        self.ledger.reseed(record.id, run.rebase)
        note = ("[Your workspace now holds your parent's files as they are now; your earlier "
                "changes were applied over them"
                + (f", except in {', '.join(kept[:20])}, where your parent's version is kept"
                   if kept else "") + ".]\n\n")
        return workspace, dataclasses.replace(run, message=note + run.message)

    def jobs_root(self, swarm_id: str) -> Path | None:
        """The folder a job's workspace was checked to lie in when it was submitted
        (``SWARM_SERVE_ROOT``); None for a job that records none (a schedule's folder,
        ``swarm mcp --workspace``, a job from before jobs recorded it)."""
        raw = self.ledger.jobs_root(swarm_id)
        return Path(raw) if raw else None


def open_job_workspace(path: Path, root: Path, create: bool) -> None:
    """Open the job's workspace as it is now, from its jobs root down following no
    symbolic link (made there when missing, with ``create``): :class:`PathRefused` when
    it is not the folder the API checked (swapped for a link since, say)."""
    if create:
        root.mkdir(parents=True, exist_ok=True)  # the operator's (a worker's own disk)
    try:
        os.close(grants.open_beneath(path, root, create=create))
    except PathRefused as exc:
        raise PathRefused(f"{path} is refused: {exc}; it was a folder inside the jobs "
                          "root (SWARM_SERVE_ROOT) when the job was submitted, so nothing "
                          "runs in it") from None
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not create:
            return  # gone: restored from its snapshot, or lost (see Placement.workspace)
        raise WorkspaceError(f"{path} cannot be opened: {exc.strerror or exc}") from None


def run_listing(workspace: Workspace, run: RunRecord) -> Listing:
    """The workspace as it was when this run began (kept on disk across resumes)."""
    # Named before "listing" was: a run parked across an upgrade still finds its own.
    path = workspace.top.parent / f".{run.agent}.{run.id}.snapshot.json"
    try:
        return {k: (v[0], v[1]) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        found = listing(workspace.path)
        path.write_text(json.dumps(found))
        return found


def changed(workspace: Workspace, seeds: Seeds, before: Listing | None,
            record: AgentRecord) -> tuple[list[str], bool]:
    """The files the agent changed, and whether that list is exact about the
    workspace against its seed (nothing in it: nothing to send home). A view's upper
    folder is; a listing is when it was taken at the seed (the agent never parked or
    settled with changes, whose listing may be on another host) and was complete."""
    if before is None:
        found = seeds.changed(workspace, LISTING_LIMIT)
        return (found, True) if found is not None else ([], False)
    after = listing(workspace.path)
    complete = max(len(before), len(after)) < LISTING_LIMIT
    return changed_files(before, after), complete and not record.ws_state
