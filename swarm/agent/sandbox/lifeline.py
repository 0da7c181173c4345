"""How a box dies with its runner (a worker), even when the runner is killed while
bubblewrap sets the box up: a parent-death signal set by ``setpriv`` (:data:`RUNNER_GUARD`)
and a pipe whose write end only the runner holds (:func:`runner_pipe`,
:data:`RUNNER_ALIVE`), whose end of file kills everything in the box."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import threading


@functools.cache
def pdeathsig_setpriv() -> str:
    """``setpriv`` (util-linux 2.33 or later) if it can set a parent-death signal here,
    else ""."""
    path = shutil.which("setpriv")
    if path is None:
        return ""
    try:
        done = subprocess.run([path, "--pdeathsig", "USR1", "--", "true"],
                              capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return path if done.returncode == 0 else ""

#: A worker's box starts under ``setpriv --pdeathsig KILL``, then this shell runs
#: bubblewrap (``$2...``) only if its parent is still the worker (``$1``). bubblewrap's own
#: ``--die-with-parent`` is set later, inside it: a worker killed between the fork and that
#: point left the box running its command, orphaned, after the child's lease could have
#: been handed over; a worker killed before ``setpriv`` set the signal sends none. (A box
#: that waits for its worker after ``setpriv`` needs no such shell: the worker, alive, says
#: "go" only once the box said "up", after the signal was set: :meth:`.Box.argv`.)
RUNNER_GUARD = '[ "$PPID" = "$1" ] || exit 137; shift; exec "$@"'

#: The first lines of a worker's box command, given (as ``{fd}``) the read end of a pipe
#: whose write end only the worker holds (:func:`runner_pipe`; nothing is ever written):
#: at its end of file the worker is gone. bubblewrap sets the box's first process's
#: parent-death signal only once the box is set up (tens of ms, more under load), and
#: checks nothing after it: a worker killed meanwhile left the box to start its command
#: orphaned (the sandboxed chaos campaign saw commands start 0.04-0.22 s after their
#: worker was SIGKILLed). So the command does not start once the worker is gone, and a watcher
#: kills every process of the box (``kill -1``: the box's own pid namespace, in which the
#: command's shell is pid 2; outside one it kills nothing) when the worker goes later.
#: Its output is closed, so a command's output ends when the command does.
RUNNER_ALIVE = ("read -t 0 -u {fd} && exit 137\n"
                "( (read -u {fd}; [ $$ = 2 ] && kill -KILL -1) </dev/null >/dev/null 2>&1 & )\n"
                "exec {fd}<&-\n")

_PIPE: tuple[int, int] | None = None
_PIPE_LOCK = threading.Lock()


def runner_pipe() -> int:
    """The read end of this process's pipe for :data:`RUNNER_ALIVE` (made once per
    process; not inheritable: only the boxes it is passed to get the read end)."""
    global _PIPE
    with _PIPE_LOCK:
        if _PIPE is None:
            _PIPE = os.pipe()
        return _PIPE[0]


def _forget_pipe() -> None:
    """In a forked child: close the pipe it inherited (its copy of the write end would
    keep its parent's boxes alive after the parent died); it makes its own."""
    global _PIPE, _PIPE_LOCK
    _PIPE_LOCK = threading.Lock()  # another thread of the parent may have held it
    for end in _PIPE or ():
        with contextlib.suppress(OSError):
            os.close(end)
    _PIPE = None


os.register_at_fork(after_in_child=_forget_pipe)
