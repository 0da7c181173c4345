"""The ``swarm`` command line."""

from swarm.cli.main import main

__all__ = ["main"]
