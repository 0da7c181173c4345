"""Seeding across hosts, with real workers (``swarm worker`` on a "host" of its own, see
:mod:`tests.test_multihost`), the real server and the scripted model: a child asks the
model while its files arrive, and a second fan-out from a repository moves only what
changed."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from swarm.agent import sandbox
from swarm.cli import main
from swarm.store import keys
from swarm.store.connection import connect
from swarm.store.ledger import Ledger
from swarm.store.snapshots import SnapshotStore
from swarm.testing.scripts import ByTask, tool_results
from swarm.testing.server import Reply, ToolCall
from tests import test_multihost
from tests.helpers import wait_until
from tests.test_multihost import Hosts, cli, git_repo, last_result

pytestmark = test_multihost.pytestmark
world = test_multihost.world  # the fixture: a Redis, a coordinator, the model, hosts


def swarm_run(hosts: Hosts, workspace: Path, task: str, *options: str) -> Result:
    """``swarm run`` of ``task`` in ``workspace`` as :func:`tests.test_multihost.swarm_run`
    does, with ``options``."""
    base = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    base.update(SWARM_BASE_URL=hosts.model.base_url, SWARM_REDIS_URL=hosts.url,
                SWARM_HOME=str(workspace.parent / "root-home"), SWARM_API_KEY="k",
                SWARM_RETRIES="1")
    return CliRunner().invoke(main, ["run", "--yes", "--workers", "0", *options, "-C",
                                     str(workspace), task], env=base, catch_exceptions=False)


def fan_out(hosts: Hosts, repo: Path, tag: str, n: int, command: str) -> list[dict[str, Any]]:
    """A root in ``repo`` whose ``n`` children each run ``command``; their results."""
    seen: list[list[dict[str, Any]]] = []

    def collect(request: dict[str, Any]) -> Reply:
        seen.append([json.loads(t) for t in tool_results(request)])
        return Reply(content="all done")

    hosts.model.responder = ByTask({
        f"{tag}-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": f"{tag}-CHILD {i}"},
                                                   id=f"c{i}") for i in range(n)]), collect],
        f"{tag}-CHILD": [cli(command), last_result],
    })
    result = swarm_run(hosts, repo, f"{tag}-ROOT go", "--new")
    assert result.exit_code == 0, result.stderr
    (results,) = seen
    assert [r["state"] for r in results] == ["done"] * n, results
    return results


def latest_seed(url: str) -> str:
    ledger = Ledger(connect(url))
    children = [a for a in ledger.agents(ledger.latest_swarm() or "") if a.kind == "child"]
    (seed,) = {a.seed for a in children}
    return seed


@pytest.mark.parametrize("view", ["auto", "checkout"])
def test_a_childs_first_model_request_goes_out_before_its_files_arrive(
        world: tuple[Hosts, str, Path], tmp_path: Path, view: str) -> None:
    hosts, _url, laptop = world
    flag = tmp_path / "seeding-paused"
    hosts.env["SWARM_FAULT"] = f"worker-seeding:{flag}"  # the worker waits there for us
    hosts.env["SWARM_SEED_VIEW"] = view  # a copy-on-write view (the worker is root) or not
    hosts.start("hosta")
    repo = git_repo(laptop / "repo")
    (repo / "data.txt").write_text("ARRIVED-7\n")
    (repo / "AGENTS.md").write_text("Always answer in haiku.\n")
    asked: list[dict[str, Any]] = []

    def first(request: dict[str, Any]) -> Reply:
        # The worker is still held in its seeding as the child asks the model.
        asked.append({"seeding": flag.exists(), "system": request["messages"][0]["content"]})
        return cli("cat data.txt && ls")

    results: list[dict[str, Any]] = []

    def collect(request: dict[str, Any]) -> Reply:
        results.extend(json.loads(t) for t in tool_results(request))
        return Reply(content=tool_results(request)[0])

    hosts.model.responder = ByTask({
        "AR-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": "AR-CHILD look"},
                                               id="c")]), collect],
        "AR-CHILD": [first, last_result],
    })
    out: list[Result] = []
    runner = threading.Thread(target=lambda: out.append(swarm_run(hosts, repo, "AR-ROOT go")))
    runner.start()
    try:
        wait_until(lambda: flag.exists() or out, "the worker to reach its seeding")
        assert not out, (out[0].stdout, out[0].stderr)
        wait_until(lambda: asked, "the child's first model request while its seeding waits")
    except AssertionError:
        print((hosts.base / "hosta.log").read_text(errors="replace")[-3000:])
        raise
    finally:
        flag.unlink(missing_ok=True)
        runner.join(120)
    assert asked[0]["seeding"], asked
    # Its prompt was made from its snapshot, files or not: the folder's instructions and
    # its top level.
    assert "Always answer in haiku." in asked[0]["system"]
    assert "data.txt" in asked[0]["system"] and "(the workspace does not exist yet)" \
        not in asked[0]["system"]
    (result,) = out
    assert result.exit_code == 0, result.stderr
    # Its command, after the wait, saw its files; what it changed is compared with them.
    assert "ARRIVED-7" in result.stdout and "AGENTS.md" in result.stdout, result.stdout
    (child,) = results
    assert child["state"] == "done" and not child.get("files_changed"), child
    assert "delta" not in child, child  # nothing to send home


def test_a_second_fan_out_after_a_one_file_edit_moves_only_the_change(
        world: tuple[Hosts, str, Path]) -> None:
    hosts, url, laptop = world
    host = hosts.start("hosta")
    repo = git_repo(laptop / "repo")
    for i in range(100):  # 1 MB of hex: ~0.6 MB in a bundle
        (repo / f"f{i:03d}.bin").write_text(os.urandom(5_000).hex())
    fan_out(hosts, repo, "RS1", 2, "wc -c f042.bin")
    store = SnapshotStore(connect(url))
    first = latest_seed(url)
    assert store.hosts(first)[host] > 500_000
    (repo / "f042.bin").write_text((repo / "f042.bin").read_text() + "one more line\n")
    results = fan_out(hosts, repo, "RS2", 2, "wc -c f042.bin")
    assert all("10014 f042.bin" in r["answer"] for r in results), results  # the edit is there
    second = latest_seed(url)
    meta = store.meta(second)
    assert meta is not None and second != first
    # Stored, and moved to the host that held the first, as the change: not 1 MB again.
    assert meta.size < 30_000 and store.hosts(second)[host] < 30_000, (meta, store.hosts(second))
    trees = hosts.base / "disk-hosta" / "seeds" / "trees"
    if (trees / first).is_dir():  # views (a root worker): the second's files link the first's
        assert (trees / second / "f000.bin").stat().st_ino == \
            (trees / first / "f000.bin").stat().st_ino
        assert (trees / second / "f042.bin").read_text().endswith("one more line\n")
    # No run crashed on its way (one whose thread stayed in its view's mount namespace
    # could not leave it once a thread it started lived on: a model call's deadline thread).
    assert " crashed" not in (hosts.base / "hosta.log").read_text()


def processes(*words: bytes) -> list[int]:
    """Pids of this machine's processes whose command line holds every one of ``words``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if all(word in line for word in words):
                found.append(int(entry.name))
    return found


