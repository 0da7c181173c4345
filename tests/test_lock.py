"""constraints.txt, which ./scripts/check installs, is in sync with pyproject.toml:
every dependency is locked, at a version its range admits (./scripts/lock refreshes it)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)")


def locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if match := PIN.match(line):
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def required() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(spec) for spec in
            project["dependencies"] + project["optional-dependencies"]["dev"]]


def test_every_dependency_is_locked_at_a_version_its_range_admits() -> None:
    pins = locked()
    out_of_sync = []
    for requirement in required():
        if requirement.marker and not requirement.marker.evaluate({"python_version": "3.11"}):
            continue
        version = pins.get(canonicalize_name(requirement.name))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            out_of_sync.append(f"{requirement} (locked: {version})")
    assert not out_of_sync, ("constraints.txt is out of sync with pyproject.toml; run "
                             "./scripts/lock: " + ", ".join(out_of_sync))

