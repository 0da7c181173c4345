"""Redis cost: commands and bytes per child and per turn, memory per 1,000 children, TTLs.

A fresh cluster (2 workers); a warm-up; the idle rate of commands and bytes (heartbeats,
blocking polls) over a few seconds; then two jobs of N children at a small latency, one
with T=1 command turn per child and one with T=3 (+ 1 answer each). From INFO stats and
INFO commandstats deltas, minus the idle rate over the job's duration:

- per child per model turn (the T=3 job: N x 4 turns);
- per extra command turn ((T=3 job - T=1 job) / (N x 2)) and the fixed cost of a child
  (spawn, claim, set-up, answer, settle, fan-in: the T=1 job per child minus one turn).

Then every key is sized (MEMORY USAGE) and its TTL read, by kind of key; the keys of the
T=3 job's children (session, ledger agent and run, Celery result) give the memory per
1,000 finished children.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections import defaultdict
from typing import Any

from bench.common import (
    Cluster,
    JobScript,
    WorkerSpec,
    log,
    model_server,
    new_tag,
    run_root,
)
from bench.common import redis_info as info
from swarm.broker.app import app as celery_app
from swarm.store import keys
from swarm.store.connection import connect
from swarm.store.ledger import Ledger

IDLE_SECONDS = 3.0
LATENCY = 0.05

#: (kind, pattern) in order: the first match names a key.
KINDS = [
    ("session", r"^swarm:session:"),
    ("sessions index", r"^swarm:sessions$"),
    ("ledger agent", r"^swarm:agent:"),
    ("ledger run", r"^swarm:run:"),
    ("ledger request", r"^swarm:request:"),
    ("swarm record", r"^swarm:swarm:[^:]+$"),
    ("swarm sets/counters", r"^swarm:swarm:[^:]+:"),
    ("swarms index", r"^swarm:swarms$"),
    ("events stream", r"^swarm:events:"),
    ("spawn/settle streams", r"^swarm:stream:"),
    ("leases", r"^swarm:leases$"),
    ("wake list", r"^swarm:wake:"),
    ("lock", r"^swarm:lock:"),
    ("heartbeat", r"^swarm:alive:"),
    ("other swarm:*", r"^swarm:"),
    ("celery result", r"^celery-task-meta-"),
    ("celery/kombu", r"^(_kombu|unacked|swarm$)"),
    ("other", r""),
]

CONFIGURED = {
    "session": f"SESSION_TTL {keys.SESSION_TTL} s (SWARM_SESSION_TTL), refreshed by a save "
               "(at most once a minute per process)",
    "ledger agent": f"LEDGER_TTL {keys.LEDGER_TTL} s, set at creation",
    "ledger run": f"LEDGER_TTL {keys.LEDGER_TTL} s, set at creation",
    "ledger request": f"LEDGER_TTL {keys.LEDGER_TTL} s, set at creation",
    "swarm record": f"LEDGER_TTL {keys.LEDGER_TTL} s, set at creation",
    "lock": f"LOCK_TTL {keys.LOCK_TTL} s, renewed by its holder",
    "heartbeat": f"HEARTBEAT_TTL {keys.HEARTBEAT_TTL} s",
    "events stream": f"capped at EVENTS_MAXLEN {keys.EVENTS_MAXLEN} entries",
    "celery result": f"Celery result_expires {celery_app.conf.result_expires} s",
    "spawn/settle streams": (f"capped at STREAM_MAXLEN {keys.STREAM_MAXLEN} entries"
                             if hasattr(keys, "STREAM_MAXLEN") else "none"),
}


def kind_of(key: str) -> str:
    return next(k for k, pattern in KINDS if re.search(pattern, key))


def job_cost(cluster: Cluster, model: Any, client: Any, n: int, turns: int,
             idle: dict[str, float]) -> dict[str, Any]:
    script = JobScript(new_tag(), n, turns)
    model.latency = LATENCY
    before = info(client)
    run = run_root(cluster, model, script, max_parallel=max(64, n))
    after = info(client)
    d = run.wall
    cmds = after["commands"] - before["commands"] - idle["commands"] * d
    net_in = after["net_in"] - before["net_in"] - idle["net_in"] * d
    net_out = after["net_out"] - before["net_out"] - idle["net_out"] * d
    by_cmd = {k: v - before["commandstats"].get(k, 0) for k, v in after["commandstats"].items()}
    by_cmd = {k: v for k, v in by_cmd.items() if v > 0}
    return {"n": n, "turns": turns, "model_turns_per_child": turns + 1, "wall": d,
            "commands": cmds, "bytes_in": net_in, "bytes_out": net_out,
            "commandstats": dict(sorted(by_cmd.items(), key=lambda kv: -kv[1])),
            "memory_delta": after["used_memory"] - before["used_memory"],
            "swarm": Ledger(client).latest_swarm()}


def key_census(client: Any) -> dict[str, dict[str, Any]]:
    names = list(client.scan_iter(count=1000))
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"keys": 0, "bytes": 0,
                                                          "ttl_min": math.inf, "ttl_max": -2})
    for i in range(0, len(names), 500):
        batch = names[i:i + 500]
        with client.pipeline(transaction=False) as pipe:
            for name in batch:
                pipe.memory_usage(name, samples=0)
                pipe.ttl(name)
            got = pipe.execute()
        for j, name in enumerate(batch):
            size, ttl = got[2 * j] or 0, got[2 * j + 1]
            row = out[kind_of(name)]
            row["keys"] += 1
            row["bytes"] += int(size)
            row["ttl_min"] = min(row["ttl_min"], ttl)
            row["ttl_max"] = max(row["ttl_max"], ttl)
    return dict(out)


def children_bytes(client: Any, swarm_id: str) -> dict[str, float]:
    """Memory of the keys of one swarm's children, by kind."""
    agents = [a for a in Ledger(client).agents(swarm_id) if a.kind == "child"]
    names = {"session": [keys.session(a.id) for a in agents],
             "ledger agent": [keys.agent(a.id) for a in agents],
             "ledger run": [keys.run(a.run) for a in agents if a.run],
             "celery result": [f"celery-task-meta-{a.run}" for a in agents if a.run]}
    out: dict[str, float] = {"children": len(agents)}
    for kind, ks in names.items():
        with client.pipeline(transaction=False) as pipe:
            for k in ks:
                pipe.memory_usage(k, samples=0)
            out[kind] = sum(int(x or 0) for x in pipe.execute())
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.redis_n
    began = time.perf_counter()
    per_worker = math.ceil((n + 16) / 2)
    with model_server(LATENCY) as model, Cluster([WorkerSpec(per_worker)] * 2) as cluster:
        client = connect(cluster.url)
        run_root(cluster, model, JobScript(new_tag(), 4, 1), max_parallel=64)
        time.sleep(1.0)
        a = info(client)
        time.sleep(IDLE_SECONDS)
        b = info(client)
        idle = {k: (b[k] - a[k]) / IDLE_SECONDS for k in ("commands", "net_in", "net_out")}
        one = job_cost(cluster, model, client, n, 1, idle)
        log(f"redis: N={n} T=1: {one['commands'] / n:.0f} commands per child")
        three = job_cost(cluster, model, client, n, 3, idle)
        log(f"redis: N={n} T=3: {three['commands'] / n:.0f} commands per child")
        streams = {name: client.xlen(name) for name in (keys.spawn_stream(), keys.settle_stream())}
        census = key_census(client)
        child_mem = children_bytes(client, three["swarm"])
        traced = None
        if args.redis_trace:
            from bench.redis_trace import trace

            traced = trace(cluster, model, args.redis_trace, args.turns, args.latency,
                           max(64, args.redis_trace))
            log(f"redis: traced N={args.redis_trace}: {traced['per_child']:.0f} commands per "
                "child under MONITOR")
        server = client.info("memory")
        client.close()
    extra_turns = n * (three["turns"] - one["turns"])
    marginal = {k: (three[k] - one[k]) / extra_turns for k in ("commands", "bytes_in",
                                                               "bytes_out")}
    fixed = {k: one[k] / n - marginal[k] for k in marginal}
    per_turn = {k: three[k] / (n * three["model_turns_per_child"]) for k in marginal}
    children = child_mem.pop("children") or 1
    per_1000 = {k: v * 1000 / children for k, v in child_mem.items()}
    return {"benchmark": "redis",
            "config": {"n": n, "latency": LATENCY, "idle_seconds": IDLE_SECONDS,
                       "workers": 2, "threads_per_worker": per_worker},
            "idle_rate_per_s": idle, "jobs": [one, three],
            "per_child_per_model_turn_T3": per_turn,
            "per_extra_command_turn": marginal, "fixed_per_child": fixed,
            "children_memory_bytes_per_1000": per_1000,
            "children_memory_mib_per_1000": sum(per_1000.values()) / 2**20,
            "used_memory_delta_per_1000_children_mib": three["memory_delta"] * 1000 / n / 2**20,
            "streams_xlen": streams,
            "census": {k: {**v, "ttl_min": None if v["ttl_min"] == math.inf else v["ttl_min"],
                           "configured": CONFIGURED.get(k, "none")}
                       for k, v in census.items()},
            "server_used_memory_mib": int(server["used_memory"]) / 2**20,
            "trace": traced,
            "run_seconds": time.perf_counter() - began}


