"""What keeps one model call bounded whatever the server does: a deadline on the whole call
(:class:`Deadline`), a cut answer's JSON closed so its start can be read
(:func:`close_cut_json`), and token counts checked against the bytes exchanged
(:func:`implausible_usage`, :func:`estimated_usage`)."""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from swarm.domain.messages import CHARS_PER_TOKEN, TOKENS_BEYOND_BYTES, Usage

log = logging.getLogger(__name__)

BYTES_PER_CHAR = 6
"""Bytes of JSON one character of an answer may take (``\\u00e9``): a body or stream event
may hold this many bytes per character of ``SWARM_ANSWER_MAX`` (plus :data:`ENVELOPE`)."""
ENVELOPE = 1 << 20
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*', re.S)
"""A string from its opening quote up to its closing one (or to where the text ends: a
lone backslash there, half an escape, is left out)."""
_OTHER = re.compile(r'[^"{}\[\],:]+')
UNSEEN_TOKENS = 1_000_000
"""Completion tokens an answer may count beyond what it shows (hidden reasoning) when the
model's context length is not known."""


class Deadline:
    """The end of one try of a model call, ``seconds`` after it starts: then ``abort`` runs
    (from the process's alarm thread, :class:`Alarms`: it shuts the call's sockets, so a
    blocked read returns at once) and :attr:`expired` is set. Use as a context manager
    around the try."""

    def __init__(self, seconds: float, abort: Callable[[], object]) -> None:
        self.seconds = seconds
        self.expired = False
        self.received = 0
        """Bytes of the answer read so far (by :meth:`chunks`)."""
        self._abort = abort
        self.done = False
        """Its try ended (or it expired): it is no longer due."""

    def expire(self) -> None:
        self.expired = True
        self._abort()

    def __enter__(self) -> Deadline:
        ALARMS.add(time.monotonic() + self.seconds, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        ALARMS.cancel(self)

    def chunks(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """``chunks``, counted in :attr:`received`; raises :class:`PastDeadline` once the
        deadline has passed."""
        for chunk in chunks:
            self.received += len(chunk)
            if self.expired:
                raise PastDeadline
            yield chunk


class Alarms:
    """One thread that expires every :class:`Deadline` of the process when it is due, a
    thread a call was a thread start and stop per model call (a worker makes thousands).

    A deadline whose call ended stays in the heap until it is due or until most entries
    are such (then they are dropped at once): calls end long before their deadline."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No deadline, no thread: a new process's (a forked child has none of the parent's
        calls, nor its thread, and maybe a lock another of its threads held)."""
        self._heap: list[tuple[float, int, Deadline]] = []
        self._ended = 0
        """Entries of the heap whose deadline is done."""
        self._count = itertools.count()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None

    def add(self, when: float, deadline: Deadline) -> None:
        """Expire ``deadline`` at ``when`` (``time.monotonic()``) unless cancelled first."""
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._count), deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="swarm-deadlines",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0][2] is deadline:  # due before what the thread waits for
                self._cond.notify()

    def cancel(self, deadline: Deadline) -> None:
        with self._cond:
            if deadline.done:
                return
            deadline.done = True
            self._ended += 1
            if self._ended > 64 and 2 * self._ended > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].done]
                heapq.heapify(self._heap)
                self._ended = 0

    def pending(self) -> int:
        """Entries the heap holds (ended ones included)."""
        with self._cond:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._next_due()
                due.done = True
            try:
                due.expire()
            except Exception:  # the thread must outlive one broken abort
                log.exception("aborting a model call at its deadline failed")

    def _next_due(self) -> Deadline:
        """Wait (the lock held) for the next deadline due and not done, and pop it."""
        while True:
            while self._heap and self._heap[0][2].done:
                heapq.heappop(self._heap)
                self._ended -= 1
            now = time.monotonic()
            if self._heap and self._heap[0][0] <= now:
                return heapq.heappop(self._heap)[2]
            self._cond.wait(self._heap[0][0] - now if self._heap else None)


