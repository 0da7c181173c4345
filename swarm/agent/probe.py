"""A compact description of the host and the workspace for the system prompt.

Tool versions are probed once per process (and PATH) and cached: a worker running
many agents in threads must not re-run a dozen ``--version`` commands per child.
The date and the workspace listing are read fresh every time.
"""

from __future__ import annotations

import getpass
import os
import platform
import shutil
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from swarm.agent.shell import child_env

TOOLS: dict[str, tuple[str, ...]] = {
    "bash": ("--version",),
    "python3": ("--version",),
    "git": ("--version",),
    "node": ("--version",),
    "npm": ("--version",),
    "docker": ("--version",),
    "gcc": ("--version",),
    "make": ("--version",),
    "cargo": ("--version",),
    "go": ("version",),
    "java": ("-version",),
    "psql": ("--version",),
    "redis-cli": ("--version",),
    "curl": ("--version",),
    "jq": ("--version",),
    "rg": ("--version",),
    "uv": ("--version",),
}
"""Tools whose version goes into the prompt, with the arguments that print it."""

VERSION_TIMEOUT = 2.0
LISTING_MAX_ENTRIES = 100
LISTING_MAX_CHARS = 2_000
_LINE_MAX = 120

_cache: dict[str, dict[str, str]] = {}
_cache_lock = threading.Lock()
probe_runs = 0
"""How many times the tool versions were actually probed (the rest came from the cache)."""


def _version(path: str, args: tuple[str, ...]) -> str:
    """The first non-empty output line of ``path args``, or "" when it fails or hangs."""
    try:
        done = subprocess.run(
            [path, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=VERSION_TIMEOUT,
            env=child_env(),
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    text = done.stdout.decode("utf-8", errors="replace")
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line[:_LINE_MAX]


def tool_versions() -> dict[str, str]:
    """``{tool: first line of its version output}`` for the tools found on PATH; cached."""
    global probe_runs
    key = os.environ.get("PATH", "")
    with _cache_lock:  # held while probing so concurrent first callers probe only once
        cached = _cache.get(key)
        if cached is not None:
            return cached
        found = {name: p for name in TOOLS if (p := shutil.which(name, path=key))}
        with ThreadPoolExecutor(max_workers=max(len(found), 1)) as pool:
            futures = {name: pool.submit(_version, p, TOOLS[name]) for name, p in found.items()}
        versions = {name: f.result() or "(version unknown)" for name, f in futures.items()}
        probe_runs += 1
        _cache[key] = versions
        return versions


def clear_cache() -> None:
    """Forget the cached tool versions (for tests, or after installing tools)."""
    with _cache_lock:
        _cache.clear()


def _os_line() -> str:
    distro = ""
    try:
        for line in Path("/etc/os-release").read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key == "PRETTY_NAME":
                distro = value.strip().strip('"')
                break
    except OSError:
        pass
    base = f"{platform.system()} {platform.release()} {platform.machine()}".strip()
    return f"{base} ({distro})" if distro else base


def _user() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid()) if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


def workspace_listing(workspace: Path) -> str:
    """Top-level entries of ``workspace``, sorted, directories ending in ``/``, capped."""
    try:
        with os.scandir(workspace) as it:
            entries = sorted(
                (e.name + "/" if _is_dir(e) else e.name) for e in it
            )
    except FileNotFoundError:
        return "(the workspace does not exist yet)"
    except OSError as exc:
        return f"(cannot list the workspace: {exc.strerror or exc})"
    if not entries:
        return "(empty)"
    shown: list[str] = []
    size = 0
    for name in entries[:LISTING_MAX_ENTRIES]:
        if size + len(name) + 1 > LISTING_MAX_CHARS:
            break
        shown.append(name)
        size += len(name) + 1
    text = "\n".join(shown)
    left = len(entries) - len(shown)
    if left:
        text += f"\n[... {left} more entries not shown; use ls]"
    return text


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def probe_environment(workspace: Path) -> str:
    """The environment block of the system prompt: date, OS, shell, user, tools, workspace."""
    versions = tool_versions()
    now = datetime.now().astimezone()
    lines = [
        f"date: {now:%A %Y-%m-%d %H:%M:%S} {now.tzname()} (UTC{now:%z})",
        f"os: {_os_line()}",
        f"shell: {versions.get('bash') or 'bash (not found on PATH)'}",
        f"user: {_user()}",
        f"workspace: {Path(workspace).absolute()}",
    ]
    tools = [f"  {name}: {v}" for name, v in versions.items() if name != "bash"]
    if tools:
        lines.append("tools:")
        lines.extend(tools)
    lines.append("workspace contents (top level):")
    lines.append(workspace_listing(workspace))
    return "\n".join(lines)
