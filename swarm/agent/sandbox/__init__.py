"""The sandbox of agents' commands: bubblewrap, a seccomp filter, an allowlisted environment.

A sandboxed command runs (docs/deploy.md has the table of what is and is not confined):

- as uid/gid 65534 in its own user namespace, with no capabilities and ``no_new_privs``, in
  its own session and pid/ipc namespaces with a private ``/proc``, killed with its runner
  (a worker: even when it died while bubblewrap set the box up, :data:`RUNNER_ALIVE`)
  (the host's UTS namespace, which it cannot change);
  on the host, as the runner's uid, or, when the runner is root, as ``SWARM_SANDBOX_UID``
  (:data:`UID`; never 0, whose files the box could otherwise read wherever the owner may),
  given the workspace and its git folders by ACL entries (:mod:`swarm.agent.grants`);
- seeing of the host's files only the system's folders (:data:`SYSTEM`, read-only), the
  workspace (a child also sees its parent's workspace, read-only), with a private
  ``/tmp``, ``/dev/shm`` and ``$HOME`` (tmpfs of :data:`TMP_SIZE` bytes each) and
  ``SWARM_HOME`` and ``/run`` hidden under empty read-only tmpfs (the workspace is bound
  back when it lies under one);
- under a seccomp filter: the calls of :data:`REFUSED` and ``clone`` of a namespace fail
  with EPERM (``clone3`` with ENOSYS, so libc falls back to ``clone``);
- with at most :data:`PIDS` processes and threads: ``RLIMIT_NPROC`` set inside the box, where
  it counts the box's own user namespace only (one per command; the kernel holds every
  host uid but 0 to it, and the box never runs as host uid 0);
- with an environment built from :data:`PASSED` (plus ``SWARM_SANDBOX_ENV`` names);
- in a network namespace of its own: user-mode internet from slirp4netns where the
  worker's host and the swarm's Redis are unreachable (:mod:`swarm.agent.boxnet`), none
  with ``SWARM_SANDBOX_NETWORK=0``, the host's with ``host``;
- in a cgroup of its own with memory, pids and CPU limits (:mod:`swarm.agent.cgroups`).

Whether this works here is tried once per process with a real command (:func:`probe`).
Workers default to ``auto`` and refuse children when it fails (:func:`for_worker`); the
root in a terminal keeps the user's ``SWARM_SANDBOX`` (default ``none``), and the local
workers it starts on its own embedded server then run its children unconfined where it
fails (:data:`FALLBACK`).

Its modules, one idea each: :mod:`.box` (bubblewrap's command line), :mod:`.seccomp` (the
filter), :mod:`.envvars` (the environment), :mod:`.lifeline` (dying with the runner),
:mod:`.gitdirs` (the git folders bound), :mod:`.access` (a root runner's ACL grants),
:mod:`.launch` (the cgroup and network handshake), :mod:`.netslots` (network
namespaces kept and lent to one box at a time), :mod:`.trial` (the trial command) and
:mod:`.choice` (which sandbox a process uses). Their public names are importable from here.
"""

from swarm.agent.sandbox.box import NO_NETWORK, PIDS, SYSTEM, TMP_SIZE, UID, Box, system_binds
from swarm.agent.sandbox.choice import (
    FALLBACK,
    UNBOXED,
    Choice,
    choose,
    for_worker,
    limits_of,
    network_mode,
    network_of,
    shown_of,
    unboxed,
)
from swarm.agent.sandbox.envvars import GIT_STAT_CHECK, PASSED, add_git_stat_check, environment
from swarm.agent.sandbox.gitdirs import GitDirs, child_top, git_dirs, own_repository
from swarm.agent.sandbox.launch import Launch, cgroup_tree
from swarm.agent.sandbox.lifeline import (
    RUNNER_ALIVE,
    RUNNER_GUARD,
    pdeathsig_setpriv,
    runner_pipe,
)
from swarm.agent.sandbox.seccomp import REFUSED, data_fd, program_fd, seccomp_program
from swarm.agent.sandbox.trial import Probe, probe, run_as

__all__ = [
    "FALLBACK", "GIT_STAT_CHECK", "NO_NETWORK", "PASSED", "PIDS", "REFUSED", "RUNNER_ALIVE",
    "RUNNER_GUARD", "SYSTEM", "TMP_SIZE", "UID", "UNBOXED", "Box", "Choice", "GitDirs",
    "Launch", "Probe", "add_git_stat_check", "cgroup_tree", "child_top", "choose",
    "data_fd", "environment", "for_worker", "git_dirs", "limits_of", "network_mode",
    "network_of", "own_repository", "pdeathsig_setpriv", "probe", "program_fd", "run_as",
    "runner_pipe", "seccomp_program", "shown_of", "system_binds", "unboxed",
]
