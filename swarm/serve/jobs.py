"""What the API and schedules share about jobs: the settings a job inherits, the check of
its task against the model's context, and the folders jobs work in (a fresh one under the
jobs root, or one the client names inside it: symlinks and ``..`` are resolved first, so
nothing escapes the root)."""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from swarm.agent import compaction
from swarm.config import Settings
from swarm.errors import RequestError, SwarmError, TaskTooLarge
from swarm.llm.client import LLMClient
from swarm.runtime.root import INHERITED

log = logging.getLogger(__name__)


def inherited_settings(settings: Settings) -> dict[str, Any]:
    """The settings a job's agents use from ``settings``: those given by a flag or an
    environment variable (never defaults, never secrets), as children inherit a root's."""
    return {name: getattr(settings, name) for name in INHERITED if name in settings.explicit}


def model_context(settings: Settings) -> int:
    """The context length of ``settings``' model, as its endpoint's ``/models`` tells it
    (one try, within seconds), else ``SWARM_CONTEXT_LENGTH``; that alone when no endpoint
    is set here (the workers have their own)."""
    if "base_url" not in settings.explicit:
        return settings.context_length
    quick = settings.with_(retries=1, connect_timeout=min(settings.connect_timeout, 5.0),
                           read_timeout=min(settings.read_timeout, 10.0))
    with LLMClient.from_settings(quick) as model:
        try:
            return model.context_length()
        except SwarmError as exc:
            log.warning("cannot tell the context length of the model (%s); assuming %d "
                        "tokens (SWARM_CONTEXT_LENGTH)", exc, settings.context_length)
            return settings.context_length


def check_job_task(task: str, context_length: int, settings: Settings) -> None:
    """Refuse a job's task too large for the model's context, with 413 (before anything is
    queued or created): the check a worker's agent makes too, before any model call."""
    try:
        compaction.check_task(task, context_length, settings.compact_at)
    except TaskTooLarge as exc:
        raise RequestError(str(exc), 413) from None


class WorkspaceError(RequestError):
    """A workspace that is not allowed (``status`` 403) or cannot be made (409)."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message, status)


def jobs_root(home: Path, override: str | None = None) -> Path:
    """Where job folders live: ``override`` (``SWARM_SERVE_ROOT``), else ``SWARM_HOME/jobs``."""
    raw = override if override is not None else os.environ.get("SWARM_SERVE_ROOT", "")
    return Path(raw).expanduser() if raw else home / "jobs"


def new_job_folder(root: Path) -> Path:
    """A fresh, empty folder under ``root`` for a job that names none."""
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def inside_root(root: Path, given: str) -> Path:
    """The folder ``given`` (absolute, or relative to ``root``) once created, if it lies
    strictly inside ``root`` after resolving symlinks and ``..``; else :class:`WorkspaceError`."""
    try:
        base = root.resolve()
        path = (base / given).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # NUL bytes, symlink loops
        raise WorkspaceError(f"workspace {given[:200]!r} is not a usable path: {exc}",
                             409) from None
    if path == base or not path.is_relative_to(base):
        raise WorkspaceError(
            f"workspace {given[:200]!r} is outside the allowed root {base} (SWARM_SERVE_ROOT); "
            "name a folder inside it, or leave workspace out for a fresh one")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WorkspaceError(f"workspace {given[:200]!r} cannot be created: "
                             f"{exc.strerror or exc}",
                             403 if isinstance(exc, PermissionError) else 409) from None
    if not path.resolve().is_relative_to(base):  # a symlink swapped in meanwhile
        raise WorkspaceError(f"workspace {given[:200]!r} is outside the allowed root {base}")
    return path
