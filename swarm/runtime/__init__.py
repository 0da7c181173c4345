"""Wiring: the parts (store, model client, agent) put together, in whichever process runs.

- :mod:`~swarm.runtime.build`: an agent with its session, store, model and approver;
- :mod:`~swarm.runtime.spawner`: the parent's side of an ``agent`` call (any process);
- :mod:`~swarm.runtime.root`: a root agent's berserk mode, in the user's terminal;
- :mod:`~swarm.runtime.jobs`: a job whose root runs on the workers (HTTP, schedules);
- :mod:`~swarm.runtime.local`: the local coordinator and workers a terminal starts.

What an agent works in, and how it travels between hosts, is :mod:`swarm.workspace`.
"""
