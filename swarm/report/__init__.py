"""Seeing a swarm: a *view* of it read from the ledger, as a tree (``view``), how numbers
and costs are shown (``display``) and the HTML report (``html``). The terminal views live
in :mod:`swarm.cli.live` and :mod:`swarm.cli.status`. (A *snapshot* is something else: a
workspace's files stored as a git bundle, :mod:`swarm.store.snapshots`.)"""