def ttl_text(v: dict[str, Any]) -> str:
    lo, hi = v["ttl_min"], v["ttl_max"]
    if hi == -1 and lo == -1:
        return "none"
    if lo == -1:
        return f"some none, <= {hi} s"
    return f"{lo}-{hi} s" if lo != hi else f"{lo} s"


def report(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    one, three = out["jobs"]
    t, m, f = out["per_child_per_model_turn_T3"], out["per_extra_command_turn"], \
        out["fixed_per_child"]
    idle = out["idle_rate_per_s"]
    lines = [f"6. Redis cost: N={cfg['n']} children, 2 workers, latency {cfg['latency']:g} s; "
             f"idle background subtracted ({idle['commands']:.0f} commands/s)",
             "                                  | commands | bytes in | bytes out",
             f"  per child, T=1 (2 model turns)  | {one['commands'] / cfg['n']:>8.0f} | "
             f"{one['bytes_in'] / cfg['n']:>8.0f} | {one['bytes_out'] / cfg['n']:>9.0f}",
             f"  per child, T=3 (4 model turns)  | {three['commands'] / cfg['n']:>8.0f} | "
             f"{three['bytes_in'] / cfg['n']:>8.0f} | {three['bytes_out'] / cfg['n']:>9.0f}",
             f"  per child per model turn (T=3)  | {t['commands']:>8.1f} | "
             f"{t['bytes_in']:>8.0f} | {t['bytes_out']:>9.0f}",
             f"  per extra command turn          | {m['commands']:>8.1f} | "
             f"{m['bytes_in']:>8.0f} | {m['bytes_out']:>9.0f}",
             f"  fixed per child (spawn..fan-in) | {f['commands']:>8.1f} | "
             f"{f['bytes_in']:>8.0f} | {f['bytes_out']:>9.0f}",
             "  top commands per child (T=3): " + ", ".join(
                 f"{k} {v / cfg['n']:.1f}" for k, v in list(three["commandstats"].items())[:10])]
    per = out["children_memory_bytes_per_1000"]
    lines.append(f"  memory per 1,000 finished children (T=3): "
                 f"{out['children_memory_mib_per_1000']:.1f} MiB = " + ", ".join(
                     f"{k} {v / 2**20:.1f}" for k, v in per.items())
                 + f" MiB (used_memory grew {out['used_memory_delta_per_1000_children_mib']:.1f}"
                 " MiB per 1,000)")
    lines.append("  what expires when (all keys after both jobs):")
    lines.append("    kind                 |  keys |     KiB | TTL now          | configured")
    for kind, v in sorted(out["census"].items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"    {kind:<20} | {v['keys']:>5} | {v['bytes'] / 1024:>7.0f} | "
                     f"{ttl_text(v):<16} | {v['configured']}")
    lines.append(f"  spawn/settle streams: {out['streams_xlen']} entries after "
                 f"{2 * cfg['n'] + 5} children; TTL 'none' = kept until deleted")
    if out.get("trace"):
        from bench.redis_trace import report as trace_report

        lines.extend(trace_report(out["trace"]))
    return lines
