"""The PNG: wall time against the number of children (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import results_dir


def plot(results: dict[str, Any], smoke: bool = False) -> Path | None:
    """Draw what ``results`` holds; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    scaling = results.get("scaling")
    if scaling and scaling["jobs"]:
        cfg = scaling["config"]
        ns = [j["n"] for j in scaling["jobs"]]
        ax.plot(ns, [j["wall"] for j in scaling["jobs"]], "o-", color="tab:blue",
                label=f"swarm, warm cluster ({cfg['workers']} workers x {cfg['concurrency']} "
                      f"threads), T={cfg['turns']}, {cfg['latency']:g} s/answer")
        ax.plot(ns, [j["ideal"] for j in scaling["jobs"]], "--", color="tab:gray",
                label="ideal (model latency only)")
        for j in scaling["jobs"]:
            ax.annotate(f"{j['wall']:.1f} s", (j["n"], j["wall"]), textcoords="offset points",
                        xytext=(4, 6), fontsize=8, color="tab:blue")
    across = results.get("workers")
    if across:
        for row in across["rows"]:
            label = "2 hosts" if row["config"] == "hosts" else f"{row['workers']} worker(s)"
            ax.plot([row["n"]], [row["wall"]], "x", markersize=8,
                    label=f"swarm, {label}, N={row['n']}")
    procs = results.get("processes")
    if procs:
        for label, way in procs["ways"].items():
            marker = {"one": "s", "process": "s", "swarm": "D", "sequential": "^"}[
                label.split()[0]]
            ax.plot([way["children"]], [way["wall"]], marker, markersize=7,
                    label=f"{label}: {way['wall']:.1f} s, {way['summed_peak_rss_mib']:.0f} MiB")
    spawn = results.get("spawn")
    if spawn:
        sizes = spawn["config"]["sizes"]
        ax.plot(sizes, [spawn["sizes"][str(n)]["wall"]["median"] for n in sizes], ".:",
                color="tab:green", label=f"spawn bench (1 turn, {spawn['config']['latency']:g} "
                                         "s/answer), median")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("children (N)")
    ax.set_ylabel("wall time of the job (s)")
    ax.set_title("swarm: wall time against number of children" + (" (smoke)" if smoke else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = results_dir() / ("scaling-smoke.png" if smoke else "scaling.png")
    fig.savefig(path)
    plt.close(fig)
    return path
