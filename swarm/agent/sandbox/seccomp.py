"""The seccomp filter of a box: the system calls a sandboxed command gets EPERM from
(mounts, other processes' memory, the kernel, keyrings, new namespaces), compiled once per
process to a BPF program that bubblewrap loads from a pipe (``--seccomp FD``)."""

from __future__ import annotations

import errno
import functools
import os
import tempfile

REFUSED = (
    # mounts: the filesystem stays as the box was built
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    # the kernel
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "acct", "swapon", "swapoff", "reboot", "syslog",
    "quotactl", "lookup_dcookie", "uselib", "open_by_handle_at", "name_to_handle_at",
    # keyrings
    "add_key", "request_key", "keyctl",
    # new namespaces (clone with namespace flags is refused by argument below)
    "unshare", "setns",
)
"""System calls a sandboxed command gets EPERM from."""

#: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME (linux/sched.h).
CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                    0x20000000, 0x40000000, 0x00000080)


@functools.cache
def seccomp_program() -> bytes:
    """The BPF program of the filter (built with libseccomp through pyseccomp)."""
    import pyseccomp as sc

    refuse = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in REFUSED:
        try:
            flt.add_rule(refuse, name)
        except (ValueError, RuntimeError, OSError):  # not a call of this architecture
            continue
    for flag in CLONE_NAMESPACES:
        flt.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.seek(0)
        return out.read()


def program_fd() -> int:
    """A pipe's read end holding :func:`seccomp_program`, for ``bwrap --seccomp FD``."""
    return data_fd(seccomp_program())


def data_fd(data: bytes) -> int:
    """A pipe's read end holding ``data`` (well under a pipe's buffer)."""
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    return read
