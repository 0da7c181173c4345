"""Settings: precedence flag > SWARM_* > OPENAI_* > EVA_* > default, and bad values."""

from __future__ import annotations

import pytest

from swarm.config import Settings
from swarm.errors import ConfigError


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


def test_the_api_key_never_shows() -> None:
    s = Settings.from_env({"SWARM_API_KEY": "sk-very-secret"})
    assert "sk-very-secret" not in repr(s)
    assert "sk-very-secret" not in str(s)


@pytest.mark.parametrize(("env", "message"), [
    ({"SWARM_MAX_TURNS": "many"}, "SWARM_MAX_TURNS='many' is not a valid int"),
    ({"SWARM_MAX_TURNS": "-1"}, "SWARM_MAX_TURNS must be 0 or more"),
    ({"SWARM_READ_TIMEOUT": "0"}, "SWARM_READ_TIMEOUT must be a positive number"),
    ({"SWARM_YES": "perhaps"}, "SWARM_YES='perhaps' is not a valid bool"),
    ({"SWARM_BASE_URL": "localhost:8080"}, "is not an http(s) URL"),
    ({"SWARM_APPROVAL": "run_cli"}, "is not TOOL=POLICY"),
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
