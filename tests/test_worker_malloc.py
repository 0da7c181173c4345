"""A worker runs with glibc's allocator set for a thread a live child (swarm.runtime.malloc)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis as redis_lib

from swarm.runtime.local import alive
from swarm.runtime.malloc import WORKER_MALLOC, glibc
from tests.helpers import wait_until

SECRET = "sk-malloc-test-secret"


@pytest.mark.slow
@pytest.mark.skipif(not glibc() or not Path("/proc/self/environ").exists(),
                    reason="glibc's settings, read from /proc")
@pytest.mark.parametrize(("given", "runs_with"), [(None, WORKER_MALLOC), ("", "")])
def test_a_worker_starts_with_its_allocator_settings_and_keeps_its_secrets_hidden(
        given: str | None, runs_with: str, redis_server: str, redis: redis_lib.Redis,
        tmp_path: Path) -> None:
    """Started as an operator starts it (the settings not given), it starts itself again
    with them; an operator's own GLIBC_TUNABLES, even empty, is kept. Either way the API
    key stays out of its /proc environ."""
    name = f"malloc-{os.getpid()}-{given!r}@test"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWARM_", "OPENAI_", "GLIBC_TUNABLES"))}
    env.update(SWARM_REDIS_URL=redis_server, SWARM_HOME=str(tmp_path / "home"),
               SWARM_API_KEY=SECRET, SWARM_SANDBOX="none")
    if given is not None:
        env["GLIBC_TUNABLES"] = given
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm", "worker", "-c", "1", "-Q", "malloc", "-n", name],
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            return name in alive(redis, "worker")

        wait_until(ready, "the worker's heartbeat")
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # glibc, as it reads the settings, cuts the variable at each ':' in /proc
    assert f"GLIBC_TUNABLES={runs_with.split(':')[0]}".encode() in environ
    assert not any(SECRET.encode() in var for var in environ)