ALARMS = Alarms()
os.register_at_fork(after_in_child=ALARMS.reset)


class PastDeadline(Exception):
    """A call's :class:`Deadline` passed while its answer was read."""


def close_cut_json(text: str) -> Any:
    """The JSON document of which ``text`` is the start, closed where it was cut: an open
    string value ends there, a half-written key or number is dropped with what follows, open
    objects and arrays are closed. None when nothing can be made of it."""
    stack: list[str] = []  # "{" or "[", and for "{" whether a key comes next
    expect_key: list[bool] = []
    keep = (0, "")  # the longest prefix known to close, and what closes it
    pos, size = 0, len(text)
    while pos < size:
        c = text[pos]
        if c == '"':
            end = _STRING.match(text, pos).end()  # type: ignore[union-attr]
            key = bool(stack) and stack[-1] == "{" and expect_key[-1]
            if end >= size or text[end] != '"':  # cut inside the string
                if key:
                    break
                for drop in range(6):  # a half escape (\\u00) at the cut is dropped
                    found = _loads(text[:end - drop] + '"' + _closers(stack))
                    if found is not None:
                        return found
                return None
            pos = end + 1
            if not key:
                keep = (pos, _closers(stack))
            continue
        if c in "{[":
            stack.append(c)
            expect_key.append(c == "{")
            keep = (pos + 1, _closers(stack))
        elif c in "}]":
            if not stack:
                return None
            stack.pop()
            expect_key.pop()
            keep = (pos + 1, _closers(stack))
        elif c == ",":
            keep = (pos, _closers(stack))
            if stack and stack[-1] == "{":
                expect_key[-1] = True
        elif c == ":" and stack:
            expect_key[-1] = False
        else:
            pos = _OTHER.match(text, pos).end()  # type: ignore[union-attr]
            continue
        pos += 1
    return _loads(text[:keep[0]] + keep[1])


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _closers(stack: list[str]) -> str:
    return "".join("}" if c == "{" else "]" for c in reversed(stack))


def implausible_usage(raw: Any, sent: int, received: int, context: int | None) -> str:
    """Why the ``usage`` a server reported cannot be true of a request of ``sent`` bytes and
    an answer of ``received`` characters; "" when it may be (or none was reported).

    A token is at least a byte of what was sent, give or take the chat template
    (:data:`~swarm.domain.messages.TOKENS_BEYOND_BYTES`); an answer counts at most four tokens
    a character it shows, plus what it may think unseen: ``context`` (the model's context
    length, when known), else :data:`UNSEEN_TOKENS`."""
    if raw is None:
        return ""
    if not isinstance(raw, dict):
        return f"usage is {str(raw)[:40]!r}, not an object"
    counts: dict[str, int] = {}
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name} is {str(value)[:40]!r}, not a count"
        if value < 0:
            return f"{name} is negative ({value:,})"
        counts[name] = value
    prompt = counts.get("prompt_tokens", 0)
    completion = counts.get("completion_tokens", 0)
    unseen = context or UNSEEN_TOKENS
    if prompt > sent + TOKENS_BEYOND_BYTES:
        return f"{prompt:,} prompt tokens for a request of {sent:,} bytes"
    if completion > 4 * received + unseen:
        return f"{completion:,} completion tokens for an answer of {received:,} characters"
    if counts.get("total_tokens", 0) > prompt + completion + unseen:
        return (f"{counts['total_tokens']:,} tokens in all for {prompt:,} prompt and "
                f"{completion:,} completion tokens")
    return ""


def estimated_usage(sent: int, received: int) -> Usage:
    """swarm's own count of a call: about four characters (here bytes sent) a token."""
    prompt = sent // CHARS_PER_TOKEN
    completion = max(1, received // CHARS_PER_TOKEN)
    return Usage(prompt, completion, prompt + completion)
