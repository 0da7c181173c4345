"""Seeing a swarm: snapshots of the ledger as a tree (``snapshot``), how numbers and costs
are shown (``display``) and the HTML report (``html``). The terminal views live in
:mod:`swarm.cli.live` and :mod:`swarm.cli.status`."""
