"""The runner of a lasting box (:mod:`swarm.agent.sandbox.lasting`): the box's first
process, which runs the commands the worker sends it, one at a time, each in its own session.

Never imported by swarm: :mod:`~swarm.agent.sandbox.lasting` passes this file's text to the
box's python3 (``python3 -I -S -c``), so it uses the standard library only and runs on any
Python 3 from 3.8. bubblewrap starts it with no shell in between. Arguments: its end of the
worker's socket (``AF_UNIX``, ``SOCK_SEQPACKET``), the read end of the worker's lifeline pipe
(``-1``: none) and the box's limit of processes (``RLIMIT_NPROC``, set first: it counts
the box's own user namespace only).

It makes itself non-dumpable first: a command runs as the same uid, but without a
capability it can then neither open the runner's descriptors (``/proc/2/fd``,
``pidfd_getfd``) nor write its memory, so only the worker talks to it. Messages from the
worker: ``R`` + the command's length (8 bytes) + its first bytes, with the write end of the
command's output pipe attached (``SCM_RIGHTS``), then ``C`` + more bytes until whole;
``T``: SIGTERM the command's process group; ``K``: SIGKILL it. To the worker: ``ready``
once, then ``X`` + the exit code (128 + the signal's number when a signal ended it) of each
command, sent once everything the command started is gone: it kills every process of the
box but itself and the box's init (``kill(-1)``: the box is a pid namespace of its own, where
it is pid 2), so nothing a command leaves behind reaches the next. At the end of the worker's
socket or lifeline (the worker closed the box, or died), it kills them all and exits.
"""

import _signal as signal  # type: ignore[import-not-found]  # not signal, nor socket: they import enum (~10 ms at each start)
import _socket as socket
import posix as os  # not os: its import (posixpath, stat, _collections_abc) is ~1 ms at each start
import resource
import select
import struct
import sys
import time

PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3


def prctl(option: int) -> int:
    """libc's ``prctl(option, 0, 0, 0, 0)``, through ``_ctypes`` (``ctypes`` itself costs
    ~2.5 ms at each start, half the interpreter's own), or ``ctypes`` where ``_ctypes`` lacks
    what it needs."""
    try:
        import _ctypes

        return int(_ctypes.call_function(
            _ctypes.dlsym(_ctypes.dlopen(None, 0), "prctl"),  # type: ignore[arg-type]
            (option, 0, 0, 0, 0)))
    except (ImportError, AttributeError, OSError, TypeError):
        import ctypes

        return int(ctypes.CDLL(None).prctl(option, 0, 0, 0, 0))


def alive(pid: str) -> bool:
    """Whether process ``pid`` is there and not a zombie (this runner's command, whose end
    it reads after the sweep, or one init has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def sweep() -> None:
    """Kill every process of the box but this one and init; return once they are gone."""
    me = os.getpid()
    for _ in range(2000):
        try:  # noqa: SIM105 (contextlib imports functools, a few ms at each start)
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not [p for p in os.listdir("/proc")
                if p.isdigit() and int(p) not in (1, me) and alive(p)]:
            return
        time.sleep(0.001)


def ready_now(fds: "list[int]", timeout: "int | None") -> "list[int]":
    """Those of ``fds`` readable (or at their end) within ``timeout`` ms (None: no limit).
    poll, not select: the worker's descriptor numbers reach here, and select refuses those
    of 1,024 and up."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(timeout)]


#: Signals Python ignores, which a command must not inherit so.
DEFAULT = (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ)


def start(command: bytes, out: int) -> int:
    """Start ``command`` in bash, in a session of its own, its output to ``out``: its pid,
    or -1 (said to ``out``) where it cannot start. ``posix_spawn`` (a vfork: ~0.6 ms of
    CPU less than a fork of this interpreter a command; a fork where its libc cannot make
    a session so); every other descriptor of the runner is close-on-exec (:func:`main`)."""
    argv = [b"bash", b"-c", command]
    try:
        try:
            return os.posix_spawnp(
                b"bash", argv, os.environ, setsid=True, setsigdef=DEFAULT,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, out, 2)])
        except NotImplementedError:  # no POSIX_SPAWN_SETSID (glibc before 2.26)
            return forked(argv, out)
    except OSError as exc:
        try:  # noqa: SIM105
            os.write(out, f"cannot start bash: {exc}\n".encode())
        except OSError:
            pass
        return -1


def forked(argv: "list[bytes]", out: int) -> int:
    """:func:`start` by fork and exec."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for number in DEFAULT:
            signal.signal(number, signal.SIG_DFL)
        for folder in os.environ.get(b"PATH", b"/usr/bin:/bin").split(b":"):
            try:  # noqa: SIM105
                os.execv((folder or b".") + b"/" + argv[0], argv)
            except OSError:
                pass
        os.write(2, b"cannot start bash: not found\n")
    finally:
        os._exit(127)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    alive = int(sys.argv[2])
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (int(sys.argv[3]),) * 2)
    except (ValueError, OSError) as exc:
        sock.send(b"Ecannot limit the box's processes: " + str(exc).encode())
        return
    if not hasattr(os, "posix_spawnp"):  # before 3.8: the worker gives each command a box
        sock.send(b"Ethe box's python3 is older than 3.8 (no posix_spawnp)")
        return
    if os.getpid() != 2 or prctl(PR_SET_DUMPABLE) != 0 or prctl(PR_GET_DUMPABLE) != 0:
        sock.send(b"Enot pid 2 of its own namespace, or it stayed dumpable")
        return
    for fd in os.listdir("/proc/self/fd"):  # none reaches a command (start())
        if int(fd) > 2:
            try:  # noqa: SIM105
                os.set_inheritable(int(fd), False)
            except OSError:  # the listing's own, closed since
                pass
    watched: list[int] = [sock.fileno()]
    if alive >= 0:
        if ready_now([alive], 0):  # the worker is gone already
            return
        watched.append(alive)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    watched.append(wake_r)
    sock.send(b"ready")
    child = 0
    pending = b""
    wanted = 0
    out = -1
    while True:
        ready = ready_now(watched, None)
        if alive in ready:
            return
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            if child:
                done, status = os.waitpid(child, os.WNOHANG)
                if done:
                    child = 0
                    code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) \
                        else os.WEXITSTATUS(status)
                    sweep()
                    sock.send(b"X%d" % code)
        if sock.fileno() in ready:
            data, ancillary, _, _ = sock.recvmsg(1 << 17, socket.CMSG_SPACE(4),
                                                 socket.MSG_CMSG_CLOEXEC)
            if not data:
                return
            kind = data[:1]
            for level, ctype, fds in ancillary:
                if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                    out = struct.unpack("i", fds[:4])[0]
            if kind == b"R" and not child:
                wanted = struct.unpack(">Q", data[1:9])[0]
                pending = data[9:]
            elif kind == b"C" and not child:
                pending += data[1:]
            elif kind in (b"T", b"K") and child:
                try:  # noqa: SIM105
                    os.killpg(child, signal.SIGTERM if kind == b"T" else signal.SIGKILL)
                except OSError:
                    pass
                if kind == b"K":
                    sweep()
                continue
            if kind in (b"R", b"C") and not child and out >= 0 and len(pending) >= wanted:
                child = start(pending, out)
                os.close(out)
                out, pending = -1, b""
                if child < 0:
                    child = 0
                    sock.send(b"X127")


if __name__ == "__main__":
    try:
        main()
    finally:
        if os.getpid() == 2:
            sweep()
    os._exit(0)  # no interpreter teardown (~1 ms a box): nothing is left to flush
