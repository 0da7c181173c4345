"""Settings: precedence flag > SWARM_* > OPENAI_* > EVA_* > default, bad values, and the
API key that never shows."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.config import Settings
from swarm.errors import ConfigError
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall


def test_precedence_of_sources() -> None:
    env = {"EVA_BASE_URL": "http://eva/v1", "OPENAI_BASE_URL": "http://openai/v1",
           "EVA_MODEL_NAME": "eva-model", "EVA_API_KEY": "eva-key"}
    s = Settings.from_env(env)
    assert s.base_url == "http://openai/v1"
    assert s.model == "eva-model"
    assert s.api_key.reveal() == "eva-key"
    s = Settings.from_env({**env, "SWARM_BASE_URL": "http://swarm/v1"})
    assert s.base_url == "http://swarm/v1"
    s = Settings.from_env({**env, "SWARM_BASE_URL": "http://swarm/v1"},
                          base_url="http://flag/v1", model=None)
    assert s.base_url == "http://flag/v1" and s.model == "eva-model"


def test_empty_variables_count_as_unset() -> None:
    s = Settings.from_env({"SWARM_MODEL": "", "OPENAI_MODEL": "gpt"})
    assert s.model == "gpt"


def test_explicit_lists_what_was_given_not_defaults() -> None:
    s = Settings.from_env({"SWARM_MAX_DEPTH": "2"}, yes=True, model=None)
    assert s.explicit == {"max_depth", "yes"}
    assert s.with_(base_url="http://x/v1").explicit == {"max_depth", "yes", "base_url"}
    assert Settings.from_env({}).explicit == frozenset()


def test_every_agent_has_a_turn_limit_by_default() -> None:
    s = Settings.from_env({})
    assert s.turn_limit(child=False) == (200, "SWARM_MAX_TURNS")
    assert s.turn_limit(child=True) == (50, "SWARM_CHILD_MAX_TURNS")
    assert s.repeat_limit == 3
    # A lower SWARM_MAX_TURNS bounds children too; 0 lifts a cap.
    low = Settings.from_env({"SWARM_MAX_TURNS": "10"})
    assert low.turn_limit(child=True) == (10, "SWARM_MAX_TURNS")
    free = Settings.from_env({"SWARM_MAX_TURNS": "0", "SWARM_CHILD_MAX_TURNS": "0"})
    assert free.turn_limit(child=False) == free.turn_limit(child=True) == (0, "")


KEY = "sk-very-secret-4242"


def test_the_api_key_never_shows(caplog: pytest.LogCaptureFixture) -> None:
    """Not in a repr, nor in a log line however it is formatted, nor in an f-string."""
    s = Settings.from_env({"SWARM_API_KEY": KEY})
    key = s.api_key
    caplog.set_level(logging.DEBUG)
    log = logging.getLogger("swarm.test")
    log.info("%s", key)
    log.debug("key %r, settings %s, %r", key, s, s)
    log.warning("%-30s|%s", key, [key])
    log.error(key)
    # every way of formatting a string, on purpose
    formatted = ["%s" % key, "{}".format(key)]  # noqa: UP031, UP032
    shown = [repr(s), str(s), str(key), f"{key}", f"{key:>40}", *formatted,
             caplog.text, *(r.getMessage() for r in caplog.records)]
    assert [text for text in shown if KEY in text] == []
    assert "***" in caplog.records[0].getMessage()
    assert key.reveal() == KEY  # the one way to the value, for the Authorization header


def test_swarm_run_vv_never_prints_the_api_key(model_server: ScriptedModelServer,
                                               redis_server: str, tmp_path: Path) -> None:
    """A real ``swarm -vv run`` (debug logging to stderr) with the key the model requires:
    the run works, so the key was sent, and neither stdout nor stderr shows it."""
    model_server.require_key = KEY
    model_server.script(Reply(tool_calls=[ToolCall("run_cli", {"command": "echo ran"})]),
                        Reply(content="all done"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
    env.update(SWARM_BASE_URL=model_server.base_url, SWARM_MODEL=model_server.models[0],
               SWARM_API_KEY=KEY, SWARM_REDIS_URL=redis_server, SWARM_HOME=str(tmp_path / "h"),
               SWARM_WORKERS="0")
    done = subprocess.run([sys.executable, "-m", "swarm", "-vv", "run", "-y", "-C", str(tmp_path),
                           "say", "done"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "all done\n"
    assert "DEBUG" in done.stderr  # -vv did log
    assert KEY not in done.stdout and KEY not in done.stderr


def test_with_validates_like_from_env() -> None:
    base = Settings.from_env({})
    with pytest.raises(ConfigError, match="SWARM_COMPACT_AT"):
        base.with_(compact_at=2.0)
    with pytest.raises(ConfigError, match="SWARM_MAX_PARALLEL must be a positive number"):
        base.with_(max_parallel=0)
    with pytest.raises(ConfigError, match="approval policy 'sometimes'"):
        base.with_(approval={"run_cli": "sometimes"})
    assert base.with_(max_parallel=3).max_parallel == 3


@pytest.mark.parametrize(("env", "message"), [
    ({"SWARM_MAX_TURNS": "many"}, "SWARM_MAX_TURNS='many' is not a valid int"),
    ({"SWARM_MAX_TURNS": "-1"}, "SWARM_MAX_TURNS must be 0 or more"),
    ({"SWARM_READ_TIMEOUT": "0"}, "SWARM_READ_TIMEOUT must be a positive number"),
    ({"SWARM_YES": "perhaps"}, "SWARM_YES='perhaps' is not a valid bool"),
    ({"SWARM_BASE_URL": "localhost:8080"}, "is not an http(s) URL"),
    ({"SWARM_APPROVAL": "run_cli"}, "is not TOOL=POLICY"),
    ({"SWARM_SANDBOX_UID": "0"}, "SWARM_SANDBOX_UID=0 is not an unprivileged uid"),
])
def test_bad_values_say_what_is_wrong(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)


def test_knobs_read_elsewhere_leave_settings_alone() -> None:
    """SWARM_WORKERS, SWARM_SERVE_PORT, ... have knobs for their docs, but the commands that
    read them parse them: Settings neither reads them nor fails on them."""
    env = {"SWARM_WORKERS": "many", "SWARM_SERVE_PORT": "x", "SWARM_PRICE_INPUT": "free",
           "SWARM_FAULT": "somewhere"}
    assert Settings.from_env(env) == Settings.from_env({})
    assert Settings.from_env(env).explicit == frozenset()
    with pytest.raises(ConfigError, match="unknown setting 'workers'"):
        Settings.from_env({}, workers=2)
