"""The deployment files: docker-compose.yml is valid and scalable, .env.example covers it.

``docker-compose config`` runs only where Debian's ``docker-compose`` is installed; the
YAML checks only where PyYAML is importable (neither is a dependency of swarm).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
SERVICES = {"redis", "coordinator", "worker", "flower"}


def env_example() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f"not NAME=value in .env.example: {line!r}"
            out[name.strip()] = value
    return out


def test_env_example_defines_every_compose_variable() -> None:
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", COMPOSE.read_text()))
    missing = used - set(env_example())
    assert not missing, f".env.example lacks {sorted(missing)}"


def test_env_example_has_model_settings_and_only_placeholders() -> None:
    env = env_example()
    for name in ("SWARM_BASE_URL", "SWARM_MODEL", "SWARM_API_KEY", "REDIS_PASSWORD",
                 "FLOWER_BASIC_AUTH", "SWARM_MAX_DEPTH", "SWARM_MAX_CHILDREN",
                 "SWARM_MAX_PARALLEL"):
        assert name in env, name
    for name in ("SWARM_API_KEY", "REDIS_PASSWORD", "FLOWER_BASIC_AUTH"):
        assert "replace" in env[name], f"{name} must be a placeholder"


def test_dockerignore_keeps_env_out_of_the_image() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ".env" in ignored


def test_docker_compose_config(tmp_path: Path) -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose (Debian package) is not on PATH")
    # The compose file reads .env as env_file: validate a copy with .env.example as .env.
    shutil.copy(COMPOSE, tmp_path / "docker-compose.yml")
    shutil.copy(ENV_EXAMPLE, tmp_path / ".env.example")
    shutil.copy(ENV_EXAMPLE, tmp_path / ".env")
    done = subprocess.run(
        [exe, "-f", "docker-compose.yml", "--env-file", ".env.example", "config"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    services = subprocess.run(
        [exe, "-f", "docker-compose.yml", "--env-file", ".env.example", "config", "--services"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert services.returncode == 0, services.stderr
    assert set(services.stdout.split()) >= SERVICES
    worker = re.search(r"^  worker:\n((?:    .*\n|\s*\n)*)", done.stdout, re.MULTILINE)
    assert worker is not None, done.stdout
    # --scale worker=N: no fixed host port, no fixed container name.
    assert "    ports:" not in worker[1] and "container_name" not in worker[1]
    assert "    command: worker --concurrency" in worker[1]


def test_compose_structure() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, dict[str, Any]] = doc["services"]
    assert set(services) >= SERVICES
    worker = services["worker"]
    assert "ports" not in worker and "container_name" not in worker
    assert worker["command"].startswith("worker --concurrency")
    assert any(str(v).endswith(":/var/lib/swarm") for v in worker["volumes"])
    for name in ("coordinator", "worker", "flower"):
        service = services[name]
        assert service["env_file"] == ".env"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["restart"]
        url = service["environment"]["SWARM_REDIS_URL"]
        assert url.startswith("redis://:${REDIS_PASSWORD") and url.endswith("@redis:6379/0")
    redis = services["redis"]
    assert "--requirepass ${REDIS_PASSWORD" in redis["command"]
    assert "--appendonly yes" in redis["command"]
    assert "healthcheck" in redis
    assert "--basic-auth ${FLOWER_BASIC_AUTH" in services["flower"]["command"]
    assert "5555:5555" in services["flower"]["ports"]
    assert {"workspaces", "redis-data"} <= set(doc["volumes"])
