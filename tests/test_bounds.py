"""What keeps a model call bounded, on its own: its deadline, a cut answer's JSON closed so
its start can be read, and token counts checked against the bytes exchanged."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any

import pytest

from swarm.llm.bounds import ALARMS, Deadline, close_cut_json, implausible_usage
from tests.helpers import wait_until

COMPLETION = {"id": "x", "choices": [{"index": 0, "message": {
    "role": "assistant", "content": 'caf\u00e9 "q" \\ \U0001f600 end',
    "tool_calls": [{"id": "a", "function": {"name": "n", "arguments": '{"a": [1, 2.5]}'}}]},
    "finish_reason": "stop"}], "usage": {"prompt_tokens": 12, "ok": True, "none": None}}


@pytest.mark.parametrize("ascii_only", [True, False])
def test_every_start_of_a_document_closes_into_what_it_held(ascii_only: bool) -> None:
    whole = json.dumps(COMPLETION, ensure_ascii=ascii_only)
    assert close_cut_json(whole) == COMPLETION
    for cut in range(1, len(whole)):
        closed = close_cut_json(whole[:cut])
        assert isinstance(closed, dict), whole[:cut]
        # Nothing made up: the text it holds is the start of the whole one (an escaped
        # surrogate pair cut in two leaves its first half, which the assembler replaces).
        content = _content(closed).removesuffix("\ud83d")
        assert _content(COMPLETION).startswith(content), whole[:cut]


def _content(doc: Any) -> str:
    try:
        return str(doc["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError):
        return ""


def test_a_long_cut_string_closes_fast_and_whole() -> None:
    text = '{"choices": [{"message": {"content": "' + "x\\n" * 2_000_000
    closed = close_cut_json(text)
    assert closed["choices"][0]["message"]["content"] == "x\n" * 2_000_000


@pytest.mark.parametrize("text", ["", "]", "nonsense", '{"a": tru'])
def test_what_cannot_be_read_is_none_or_empty(text: str) -> None:
    assert close_cut_json(text) in (None, {})


@pytest.mark.parametrize(("usage", "why"), [
    (None, ""),
    ({"prompt_tokens": 900, "completion_tokens": 3, "total_tokens": 903}, ""),
    ({"prompt_tokens": 900.0, "completion_tokens": None}, ""),
    ({"prompt_tokens": 10**12}, "1,000,000,000,000 prompt tokens for a request of 1,000 bytes"),
    ({"prompt_tokens": -1}, "prompt_tokens is negative (-1)"),
    ({"completion_tokens": 2.5}, "completion_tokens is '2.5', not a count"),
    ({"completion_tokens": True}, "completion_tokens is 'True', not a count"),
    ({"completion_tokens": 40_000 + 4 * 100 + 1}, "40,401 completion tokens for an answer of "
                                                  "100 characters"),
    ({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 50_000},
     "50,000 tokens in all for 1 prompt and 1 completion tokens"),
    ("lots", "usage is 'lots', not an object"),
])
def test_figures_are_checked_against_the_bytes_exchanged(usage: Any, why: str) -> None:
    assert implausible_usage(usage, 1_000, 100, 40_000) == why


def test_deadlines_open_at_once_share_one_thread() -> None:
    # A thread per model call was a thread start and stop per call in a worker.
    with Deadline(60, lambda: None):
        before = threading.active_count()
        with contextlib.ExitStack() as stack:
            for _ in range(20):
                stack.enter_context(Deadline(60, lambda: None))
            assert threading.active_count() == before


def test_a_deadline_expires_before_a_later_one_and_an_ended_one_never() -> None:
    fired: list[str] = []
    with Deadline(0.05, lambda: fired.append("ended")):
        pass  # its call ended in time
    with Deadline(60, lambda: fired.append("late")) as late, \
            Deadline(0.2, lambda: fired.append("due")) as due:  # due before what is waited for
        wait_until(lambda: due.expired, "the deadline due first to expire", timeout=10)
        assert fired == ["due"] and not late.expired


def test_ended_deadlines_are_not_kept_until_they_are_due() -> None:
    for _ in range(1000):
        with Deadline(1800, lambda: None):
            pass
    assert ALARMS.pending() < 200


def test_a_forked_child_has_none_of_its_parents_deadlines_and_its_own_expire() -> None:
    with Deadline(60, lambda: None):
        pid = os.fork()
        if pid == 0:  # the child: exits 0 when it holds no deadline of its parent's
            code = 1
            try:
                if ALARMS.pending() == 0:
                    with Deadline(0.05, lambda: None) as own:
                        wait_until(lambda: own.expired, "the child's deadline", timeout=10)
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
