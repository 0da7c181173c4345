"""EmbeddedServer (real Valkey processes) and connecting to Redis."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_py

import swarm
import swarm.store.server as server_mod
from swarm import procs
from swarm.config import Settings
from swarm.errors import ConfigError, StoreUnavailableError
from swarm.store import pids
from swarm.store.connection import connect, mask_url, open_store
from swarm.store.server import EmbeddedServer

ROOT = Path(swarm.__file__).resolve().parent.parent

# ensure() when told "go", print the URL and server pid, then release() when told "release"
# or just exit when told anything else.
USER = """
import json, sys
from pathlib import Path
from swarm.store.server import EmbeddedServer
server = EmbeddedServer(Path(sys.argv[1]))
sys.stdin.readline()
url = server.ensure()
print(json.dumps({"url": url, "pid": server.status().pid}), flush=True)
if sys.stdin.readline().strip() == "release":
    server.release()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A SWARM_HOME whose server, if any is left, is stopped after the test."""
    yield tmp_path
    EmbeddedServer(tmp_path).stop()


def spawn_user(home: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", USER, str(home)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def answer(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    data: dict[str, object] = json.loads(proc.stdout.readline())
    return data


def test_proc_stat_is_read_by_the_shared_helper(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "PROC", tmp_path)
    pid = os.getpid()
    stat = tmp_path / str(pid) / "stat"
    stat.parent.mkdir()
    stat.write_text(f"{pid} (a) (b c) S 1 {pid} {' '.join(['0'] * 16)} 4242 0 0\n")
    assert pids.proc_start(pid) == "4242" and pids.pid_alive(pid)
    stat.write_text(stat.read_text().replace(") S ", ") Z "))
    assert not pids.pid_alive(pid)  # a zombie is dead for us
    stat.write_text("garbage")  # unreadable: no start time, and os.kill decides
    assert pids.proc_start(pid) is None and pids.pid_alive(pid)


def test_start_use_release(home: Path) -> None:
    server = EmbeddedServer(home)
    url = server.ensure()
    assert url.startswith("redis://:") and "@127.0.0.1:" in url and url.endswith("/0")
    client = connect(url)
    assert client.set("k", "v") and client.get("k") == "v"
    client.close()
    status = server.status()
    assert status.running and status.url == url and status.users == [os.getpid()]
    assert status.pid is not None and alive(status.pid)
    assert client.connection_pool.connection_kwargs["port"] == status.port
    conf = (home / "redis" / "valkey.conf").read_text()
    assert "appendonly yes" in conf and "appendfsync everysec" in conf
    assert json.loads((home / "redis" / "server.json").read_text())["pid"] == status.pid
    server.release()
    assert wait_gone(status.pid)
    assert not (home / "redis" / "server.json").exists()
    assert not server.status().running


def test_the_embedded_server_answers_only_to_its_password(home: Path) -> None:
    server = EmbeddedServer(home)
    url = server.ensure()
    try:
        port = server.status().port
        assert port is not None
        anonymous = redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        with pytest.raises(redis_py.AuthenticationError):
            anonymous.get("k")
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(host="127.0.0.1", port=port, password="guess").ping()
        data = home / "redis"
        secret = (data / "secret").read_text().strip()
        assert secret and secret in url and len(secret) >= 40
        for path in (data / "secret", data / "valkey.conf"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        assert secret not in (data / "server.json").read_text()
        assert EmbeddedServer(home).ensure() == url  # the same password for every user
    finally:
        server.release()


def test_second_instance_adopts(home: Path) -> None:
    first, second = EmbeddedServer(home), EmbeddedServer(home)
    url = first.ensure()
    pid = first.status().pid
    assert pid is not None
    assert second.ensure() == url
    assert second.status().pid == pid
    first.release()
    assert alive(pid) and connect(url).ping()  # the second user still needs it
    second.release()
    assert wait_gone(pid)


def test_data_survives_stop_and_start(home: Path) -> None:
    server = EmbeddedServer(home)
    client = connect(server.ensure())
    client.set("kept", "yes")
    client.close()
    old_pid = server.status().pid
    server.stop()
    assert old_pid is not None and wait_gone(old_pid)
    client = connect(server.ensure())
    assert server.status().pid != old_pid
    assert client.get("kept") == "yes"
    client.close()
    server.release()


def test_sigkilled_user_leaves_a_server_the_next_ensure_adopts(home: Path) -> None:
    proc = spawn_user(home)
    tell(proc, "go")
    first = answer(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    pid = first["pid"]
    assert isinstance(pid, int) and alive(pid)
    server = EmbeddedServer(home)
    assert server.ensure() == first["url"]
    assert server.status().pid == pid and server.status().users == [os.getpid()]
    server.release()
    assert wait_gone(pid)


def test_normal_exit_without_release_stops_the_server(home: Path) -> None:
    proc = spawn_user(home)
    tell(proc, "go")
    pid = answer(proc)["pid"]
    tell(proc, "exit")
    assert proc.wait(10) == 0
    assert isinstance(pid, int) and wait_gone(pid)


def test_a_process_that_only_adopts_never_starts_a_server(home: Path) -> None:
    with pytest.raises(StoreUnavailableError, match="has finished"):
        EmbeddedServer(home).ensure(start=False)
    assert not EmbeddedServer(home).status().running
    owner, local = EmbeddedServer(home), EmbeddedServer(home)
    url = owner.ensure()
    assert local.ensure(start=False) == url
    pid = owner.status().pid
    owner.release()
    local.release()
    assert isinstance(pid, int) and wait_gone(pid)


# A user stopped by SIGTERM (as KeyboardInterrupt, like `swarm worker`) right after the
# server started and before it counted itself as a user.
TERMED_WHILE_STARTING = """
import os, signal, sys
from pathlib import Path
from swarm.store.server import EmbeddedServer

