"""probe_environment: host facts, cached tool versions, a capped workspace listing."""

from __future__ import annotations

import platform
import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from swarm.agent import probe
from swarm.agent.probe import probe_environment, workspace_listing


def test_probe_names_date_os_shell_and_listing(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "README.md").write_text("hi")
    before = datetime.now().astimezone()
    text = probe_environment(tmp_path)
    after = datetime.now().astimezone() + timedelta(seconds=1)
    assert f"{before:%Y-%m-%d}" in text or f"{after:%Y-%m-%d}" in text
    os_line = next(ln for ln in text.splitlines() if ln.startswith("os: "))
    assert platform.system() in os_line
    assert "shell: GNU bash, version" in text
    assert "python3: Python 3." in text
    assert text.endswith("README.md\nsrc/")
    assert str(tmp_path) in text


def test_listing_capped_at_100_entries(tmp_path: Path) -> None:
    for i in range(300):
        (tmp_path / f"f{i:03d}.txt").touch()
    (tmp_path / "a_dir").mkdir()
    lines = workspace_listing(tmp_path).splitlines()
    assert lines[0] == "a_dir/"
    assert lines[1:100] == [f"f{i:03d}.txt" for i in range(99)]
    assert lines[100] == "[... 201 more entries not shown; use ls]"
    assert len(lines) == 101


def test_listing_capped_at_2000_chars(tmp_path: Path) -> None:
    for i in range(300):
        (tmp_path / f"{i:03d}_{'x' * 60}").touch()
    text = workspace_listing(tmp_path)
    body, _, note = text.rpartition("\n")
    shown = body.splitlines()
    assert len(body) <= 2000
    assert len(shown) == 2000 // 65  # 64-char names plus a newline each
    assert note == f"[... {300 - len(shown)} more entries not shown; use ls]"


def test_listing_of_missing_or_empty_workspace(tmp_path: Path) -> None:
    assert workspace_listing(tmp_path) == "(empty)"
    assert "does not exist" in workspace_listing(tmp_path / "missing")


def test_tool_versions_probed_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = probe._version

    def counting(path: str, args: tuple[str, ...]) -> str:
        calls.append(path)
        return real(path, args)

    monkeypatch.setattr(probe, "_version", counting)
    probe.clear_cache()
    runs = probe.probe_runs
    threads = [threading.Thread(target=probe_environment, args=(tmp_path,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = len(calls)
    assert first >= 2  # bash and python3 at least
    assert len(set(calls)) == first
    probe_environment(tmp_path)
    assert len(calls) == first
    assert probe.probe_runs == runs + 1
    (tmp_path / "new_file").touch()
    assert "new_file" in probe_environment(tmp_path)  # the listing is not cached


def test_tool_versions_kept_on_disk_until_a_tool_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir, cache = tmp_path / "bin", tmp_path / "home" / "cache" / "tools.json"
    bin_dir.mkdir()
    tool = bin_dir / "jq"
    tool.write_text("#!/bin/sh\necho jq-9.9\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    probe.clear_cache()
    runs = probe.probe_runs
    assert probe.tool_versions(cache) == {"jq": "jq-9.9"}
    assert probe.probe_runs == runs + 1 and cache.exists()
    probe.clear_cache()  # a new process: only the file remembers
    assert probe.tool_versions(cache) == {"jq": "jq-9.9"}
    assert probe.probe_runs == runs + 1  # not probed again
    tool.write_text("#!/bin/sh\necho jq-10.0 upgraded\n")  # another size: a new tool
    probe.clear_cache()
    assert probe.tool_versions(cache) == {"jq": "jq-10.0 upgraded"}
    assert probe.probe_runs == runs + 2
    probe.clear_cache()
