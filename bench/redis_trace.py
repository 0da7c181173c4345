"""Where a child's Redis commands go: one small job under MONITOR, commands by kind.

``python -m bench --only redis --redis-trace 10`` runs, after the counted jobs, one job of
10 children (T command turns, at ``--latency``) with a MONITOR client attached, and
groups every command the server executed (those run inside Lua scripts included, as
INFO commandstats counts them) by command and kind of key: ``EVALSHA`` by the script's
name (the constant of ``swarm.store`` whose SHA1 it is), a command inside a script as
``lua CMD kind``. MONITOR slows the server, so the counted figures come from the jobs
without it; this one only says where they go.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from typing import Any

from bench.common import Cluster, JobScript, new_tag, run_root
from swarm.store.connection import connect

STOP = "bench-stop-trace"


def script_names() -> dict[str, str]:
    """SHA1 -> ``module.CONSTANT`` of every Lua script text in swarm.store."""
    import importlib

    out: dict[str, str] = {}
    for name in ("ledger", "locks", "gate", "approvals", "mailbox", "snapshots", "sessions",
                 "hints"):
        module = importlib.import_module(f"swarm.store.{name}")
        for const, value in vars(module).items():
            if isinstance(value, str) and ("redis.call" in value or "redis.pcall" in value):
                out[hashlib.sha1(value.encode()).hexdigest()] = f"{name}.{const}"
    return out


def shape(key: str) -> str:
    """A key with its ids replaced by ``*``: ``swarm:cancel:*``, ``swarm:lock:session:*``."""
    if not key.startswith("swarm:"):
        return "celery-task-meta-*" if key.startswith("celery-task-meta-") else key[:40]
    return ":".join("*" if (any(c.isdigit() for c in part) and len(part) >= 6) or len(part) > 24
                    else part for part in key.split(":"))


def label(words: list[str], client_type: str, scripts: dict[str, str]) -> str:
    cmd = words[0].lower() if words else "?"
    if cmd in ("evalsha", "eval"):
        sha = words[1] if len(words) > 1 else ""
        name = scripts.get(sha if cmd == "evalsha" else hashlib.sha1(sha.encode()).hexdigest(),
                           sha[:8])
        return f"{cmd} {name}"
    if cmd in ("multi", "exec", "ping", "info", "client", "select", "hello", "script"):
        return cmd
    key = words[1] if len(words) > 1 else ""
    if cmd in ("xreadgroup", "xread"):
        key = words[words.index("STREAMS") + 1] if "STREAMS" in words[:-1] else ""
    prefix = "lua " if client_type == "lua" else ""
    return f"{prefix}{cmd} {shape(key)}"


def trace(cluster: Cluster, model: Any, n: int, turns: int, latency: float,
          max_parallel: int) -> dict[str, Any]:
    """One job of ``n`` children under MONITOR: commands per child by label."""
    scripts = script_names()
    seen: Counter[str] = Counter()
    monitor_client = connect(cluster.url)
    ready, stop = threading.Event(), threading.Event()

    def listen() -> None:
        with monitor_client.monitor() as m:
            ready.set()
            while not stop.is_set():
                try:
                    got = m.next_command()
                except Exception:  # the connection closed under us at the end
                    return
                if got is None:
                    continue
                words = got["command"].split()
                if words[:2] == ["echo", STOP] or words[:2] == ["ECHO", STOP]:
                    return
                seen[label(words, got["client_type"], scripts)] += 1

    thread = threading.Thread(target=listen, name="redis-monitor", daemon=True)
    thread.start()
    ready.wait(10)
    script = JobScript(new_tag(), n, turns)
    model.latency = latency
    run = run_root(cluster, model, script, max_parallel=max_parallel)
    stop.set()
    client = connect(cluster.url)
    try:
        client.echo(STOP)
    finally:
        client.close()
    thread.join(timeout=10)
    monitor_client.close()
    total = sum(seen.values())
    return {"n": n, "turns": turns, "latency": latency, "wall": run.wall,
            "commands": total, "per_child": total / n,
            "by_label": {k: v / n for k, v in seen.most_common()}}


def report(out: dict[str, Any], top: int = 40) -> list[str]:
    lines = [f"  MONITOR of one job, N={out['n']} x T={out['turns']} at {out['latency']:g} s: "
             f"{out['per_child']:.1f} commands a child (idle background included), by "
             "command and kind of key (lua: inside a script):"]
    items = list(out["by_label"].items())
    for k, v in items[:top]:
        lines.append(f"    {v:>6.2f}  {k}")
    if len(items) > top:
        lines.append(f"    {sum(v for _, v in items[top:]):>6.2f}  ({len(items) - top} more)")
    return lines
