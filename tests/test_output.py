"""A structured answer: the task asks for the schema's shape, the answer is checked."""

from __future__ import annotations

import json

from swarm.agent.output import ask_for, check_output, retry_message

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_a_matching_answer_gives_its_value_also_in_a_code_fence() -> None:
    assert check_output('{"n": 3}', SCHEMA) == ({"n": 3}, "")
    assert check_output('```json\n{"n": 3}\n```', SCHEMA) == ({"n": 3}, "")


def test_prose_is_not_json_and_says_where() -> None:
    value, problem = check_output("Here it is: 3", SCHEMA)
    assert value is None and problem.startswith("the answer is not JSON (")


def test_a_mismatch_names_the_path_and_the_rule() -> None:
    value, problem = check_output('{"n": "three"}', SCHEMA)
    assert value is None and problem == "n: 'three' is not of type 'integer'"
    assert check_output("{}", SCHEMA)[1] == "'n' is a required property"


def test_the_task_carries_the_schema_only_when_there_is_one() -> None:
    assert ask_for("count", None) == "count"
    asked = ask_for("count", SCHEMA)
    assert asked.startswith("count\n\nYour final answer must be ONLY a JSON value")
    assert asked.endswith(json.dumps(SCHEMA))
    assert "n: bad" in retry_message("n: bad")