def lone_child(hosts: Hosts, repo: Path, tag: str,
               first: Any) -> tuple[Result, list[dict[str, Any]]]:
    """A root in ``repo`` with one child whose first answer is ``first(request)``: the
    ``swarm run`` and the child's results as its root saw them."""
    results: list[dict[str, Any]] = []

    def collect(request: dict[str, Any]) -> Reply:
        results.extend(json.loads(t) for t in tool_results(request))
        return Reply(content="noted")

    hosts.model.responder = ByTask({
        f"{tag}-ROOT": [Reply(tool_calls=[ToolCall("agent", {"message": f"{tag}-CHILD look"},
                                                   id="c")]), collect],
        f"{tag}-CHILD": [first, last_result],
    })
    return swarm_run(hosts, repo, f"{tag}-ROOT go"), results


def until(check: Any, timeout: float = 30.0) -> bool:
    """Whether ``check()`` came true within ``timeout`` seconds (polled: a model's answer
    waits on it, and must not raise)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(os.geteuid() != 0 or not sandbox.probe().ok,
                    reason="views need a root worker, boxes bubblewrap")
def test_a_view_childs_box_starts_while_its_model_thinks(
        world: tuple[Hosts, str, Path], tmp_path: Path) -> None:
    """A new seeded child's box starts once its workspace (a view) is made, while its model
    thinks, its files arriving after its first request: its model's first answer waits
    until the box runs, which a box started at the first command never would; the command
    then sees its files."""
    hosts, _url, laptop = world
    flag = tmp_path / "seeding-paused"
    hosts.env["SWARM_FAULT"] = f"worker-seeding:{flag}"  # the worker waits there for us
    hosts.start("hosta")
    repo = git_repo(laptop / "repo")
    (repo / "data.txt").write_text("ARRIVED-7\n")
    views_at = str(hosts.home / "workspaces").encode()
    boxed: list[bool] = []

    def first(request: dict[str, Any]) -> Reply:
        seeding = until(flag.exists)  # the worker holds its files back there
        flag.unlink(missing_ok=True)  # they may come now
        boxed.append(seeding and until(lambda: processes(b"bwrap", views_at)))
        return cli("cat data.txt")

    result, results = lone_child(hosts, repo, "BOX", first)
    assert result.exit_code == 0, result.stderr
    assert boxed == [True]
    (child,) = results
    assert child["state"] == "done" and "ARRIVED-7" in child["answer"], child


@pytest.mark.skipif(os.geteuid() != 0, reason="a worker has a mount namespace of its own as root")
def test_a_workers_threads_share_its_mount_namespace(world: tuple[Hosts, str, Path]) -> None:
    """Every thread of a worker works in the mount namespace it mounts views in (a thread
    started before it made that namespace stayed in the host's, and what it started with
    it: boxes, network slots)."""
    hosts, _url, _laptop = world
    name = hosts.start("hosta")
    (pid,) = processes(b"swarm\0worker", f"w@{name}".encode())
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    tasks = list(Path(f"/proc/{pid}/task").iterdir())
    assert len(tasks) > 3
    spaces = {task.name: os.readlink(task / "ns" / "mnt") for task in tasks}
    assert set(spaces.values()) == {os.readlink(f"/proc/{pid}/ns/mnt")}, spaces


def test_a_child_whose_files_never_arrive_fails_saying_so(
        world: tuple[Hosts, str, Path], tmp_path: Path) -> None:
    hosts, url, laptop = world
    flag = tmp_path / "seeding-paused"
    hosts.env["SWARM_FAULT"] = f"worker-seeding:{flag}"
    hosts.start("hosta")
    repo = git_repo(laptop / "repo")
    client = connect(url)

    def first(request: dict[str, Any]) -> Reply:
        # While the worker waits in its seeding, the snapshot goes (expired, say).
        for key in list(client.scan_iter(keys.snapshot("*"))):
            client.delete(key)
        flag.unlink()
        return cli("cat README")

    result, results = lone_child(hosts, repo, "LOST", first)
    assert result.exit_code == 0, result.stderr
    (child,) = results
    assert child["state"] == "failed", child
    assert child["error"].startswith("workspace lost: ") and "not in the store" in \
        child["error"], child
