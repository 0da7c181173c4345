"""Runs one command the way a worker runs a child's: through swarm's LocalEnvironment with
SWARM_SANDBOX=bwrap, SWARM_HOME hidden, the box's network, limits and folders of the
worker's settings (SWARM_SANDBOX_* in its environment), after a first command in the same
box (a child's box lasts its turn). Started by
tests/test_sandbox_escape.py with a secret in its environment, as a worker holds the model
key; prints the result as JSON.

Usage: python sandbox_runner.py WORKSPACE SWARM_HOME TIMEOUT COMMAND ({pid} in COMMAND is
replaced by this process's pid).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from swarm.agent import sandbox
from swarm.agent.shell import LocalEnvironment
from swarm.config import Settings


def main() -> None:
    workspace, home, timeout, command = sys.argv[1:5]
    settings = Settings.from_env()
    env = LocalEnvironment(Path(workspace), sandbox="bwrap", hide=(Path(home),),
                           network=sandbox.network_of(settings),
                           limits=sandbox.limits_of(settings), show=sandbox.shown_of(settings),
                           die_with_runner=True)
    # As in a child's turn, the attempt is not its box's first command: the box lasts.
    assert env.execute("true", int(timeout)).exit_code == 0
    result = env.execute(command.replace("{pid}", str(os.getpid())), int(timeout))
    env.close()
    print(json.dumps({"output": result.output, "exit_code": result.exit_code,
                      "uid": os.getuid(), "summary": env.choice.summary}))


if __name__ == "__main__":
    main()
