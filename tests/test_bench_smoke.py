"""The benchmarks keep working: ``python -m bench --smoke`` (a tiny size of each part).

It starts several clusters, `swarm run` processes and Valkey servers and takes about a
minute, so it runs only when ``SWARM_BENCH_SMOKE=1``. No timing is asserted (timing is
the benchmarks' job, see bench/README.md): only that every part ran, wrote its JSON and
printed its table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("spawn", "scaling", "processes", "memory", "workers", "redis", "cold", "seed", "reseed",
         "land", "page", "join")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("SWARM_BENCH_SMOKE") != "1",
                       reason="benchmark smoke run: set SWARM_BENCH_SMOKE=1 to run it "
                              "(about a minute; keeps CI time down)"),
]


@pytest.mark.timeout(600)
def test_bench_smoke_runs_every_part(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    done = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--results", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for part in PARTS:
        data = json.loads((tmp_path / f"{part}-smoke.json").read_text())
        assert data["smoke"] is True
    scaling = json.loads((tmp_path / "scaling-smoke.json").read_text())
    assert [j["n"] for j in scaling["jobs"]] == [1, 4]
    assert all(j["wall"] > 0 for j in scaling["jobs"])
    # smoke: N=1 twice (the median job of the two reported), N=4 above --repeat-max, once
    assert [len(j["walls"]) for j in scaling["jobs"]] == [2, 1]
    cold = json.loads((tmp_path / "cold-smoke.json").read_text())
    assert set(cold["rows"]) == {"cold_1", "cold_3", "warm_1"}
    assert all(r["wall"] > 0 for r in cold["rows"].values())
    processes = json.loads((tmp_path / "processes-smoke.json").read_text())
    assert len(processes["ways"]) == 4
    memory = json.loads((tmp_path / "memory-smoke.json").read_text())
    assert [r["alive_at_once"] for r in memory["rows"]] == [5]  # else the part fails
    scaled = scaling["jobs"][-1]
    assert {"root", "workers", "Redis", "model"} <= set(scaled["cpu_ms_per_child"])
    redis = json.loads((tmp_path / "redis-smoke.json").read_text())
    assert redis["trace"]["per_child"] > 0 and redis["trace"]["by_label"]
    for heading in ("1. spawn", "2. scaling", "3. the same job", "4. memory",
                    "5. across workers", "6. Redis cost", "7. cold start"):
        assert heading in done.stdout, done.stdout[-3000:]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot: skipped" in done.stdout
    else:
        assert (tmp_path / "scaling-smoke.png").stat().st_size > 0


def test_bench_help_lists_the_options() -> None:
    done = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0
    for option in ("--smoke", "--only", "--latency", "--sizes", "--model-processes",
                   "--redis-trace"):
        assert option in done.stdout
