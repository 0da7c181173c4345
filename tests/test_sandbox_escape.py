"""The escape suite: commands a model could write to get out of the sandbox, each run for
real through swarm's own command runner (tests/sandbox_runner.py: a process holding the
model key in its environment, as a worker does), as root and as an unprivileged user.
Each must fail; the first test shows the box itself works, so no failure is vacuous."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from swarm.agent import boxnet, sandbox
from tests.helpers import wait_until

RUNNER = Path(__file__).with_name("sandbox_runner.py")
REPO = Path(__file__).resolve().parent.parent
SECRET = f"sk-escape-{uuid.uuid4().hex[:12]}"
NOBODY = 65534
END = "escape-attempt-ran-to-its-end"

# Only a missing bubblewrap skips: a box that runs but does not confine fails the tests.
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (apt-get install bubblewrap)")


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *argv]


def runner_env(home: Path) -> dict[str, str]:
    """What a worker has: the model key and the Redis URL (with its password), a home of
    its own next to SWARM_HOME."""
    site = [str(REPO), str(home.parent / "site"), sysconfig.get_paths()["purelib"]]
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home.parent / "user"),
            "SWARM_API_KEY": SECRET, "SWARM_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:1/0",
            "SWARM_HOME": str(home), "PYTHONPATH": os.pathsep.join(site)}


def stage_site(base: Path) -> None:
    """Copy the runner's third-party modules to ``base/site``, readable by anyone: the
    site-packages they came from may sit under /root, which uid 65534 cannot read."""
    site = base / "site"
    site.mkdir(mode=0o755)
    origin = importlib.util.find_spec("pyseccomp")
    assert origin is not None and origin.origin is not None, "pyseccomp is a dependency"
    shutil.copy(origin.origin, site / "pyseccomp.py")
    (site / "pyseccomp.py").chmod(0o644)


@cache
def unprivileged_python() -> str | None:
    """A Python an unprivileged user can run swarm with (this venv's may sit under /root)."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        return None
    base = Path(tempfile.mkdtemp(prefix="swarm-escape-probe-", dir="/var/tmp"))
    try:
        base.chmod(0o755)
        stage_site(base)
        for python in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3",
                       "/usr/local/bin/python3"):
            try:
                done = subprocess.run(
                    as_nobody(python, "-c", "import swarm.agent.shell, pyseccomp"),
                    env=runner_env(base / "home"), capture_output=True, timeout=30, cwd="/")
            except OSError:
                continue
            if done.returncode == 0:
                return python
        return None
    finally:
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class Box:
    """One user's runner: a workspace and a SWARM_HOME (holding a secret file) under
    ``base``, owned by that user."""

    user: str
    base: Path
    workspace: Path
    home: Path
    python: str

    def argv(self, *args: str) -> list[str]:
        return as_nobody(*args) if self.user == "unprivileged" else list(args)

    def run(self, command: str, timeout: int = 30, **settings: str) -> dict[str, Any]:
        """Run ``command`` in the sandbox through the runner (``settings``: more of its
        environment, as SWARM_SANDBOX_MEMORY); its JSON result. The command must have run
        to its end (a box that fails to start fails no attempt)."""
        done = subprocess.run(
            self.argv(self.python, str(RUNNER), str(self.workspace), str(self.home),
                      str(timeout), f"{command}\necho {END}"),
            env={**runner_env(self.home), **settings}, capture_output=True, text=True,
            timeout=timeout + 30, cwd=self.base)
        assert done.returncode == 0, done.stderr  # the runner (the "worker") survived
        result: dict[str, Any] = json.loads(done.stdout)
        assert f"\n{END}\n" in f"\n{result['output']}", result["output"]
        result["output"] = result["output"].replace(f"{END}\n", "")
        return result

    def give(self, path: Path) -> Path:
        """Make ``path`` the user's (so only the sandbox can stop it being written)."""
        if self.user == "unprivileged":
            os.chown(path, NOBODY, NOBODY)
        return path


