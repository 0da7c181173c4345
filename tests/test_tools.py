"""Tool calls the model gets wrong become error strings, never exceptions."""

from __future__ import annotations

import json

from swarm.agent.tools import LOAD_SKILL, RUN_CLI, parse_call

OFFERED = {"run_cli": RUN_CLI, "load_skill": LOAD_SKILL}


def raw(name: str, arguments: object) -> dict[str, object]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_good_call_parses() -> None:
    call = parse_call(raw("run_cli", json.dumps({"command": "ls", "timeout": 5})), OFFERED)
    assert call.error == ""
    assert call.arguments == {"command": "ls", "timeout": 5}
    assert call.id == "c1"


def test_unknown_tool_lists_the_available_ones() -> None:
    call = parse_call(raw("delete_everything", "{}"), OFFERED)
    assert "unknown tool 'delete_everything'" in call.error
    assert "load_skill, run_cli" in call.error


def test_malformed_json_says_where() -> None:
    call = parse_call(raw("run_cli", '{"command": "ls"'), OFFERED)
    assert "not valid JSON" in call.error and "char" in call.error


def test_schema_mismatch_names_each_problem() -> None:
    call = parse_call(raw("run_cli", json.dumps({"command": 3, "cwd": "/"})), OFFERED)
    assert "command: 3 is not of type 'string'" in call.error
    assert "'cwd' was unexpected" in call.error
    missing = parse_call(raw("run_cli", "{}"), OFFERED)
    assert "'command' is a required property" in missing.error


def test_non_object_and_object_arguments() -> None:
    assert "must be a JSON object" in parse_call(raw("run_cli", "[1]"), OFFERED).error
    as_dict = parse_call(raw("run_cli", {"command": "pwd"}), OFFERED)
    assert as_dict.error == "" and as_dict.arguments == {"command": "pwd"}
    assert parse_call(raw("run_cli", ""), OFFERED).error.startswith("error: invalid arguments")