def interrupt(signum, frame):
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, interrupt)
start = EmbeddedServer._start
def start_then_termed(self):
    info = start(self)
    print(info.pid, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    return info
EmbeddedServer._start = start_then_termed
try:
    EmbeddedServer(Path(sys.argv[1])).ensure()
    print("ensured", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_user_termed_while_it_starts_the_server_leaves_none_running(home: Path) -> None:
    done = subprocess.run([sys.executable, "-c", TERMED_WHILE_STARTING, str(home)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid, outcome = done.stdout.split()
    # The signal waited until the process was a user; its unwinding then stopped the server.
    assert outcome == "interrupted", done.stdout + done.stderr
    assert wait_gone(int(pid)), "the server was left running for nobody"


def test_release_held_leaves_the_server_before_os_exit(home: Path) -> None:
    code = ("import os, sys; from pathlib import Path; "
            "from swarm.store.server import EmbeddedServer, release_held; "
            "s = EmbeddedServer(Path(sys.argv[1])); s.ensure(); print(s.status().pid, "
            "flush=True); release_held(); os._exit(0)")
    done = subprocess.run([sys.executable, "-c", code, str(home)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert wait_gone(int(done.stdout))


def test_concurrent_ensures_share_one_server(home: Path) -> None:
    procs = [spawn_user(home), spawn_user(home)]
    try:
        for proc in procs:
            tell(proc, "go")
        a, b = (answer(proc) for proc in procs)
        assert a == b
        pid = a["pid"]
        assert isinstance(pid, int)
        assert sorted(EmbeddedServer(home).status().users) == sorted(p.pid for p in procs)
        for proc in procs:
            tell(proc, "release")
        assert [proc.wait(10) for proc in procs] == [0, 0]
        assert wait_gone(pid)
        assert not (home / "redis" / "server.json").exists()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_stale_server_json_is_replaced(home: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    info = home / "redis" / "server.json"
    info.parent.mkdir(parents=True)
    # A dead pid, then a live pid that is not a server (the pid was reused): both replaced.
    for stale_pid in (dead.pid, os.getpid()):
        info.write_text(json.dumps({"pid": stale_pid, "port": 1, "started": 0}))
        server = EmbeddedServer(home)
        started = time.monotonic()
        url = server.ensure()
        assert time.monotonic() - started < 3
        pid = json.loads(info.read_text())["pid"]
        assert pid not in (stale_pid, None) and connect(url).ping()
        server.stop()
        assert wait_gone(pid)


def test_port_taken_between_choice_and_bind_is_retried(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        free = iter([taken])
        real = server_mod._free_port
        monkeypatch.setattr(server_mod, "_free_port", lambda: next(free, None) or real())
        server = EmbeddedServer(home)
        url = server.ensure()
    assert f":{taken}/" not in url and connect(url).ping()
    assert "Address already in use" in (home / "redis" / "valkey.log").read_text()
    server.release()


def test_binary_missing(home: Path) -> None:
    with pytest.raises(StoreUnavailableError, match=r"not executable.*SWARM_REDIS_URL"):
        EmbeddedServer(home, binary=home / "no-such-server").ensure()


def test_startup_failure_shows_log_tail(home: Path) -> None:
    fake = home / "fake-server"
    fake.write_text("#!/bin/sh\necho 'FATAL CONFIG FILE ERROR: demo' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(StoreUnavailableError) as err:
        EmbeddedServer(home, binary=fake).ensure()
    message = str(err.value)
    assert "exited with code 1" in message and "FATAL CONFIG FILE ERROR: demo" in message
    assert "SWARM_REDIS_URL" in message


def test_data_dir_not_writable(tmp_path: Path) -> None:
    home = tmp_path / "file"
    home.write_text("not a folder")
    with pytest.raises(StoreUnavailableError, match=r"not writable.*SWARM_HOME"):
        EmbeddedServer(home).ensure()


def test_unreachable_url_masks_password() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://:s3cret@127.0.0.1:{port}/0"
    with pytest.raises(StoreUnavailableError) as err:
        connect(url, retries=1)
    message = str(err.value)
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in message
    assert "s3cret" not in message and "SWARM_REDIS_URL" in message


def test_wrong_acl_user_masks_password(redis_server: str) -> None:
    url = redis_server.replace("redis://", "redis://bob:s3cret@")
    with pytest.raises(StoreUnavailableError, match=r"bob:\*\*\*@.*refused the credentials"):
        connect(url)


def test_not_a_redis_url() -> None:
    with pytest.raises(ConfigError, match="not a Redis URL"):
        connect("http://user:s3cret@host/")


@pytest.mark.parametrize(("url", "masked"), [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://alice:p%40ss@h/1", "rediss://alice:***@h/1"),
    ("redis://secret@h", "redis://***@h"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("unix:///run/redis.sock?db=2&password=pw", "unix:///run/redis.sock?db=2&password=***"),
])
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    conf = tmp_path / "r.conf"
    conf.write_text(f'port 0\nunixsocket {sock}\ndir {tmp_path}\nsave ""\n')
    from swarm.store.server import server_binary

    proc = subprocess.Popen(
        [str(server_binary()), str(conf)], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 5
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        client = connect(f"unix://{sock}?db=3")
        assert client.set("k", "v") and client.get("k") == "v"
        client.close()
    finally:
        proc.kill()
        proc.wait()


def test_open_store_embedded_and_external(tmp_path: Path, redis_server: str) -> None:
    with open_store(Settings(home=tmp_path)) as store:
        assert store.embedded and store.redis.ping()
        pid = store.server.status().pid if store.server else None
        assert pid is not None and alive(pid)
    assert wait_gone(pid)
    with open_store(Settings(home=tmp_path / "ext", redis_url=redis_server)) as store:
        assert not store.embedded and store.url == redis_server and store.redis.ping()
    assert not (tmp_path / "ext").exists()  # no embedded server was touched


def test_open_store_releases_when_the_body_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), open_store(Settings(home=tmp_path)) as store:
        assert store.server is not None
        pid = store.server.status().pid
        raise RuntimeError("boom")
    assert pid is not None and wait_gone(pid)


def test_client_survives_a_dropped_connection(redis: redis_py.Redis) -> None:
    redis.set("k", "v")
    redis.client_kill_filter(_type="normal", skipme=False)
    assert redis.get("k") == "v"  # reconnected by the retry policy


def test_celery_app_follows_a_new_url(tmp_path: Path) -> None:
    """configure() pointed at another Redis sends there, not over the old pool."""
    from swarm.broker.app import configure
    from swarm.store.connection import connect

    first, second = EmbeddedServer(tmp_path / "a"), EmbeddedServer(tmp_path / "b")
    try:
        url_a, url_b = first.ensure(), second.ensure()
        configure(url_a).send_task("swarm.test.nothing", args=[1], queue="swarm")
        configure(url_b).send_task("swarm.test.nothing", args=[2], queue="swarm")
        assert connect(url_a).llen("swarm") == 1
        assert connect(url_b).llen("swarm") == 1
    finally:
        first.stop()
        second.stop()