@pytest.fixture(params=["root", "unprivileged"])
def box(request: pytest.FixtureRequest) -> Iterator[Box]:
    user = request.param
    python = sys.executable
    if user == "unprivileged":
        found = unprivileged_python()
        if found is None:
            pytest.skip("cannot run the runner as uid 65534 here (needs root, setpriv and a "
                        "Python that uid 65534 may execute)")
        python = found
    elif os.getuid() != 0:
        pytest.skip("the root case needs root")
    # Not under /tmp, which the box replaces anyway: what it hides must be hidden by it.
    base = Path(tempfile.mkdtemp(prefix="swarm-escape-", dir="/var/tmp"))
    base.chmod(0o755)
    made = Box(user, base, base / "ws", base / "home", python)
    stage_site(base)
    for folder in (made.workspace, made.home, base / "user"):
        folder.mkdir()
        made.give(folder)
    for secret in (made.home / "secret.env", base / "user" / ".env"):
        secret.write_text(f"SWARM_API_KEY={SECRET}\n")
        made.give(secret)
    try:
        yield made
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_box_works_as_uid_65534_without_capabilities(box: Box) -> None:
    result = box.run("id -u; id -g; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' "
                     "/proc/self/status; echo written > inside.txt; ls /proc")
    out = result["output"].split()
    assert out[:2] == ["65534", "65534"]
    status = dict(zip(out[2:10:2], out[3:10:2], strict=True))
    assert status == {"CapEff:": "0000000000000000", "CapBnd:": "0000000000000000",
                      "NoNewPrivs:": "1", "Seccomp:": "2"}
    assert (box.workspace / "inside.txt").read_text() == "written\n"
    # On the host too the box is uid 65534, also under a root runner: never uid 0.
    assert (box.workspace / "inside.txt").stat().st_uid == NOBODY
    pids = [int(p) for p in out[10:] if p.isdigit()]
    assert max(pids) < 10  # a pid namespace of its own: bwrap, bash, ls


@pytest.fixture
def root_only_key() -> Iterator[Path]:
    """The model key in a file only root may read, outside the workspace (an operator's
    ``/etc/swarm/worker.env``), under a folder anyone may enter."""
    folder = Path(tempfile.mkdtemp(prefix="swarm-escape-etc-", dir="/var/tmp"))
    folder.chmod(0o755)
    key = folder / "worker.env"
    key.write_text(f"SWARM_API_KEY={SECRET}\n")
    key.chmod(0o600)
    try:
        yield key
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_files_only_root_may_read_stay_unreadable(box: Box, root_only_key: Path) -> None:
    (box.workspace / "key-link").symlink_to(root_only_key)
    result = box.run(f"cat {root_only_key}; echo key=$?; cat key-link; echo link=$?; "
                     f"grep -r -l sk-escape {root_only_key.parent} /etc 2>/dev/null; "
                     "head -c 64 /etc/shadow; echo shadow=$?")
    out = result["output"]
    assert SECRET not in out, out
    assert re.search(r"^key=1$", out, re.M) and re.search(r"^link=1$", out, re.M), out
    assert "Permission denied" in out  # it is there, and refused, not missing
    if Path("/etc/shadow").exists():
        assert re.search(r"^shadow=1$", out, re.M), out


def test_remounting_root_read_write_fails(box: Box) -> None:
    marker = Path(f"/etc/swarm-escape-{uuid.uuid4().hex[:8]}")
    result = box.run(f"mount -o remount,rw,bind /; echo mount=$?; "
                     f"mount -o remount,rw /; echo again=$?; touch {marker}; echo touch=$?")
    out = result["output"]
    assert "mount=0" not in out and "again=0" not in out and "touch=0" not in out, out
    assert not marker.exists()


def test_writing_outside_the_workspace_fails_also_through_a_symlink(box: Box) -> None:
    outside = box.base / "outside"
    outside.mkdir()
    outside.chmod(0o777)  # the host would let anyone write here: only the sandbox stops it
    (box.workspace / "link").symlink_to(outside)
    (box.workspace / "home-link").symlink_to(box.home)
    tag = uuid.uuid4().hex[:8]
    result = box.run(f"echo x > link/through-link; echo link=$?; "
                     f"echo x > {outside}/direct; echo direct=$?; "
                     f"echo x > home-link/planted; "
                     f"touch /var/tmp/swarm-escape-{tag}; echo vartmp=$?; "
                     f"touch /swarm-escape-{tag}; echo root=$?")
    out = result["output"]
    for name in ("link", "direct", "vartmp", "root"):
        assert f"{name}=0" not in out, out
    assert list(outside.iterdir()) == []
    assert not (box.home / "planted").exists()  # written, if at all, to the empty tmpfs
    assert not Path(f"/var/tmp/swarm-escape-{tag}").exists()
    assert not Path(f"/swarm-escape-{tag}").exists()


