"""Benchmarks for swarm (timing lives here, not in test assertions; DESIGN.md section 7).

- ``python -m bench.spawn``: spawn overhead, fan-in, wall time of N parallel children,
  and the floor of a bare Celery round trip. Results go to ``bench/results/``.
"""
