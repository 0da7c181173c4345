"""A compact description of the host and the workspace for the system prompt.

Tool versions are probed once per process (and PATH) and cached: a worker running
many agents in threads must not re-run a dozen ``--version`` commands per child.
Given a cache file (``SWARM_HOME/cache/tools.json``), they are also kept on disk, keyed
by PATH and by each tool's resolved path, size and modification time, so the next
process starts without the ~0.3 s of subprocesses unless a tool changed.
The date and the workspace listing are read fresh every time.
"""

from __future__ import annotations

import contextlib
import getpass
import json
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


#: PATHs whose tool versions a cache file keeps (the most recent ones).
DISK_KEEP = 8


def _stamp(path: str) -> str:
    """What changes when the tool at ``path`` is replaced: its target, size and mtime."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return ""
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def _read_disk(cache_file: Path) -> dict[str, dict[str, dict[str, str]]]:
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_disk(cache_file: Path, key: str, stamps: dict[str, str],
                versions: dict[str, str]) -> None:
    data = _read_disk(cache_file)
    data.pop(key, None)
    data[key] = {"stamps": stamps, "versions": versions}
    for old in list(data)[:-DISK_KEEP]:
        del data[old]
    with contextlib.suppress(OSError):  # a cache: never worth failing for
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, cache_file)


def tool_versions(cache_file: Path | None = None) -> dict[str, str]:
    """``{tool: first line of its version output}`` for the tools found on PATH; cached
    in the process, and in ``cache_file`` when given (see the module's docstring)."""
    global probe_runs
    key = os.environ.get("PATH", "")
    with _cache_lock:  # held while probing so concurrent first callers probe only once
        cached = _cache.get(key)
        if cached is not None:
            return cached
        found = {name: p for name in TOOLS if (p := shutil.which(name, path=key))}
        stamps = {name: _stamp(p) for name, p in found.items()}
        kept = _read_disk(cache_file).get(key) if cache_file is not None else None
        if kept and kept.get("stamps") == stamps and isinstance(kept.get("versions"), dict):
            versions = dict(kept["versions"])
        else:
            with ThreadPoolExecutor(max_workers=max(len(found), 1)) as pool:
                futures = {name: pool.submit(_version, p, TOOLS[name])
                           for name, p in found.items()}
            versions = {name: f.result() or "(version unknown)" for name, f in futures.items()}
            probe_runs += 1
            if cache_file is not None:
                _write_disk(cache_file, key, stamps, versions)
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
            entries = [(e.name + "/" if _is_dir(e) else e.name) for e in it]
    except FileNotFoundError:
        return "(the workspace does not exist yet)"
    except OSError as exc:
        return f"(cannot list the workspace: {exc.strerror or exc})"
    return listing_text(entries)


def listing_text(entries: list[str]) -> str:
    """The listing of a workspace whose top-level entries are ``entries`` (directories
    ending in ``/``): sorted, capped."""
    entries = sorted(entries)
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


def probe_environment(workspace: Path, cache_file: Path | None = None,
                      listing: str | None = None) -> str:
    """The environment block of the system prompt: date, OS, shell, user, tools, workspace
    (``cache_file``: see :func:`tool_versions`; ``listing``: its top level, when its files
    are still arriving)."""
    versions = tool_versions(cache_file)
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
    lines.append(workspace_listing(workspace) if listing is None else listing)
    return "\n".join(lines)