def test_the_workers_environ_and_memory_are_out_of_reach(box: Box) -> None:
    # A worker-like sibling holding the key too, besides the runner itself ({pid}).
    sibling = subprocess.Popen(box.argv("sleep", "120"), env=runner_env(box.home))
    try:
        result = box.run(
            "env; cat /proc/{pid}/environ; echo environ=$?; "
            f"cat /proc/{sibling.pid}/environ; echo sibling=$?; "
            "cat /proc/{pid}/maps; echo maps=$?; "
            "dd if=/proc/{pid}/mem bs=4096 count=1 skip=1024 2>&1; echo mem=$?; "
            "grep -a -l sk-escape /proc/*/environ /proc/*/cmdline; echo grep=$?; "
            "cat /proc/1/environ; echo init=$?")
    finally:
        sibling.kill()
        sibling.wait()
    out = result["output"]
    assert SECRET not in out, out
    for name in ("environ", "sibling", "maps", "mem"):
        assert f"{name}=0" not in out, out
    assert "SWARM_API_KEY" not in out and "SWARM_REDIS_URL" not in out


def test_ptrace_fails(box: Box) -> None:
    attach = ("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
              'print("attach", libc.ptrace(16, int(sys.argv[1]), 0, 0), ctypes.get_errno())')
    result = box.run(f"sleep 30 & python3 -c '{attach}' $!; kill $!; "
                     "strace -o /dev/null true; echo strace=$?")
    out = result["output"]
    assert "attach -1 1" in out, out  # EPERM, even on its own child
    assert "strace=0" not in out, out


def test_new_namespaces_fail(box: Box) -> None:
    result = box.run("unshare -U true; echo user=$?; unshare -r true; echo root=$?; "
                     "unshare -m true; echo mount=$?; unshare -n true; echo net=$?; "
                     "bwrap --ro-bind / / true; echo bwrap=$?")
    out = result["output"]
    for name in ("user", "root", "mount", "net", "bwrap"):
        assert re.search(rf"^{name}=[1-9]", out, re.M), out


def test_the_hosts_name_cannot_be_changed(box: Box) -> None:
    before = socket.gethostname()
    out = box.run("hostname swarm-escaped; echo set=$?; hostname")["output"]
    assert re.search(r"^set=[1-9]", out, re.M) and out.endswith(f"{before}\n"), out
    assert socket.gethostname() == before


