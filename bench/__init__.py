"""Benchmarks for swarm: timing is measured here, never asserted in a test (shared CI cores).

- ``python -m bench``: the whole set (spawn, scaling, processes, memory, workers, redis);
  ``--smoke`` for a tiny run, ``--only NAME`` for one part, ``--help`` for the sizes.
- ``python -m bench.spawn``: spawn overhead, fan-in and the Celery floor on their own.

Results go to ``bench/results/`` (JSON, and a PNG when matplotlib is installed:
``pip install -e '.[bench]'``). See bench/README.md.
"""
