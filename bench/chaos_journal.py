"""The journal of a chaos campaign (:mod:`bench.chaos`): every command of the job sends
its line to a collector in the campaign's process, which appends it to the journal file.

A command runs ``sleep ...; python3 -c CLIENT SOCKET "J tag p c k"``
(:func:`client_command`): the line leaves from the command's own execution, sandboxed or
not. The collector (:class:`Collector`) listens on a Unix socket, reads the sender's pid
from the kernel (``SO_PEERCRED``, a pid of the campaign's pid namespace even when the
sender is in a box's own), walks its ancestors past the command's shells and bubblewrap to
the worker process that ran it (:func:`worker_of`) and only then says ``go``: the client
takes its time (its host's clock) and host name and sends the line, and the collector
appends ``J tag p c k time host pid sender=PID at=TIME`` (``at``: when it received it, on
the laptop's clock) and answers ``ok``. The worker is found before the time is taken, as
the shell of the unconfined campaign did: a worker killed in between leaves a line with
its pid and a time after its death, which the checks read as its (no other claim can come
that soon); the other order made a line written just before the kill look orphaned.

Why this path, not a file the command appends to, nor TCP to the laptop:

- a sandboxed command (``SWARM_SANDBOX=auto``) writes only its workspace; ``/tmp`` is its
  own, lost with the box; the workspace is the swarm's to capture, move and remove, and
  no folder outside it is bound into the box (and the product has no setting for one);
- a box has its own pid namespace: it cannot see the worker's pid, which the checks need
  (an attempt is a worker process). The kernel tells the collector;
- a partition must not touch the evidence. TCP to the laptop's bridge address would go
  through the very link the campaign cuts: a command on a cut-off host could not send its
  line, and the line missing would look like a command that never ran; worse, the case
  the zombie check exists for (a command going on on a cut-off host after its run was
  handed over) would be the one line never seen. Buffering it does not help: the box's
  ``/tmp`` dies with it; a retry until the link heals outlasts the command, which the
  worker stops a margin before its lease runs out, losing the line again; and the
  line's own time (taken before sending) would still be needed. A Unix socket is reached
  through the filesystem, which every simulated host shares with the laptop, whatever
  their network namespaces do: the evidence is an observer outside the network under test,
  as the shared journal file was before. It sits under ``/var/tmp``, writable by anyone
  (the box runs as ``SWARM_SANDBOX_UID``); a box shows its folder only when told
  (``SWARM_SANDBOX_SHOW``, which the campaign gives its workers).

A line whose sender was gone before its ancestors could be read (its box killed with its
worker in that very instant) gets pid 0: the checks then know its time but not its
writer (:func:`bench.chaos_evidence.zombies`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import socketserver
import struct
import tempfile
import threading
import time
from pathlib import Path

#: The command's client: once the collector says ``go``, sends its line with its time and
#: host name, then waits for ``ok`` (exit 1 without).
CLIENT = ("import os,socket,sys,time;s=socket.socket(socket.AF_UNIX);s.settimeout(60);"
          "s.connect(sys.argv[1]);f=s.makefile('rb');f.readline()==b'go\\n' or sys.exit(1);"
          "s.sendall(f'{sys.argv[2]} {time.time():.6f} {os.uname().nodename}\\n'.encode());"
          "sys.exit(f.readline()!=b'ok\\n')")
#: Programs between a command's client and the worker that ran it: the command's shell,
#: swarm's reaping shell (``setpriv`` execs it), ``setpriv`` and bubblewrap (two: the
#: outer one and the box's first process).
WRAPPERS = frozenset({"bash", "sh", "setpriv", "bwrap"})


def python3() -> str:
    """A ``python3`` every host and box can run (not one under ``/tmp``, which a box does
    not see: the campaign's own may be a virtual environment there)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")):
        if candidate and os.access(candidate, os.X_OK) and not candidate.startswith("/tmp/"):
            return candidate
    raise RuntimeError("no python3 outside /tmp for the commands' journal client")


def client_command(socket_path: Path, words: str, python: str = "/usr/bin/python3") -> str:
    """The shell line that sends ``J words TIME HOST``."""
    return (f"{python} -I -S -c {shlex.quote(CLIENT)} {shlex.quote(str(socket_path))} "
            f"{shlex.quote('J ' + words)}")


def _stat(pid: int) -> tuple[str, int]:
    """A process's name and parent pid, from ``/proc``; OSError when it is gone."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    name = raw[raw.index("(") + 1:raw.rindex(")")]
    return name, int(raw[raw.rindex(")") + 2:].split()[1])


def _boxed(pid: int) -> bool:
    """Whether ``pid`` runs in a pid namespace below this one (a box's: its runner)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) > 2
    return False


def worker_of(sender: int) -> int:
    """The process that ran the command whose client is ``sender``: its first ancestor that
    is not one of :data:`WRAPPERS` nor in a box (its runner: a box lasts a child's turn)
    (1 when the command was orphaned; 0 when ``sender`` is gone)."""
    try:
        _, pid = _stat(sender)
        while pid > 1:
            name, parent = _stat(pid)
            if name not in WRAPPERS and not _boxed(pid):
                return pid
            pid = parent
    except (OSError, ValueError):
        return 0
    return pid


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        conn = self.connection
        sender, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET,
                                                           socket.SO_PEERCRED, 12))
        worker = worker_of(sender)  # before its time: the client waits for the word
        conn.settimeout(30)
        try:
            self.wfile.write(b"go\n")
            raw = self.rfile.readline(4096)
        except OSError:
            return
        at = time.time()
        words = raw.decode(errors="replace").split()
        if len(words) != 7 or words[0] != "J":
            return  # no answer: the client exits 1
        line = f"{' '.join(words)} {worker} sender={sender} at={at:.6f}\n"
        with self.server.lock, open(self.server.journal, "a") as out:
            out.write(line)
        with contextlib.suppress(OSError):
            self.wfile.write(b"ok\n")


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, path: str, journal: Path) -> None:
        super().__init__(path, _Handler)
        self.journal = journal
        self.lock = threading.Lock()


class Collector:
    """The journal's collector: a Unix socket (:attr:`socket`) in a folder of its own under
    ``/var/tmp``, appending what it receives to ``journal``."""

    def __init__(self, journal: Path, tag: str) -> None:
        self.journal = journal
        self.folder = Path(tempfile.mkdtemp(prefix=f"swarm-chaos-{tag}-", dir="/var/tmp"))
        os.chmod(self.folder, 0o755)
        self.socket = self.folder / "journal.sock"
        self.server = _Server(str(self.socket), journal)
        os.chmod(self.socket, 0o666)  # the box's host uid connects too
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.2,),
                                       daemon=True, name="chaos-journal")

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.folder, ignore_errors=True)