@pytest.fixture
def docker_socket() -> Iterator[Path]:
    """A listening socket where docker's would be, reachable by anyone on the host."""
    path = Path("/var/run/docker.sock")
    if path.exists() or path.is_symlink():
        path = Path(f"/run/swarm-escape-{os.getpid()}.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    path.chmod(0o777)
    try:
        yield path
    finally:
        server.close()
        path.unlink()


def test_the_docker_socket_and_swarm_home_are_hidden(box: Box, docker_socket: Path) -> None:
    connect = ("import socket, sys; s = socket.socket(socket.AF_UNIX); "
               'print("connected", s.connect_ex(sys.argv[1]))')
    result = box.run(f"ls -l {docker_socket}; echo ls=$?; "
                     f"python3 -c '{connect}' {docker_socket}; "
                     "cat $HOME/.env; echo env=$?; "
                     f"cat {box.home}/secret.env; echo cat=$?; ls -A {box.home}; echo end")
    out = result["output"]
    assert "ls=0" not in out and "cat=0" not in out and "env=0" not in out, out
    assert re.search(r"^connected [1-9]", out, re.M), out  # the attempt ran, and failed
    assert SECRET not in out
    assert out.rstrip().endswith("cat=1\nend"), out  # SWARM_HOME is empty in the box


def test_a_fork_bomb_stops_at_the_pids_limit_and_the_runner_survives(box: Box) -> None:
    tag = f"bomb{uuid.uuid4().hex[:8]}"
    bomb = (f"import os, time  # {tag}\n"
            "n = 0\n"
            "try:\n"
            "    while n < 5000:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60); os._exit(0)\n"
            "        n += 1\n"
            "except OSError as exc:\n"
            '    print("stopped", n, exc.errno)\n')
    result = box.run(f"python3 -c '{bomb}'", timeout=60)
    stopped = re.search(r"stopped (\d+) (\d+)", result["output"])
    assert stopped, result["output"]
    assert int(stopped.group(1)) < sandbox.PIDS and int(stopped.group(2)) == 11  # EAGAIN
    # The box is torn down with its command: nothing of the bomb is left on the host.
    wait_until(lambda: subprocess.run(["pgrep", "-f", tag], capture_output=True).returncode
               == 1, "the bomb's processes to be gone", timeout=30)


def test_filling_the_disk_outside_the_workspace_stops_at_the_cap(box: Box) -> None:
    mib = sandbox.TMP_SIZE >> 20
    full = "2>&1 | grep -o 'No space left on device'"
    result = box.run(f"dd if=/dev/zero of=/tmp/fill bs=1M count={mib + 64} {full}; "
                     "du -m /tmp/fill; rm /tmp/fill; "
                     f"dd if=/dev/zero of=/dev/shm/fill bs=1M count={mib + 64} {full}; "
                     "du -m /dev/shm/fill; rm /dev/shm/fill; "
                     f"dd if=/dev/zero of=$HOME/fill bs=1M count={mib + 64} {full}; "
                     'echo "$(du -m $HOME/fill | cut -f1) homefill"; rm $HOME/fill; '
                     "touch /var/tmp/fill; echo vartmp=$?", timeout=60)
    out = result["output"]
    assert out.count("No space left on device") == 3, out
    sizes = [int(m) for m in
             re.findall(r"^(\d+)\s+(?:/tmp/fill|/dev/shm/fill|homefill)$", out, re.M)]
    assert len(sizes) == 3 and max(sizes) <= mib, out
    assert "vartmp=0" not in out, out
    assert not (box.base / "user" / "fill").exists()


@pytest.fixture
def listeners() -> Iterator[list[tuple[str, int]]]:
    """TCP listeners on the host: on 127.0.0.1 and on each of its other addresses, where
    the embedded Redis and a host's services listen."""
    servers = []
    for address in ("127.0.0.1", *boxnet.host_addresses()):
        server = socket.socket()
        server.bind((address, 0))
        server.listen()
        servers.append(server)
    try:
        yield [s.getsockname() for s in servers]
    finally:
        for server in servers:
            server.close()


CONNECT = ("import socket, sys\n"
           "for a in sys.argv[1:]:\n"
           "    host, port = a.rsplit(':', 1)\n"
           "    s = socket.socket(); s.settimeout(5)\n"
           "    print('reach', a, s.connect_ex((host, int(port))))\n")


def test_the_hosts_ports_and_redis_are_unreachable(
        box: Box, listeners: list[tuple[str, int]]) -> None:
    assert len(listeners) >= 2, "the host has no address but loopback"
    port = listeners[0][1]
    targets = [f"{a}:{p}" for a, p in listeners] + [f"{boxnet.GATEWAY}:{port}"]
    result = box.run(f"python3 -c \"{CONNECT}\" {' '.join(targets)}; "
                     "cat /proc/net/route; echo routes")
    out = result["output"]
    for target in targets:  # refused: ECONNREFUSED (111), EACCES (13) or no network (101)
        assert re.search(rf"^reach {re.escape(target)} (111|13|101)$", out, re.M), out
    tun = os.stat("/dev/net/tun").st_mode & 0o006 == 0o006 if os.path.exists(
        "/dev/net/tun") else False
    if box.user == "root" or tun:  # the internet's way out: slirp4netns's gateway
        assert "network: user-mode" in result["summary"], result["summary"]
        assert re.search(r"^tap0\s+00000000\s+0202000A", out, re.M), out
    else:  # /dev/net/tun is root's: no network at all, and the summary says why
        assert "no network: slirp4netns failed" in result["summary"], result["summary"]
        assert "/dev/net/tun" in result["summary"], result["summary"]
        assert "tap0" not in out, out


def test_a_file_in_the_workers_home_is_not_there(box: Box) -> None:
    tag = uuid.uuid4().hex[:8]
    home = Path(f"/home/swarm-escape-{tag}")
    home.mkdir(mode=0o755, parents=True)
    try:
        (home / ".env").write_text(f"SWARM_API_KEY={SECRET}\n")
        (home / ".env").chmod(0o644)  # anyone on the host may read it: only the box hides it
        out = box.run(f"cat {home}/.env; echo home=$?; ls /home; echo ls=$?")["output"]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert SECRET not in out, out
    assert "No such file or directory" in out
    for name in ("home", "ls"):
        assert re.search(rf"^{name}=[1-9]", out, re.M), out


def test_a_memory_bomb_is_killed_naming_the_limit(box: Box) -> None:
    """Where the runner may make cgroups (root; a user with a delegated one); where it may
    not, its summary says it has no cgroup limits, and why."""
    bomb = "python3 -c 'x = bytearray(512 << 20); print(len(x))'; echo bomb=$?"
    result = box.run(bomb, SWARM_SANDBOX_MEMORY="64M")
    out = result["output"]
    if "no cgroup limits" in result["summary"]:
        assert box.user != "root", result["summary"]
        assert "delegated cgroup" in result["summary"], result["summary"]
        return
    assert "bomb=137" in out, out
    assert "memory limit of 64 MiB (SWARM_SANDBOX_MEMORY)" in out, out
