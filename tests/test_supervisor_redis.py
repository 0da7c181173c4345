"""What a worker's supervisor costs Redis: the tokens its children spent written every
TOKENS_EVERY seconds (a command each write), not at every flush of their progress (a
settling child's flush writes them all); its children's leases renewed in one script."""

from __future__ import annotations

import redis as redis_py

from swarm.store import keys
from swarm.store.ledger import Ledger
from swarm.workers.supervisor import Supervisor, Watched
from tests.helpers import child_run, scripts_run, spawn_children, wait_until


def test_tokens_wait_for_their_interval_but_not_for_a_settling_childs_flush(
        redis: redis_py.Redis) -> None:
    supervisor = Supervisor(redis, 30.0, flush_every=0.01, tokens_every=3600.0)
    passes: list[int] = []
    supervisor.flush_hooks.append(lambda: passes.append(1))
    supervisor.add_tokens("s1", 5)
    watched = supervisor.watch(Watched("r1", "a1", "", limit=3600.0))
    try:
        wait_until(lambda: redis.hget(keys.swarm_counters("s1"), "tokens") == "5",
                   "the first pass's write of the tokens")
        supervisor.add_tokens("s1", 7)
        seen = len(passes)
        wait_until(lambda: len(passes) >= seen + 20, "20 more passes of the supervisor")
        assert redis.hget(keys.swarm_counters("s1"), "tokens") == "5"  # not yet: an hour
        supervisor.flush()  # a child settling
        assert redis.hget(keys.swarm_counters("s1"), "tokens") == "12"
    finally:
        supervisor.forget(watched)


def test_a_workers_children_leases_are_renewed_in_one_script(redis: redis_py.Redis) -> None:
    ledger = Ledger(redis)
    ledger.create_swarm("s1", "aparent", "/work/parent", "task", {}, "host-a", "aparent")
    spawn_children(ledger, "s1", "aparent", *(f"a{n}" for n in range(5)))
    ids = [child_run("aparent", f"a{n}") for n in range(5)]
    children = []
    for n, rid in enumerate(ids):
        run = ledger.run(rid)
        assert run is not None and ledger.start(run.id, f"tok{n}", 5.0, "host-a")
        children.append(Watched(rid, f"a{n}", f"tok{n}", limit=3600.0))
    redis.hset(keys.run(ids[4]), "lease", "another-workers")  # taken over meanwhile
    supervisor = Supervisor(redis, 30.0)
    scripts = scripts_run(redis)
    supervisor.renew(children)
    assert scripts_run(redis) == scripts + 1
    assert [c.lease_lost for c in children] == [False, False, False, False, True]
    assert children[4].event.is_set() and not children[0].event.is_set()
