"""What happened in a chaos campaign, read from the evidence it left, never from the swarm's
reports of itself: the journal of the children's commands (:mod:`bench.chaos_journal`),
the scripted model's
request log, and Redis (its append-only file, which holds every write in order with the
server's clock inside, and its keys).

From the append-only file: each run's claims (``running_since`` is the server's ``TIME``
at the claim, the lease token and the host of the claim ride along), parks and
settlements (stamped by the id of the stream entry written with them), and lease
renewals (``lease_until`` minus the lease). :func:`check` turns all of it into a list of
:class:`Violation`; :func:`fault_rows` into the table per fault kind.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_PREFIX = b"swarm:run:"
AGENT_PREFIX = b"swarm:agent:"
SETTLED = {b"done", b"failed", b"cancelled", b"timed_out"}


# -- the append-only file ----------------------------------------------------------------------


def resp_commands(data: bytes) -> Iterator[list[bytes]]:
    """The commands of an append-only file (RESP arrays of bulk strings); a truncated last
    command (the server was killed mid-write) is skipped."""
    pos, size = 0, len(data)
    while pos < size:
        if data[pos:pos + 1] != b"*":
            end = data.find(b"\n", pos)  # an annotation line (#TS:...)
            if end < 0:
                return
            pos = end + 1
            continue
        end = data.find(b"\r\n", pos)
        if end < 0:
            return
        count = int(data[pos + 1:end])
        pos = end + 2
        args: list[bytes] = []
        for _ in range(count):
            end = data.find(b"\r\n", pos)
            if end < 0 or data[pos:pos + 1] != b"$":
                return
            length = int(data[pos + 1:end])
            start = end + 2
            if start + length + 2 > size:
                return
            args.append(data[start:start + length])
            pos = start + length + 2
        yield args


def aof_data(folder: Path) -> bytes:
    """The append-only file's parts in the manifest's order (base first, then increments)."""
    manifest = next(iter(sorted(folder.glob("*.manifest"))), None)
    if manifest is None:
        return b""
    parts: list[tuple[int, int, str]] = []
    for line in manifest.read_text().splitlines():
        words = line.split()
        fields = dict(zip(words[::2], words[1::2], strict=False))
        if "file" in fields:
            kind = 0 if fields.get("type") == "b" else 1
            parts.append((kind, int(fields.get("seq", 0)), fields["file"]))
    out = b""
    for _, _, name in sorted(parts):
        data = (folder / name).read_bytes()
        if not data.startswith(b"REDIS"):  # an RDB preamble holds no history
            out += data
    return out


@dataclass(order=True)
class Mark:
    """One step of a run's life on the server's clock."""

    time: float
    kind: str
    """``claim``, ``renew``, ``park`` or ``settle``."""
    run: str = field(compare=False)
    token: str = field(default="", compare=False)
    host: str = field(default="", compare=False)
    state: str = field(default="", compare=False)


def _stream_time(entry_id: bytes) -> float | None:
    try:
        return int(entry_id.split(b"-", 1)[0]) / 1000
    except ValueError:
        return None


def marks(commands: Iterable[list[bytes]], lease: float) -> list[Mark]:
    """Every claim, renewal, park and settlement of a run, in the file's order."""
    out: list[Mark] = []
    block: list[list[bytes]] = []
    inside = False
    for cmd in commands:
        name = cmd[0].upper()
        if name == b"MULTI":
            inside, block = True, []
            continue
        if name == b"EXEC":
            inside = False
            out.extend(_block_marks(block, lease))
            continue
        if inside:
            block.append(cmd)
        else:
            out.extend(_block_marks([cmd], lease))
    return out


def _block_marks(block: list[list[bytes]], lease: float) -> list[Mark]:
    stamp: float | None = None
    hosts = [dict(zip(c[2::2], c[3::2], strict=False)).get(b"host") for c in block
             if c[0].upper() == b"HSET" and c[1].startswith(AGENT_PREFIX)]
    host = next((h.decode() for h in hosts if h), "")
    for cmd in block:  # a stream entry written with it: its id is the server's time in ms
        if cmd[0].upper() == b"XADD":
            ids = [a for a in cmd[2:] if re.fullmatch(rb"\d+-\d+", a)]
            if ids:
                stamp = _stream_time(ids[0])
    found: list[Mark] = []
    for cmd in block:
        verb = cmd[0].upper()
        if len(cmd) < 3:
            continue
        if verb == b"HSET" and cmd[1].startswith(RUN_PREFIX):
            run = cmd[1][len(RUN_PREFIX):].decode()
            fields = dict(zip(cmd[2::2], cmd[3::2], strict=False))
            state = fields.get(b"state")
            if state == b"running" and b"running_since" in fields:
                found.append(Mark(float(fields[b"running_since"]), "claim", run,
                                  fields.get(b"lease", b"").decode(), host))
            elif state in SETTLED and b"settled" in fields:
                found.append(Mark(stamp or 0.0, "settle", run, state=state.decode()))
            elif state == b"parked":
                found.append(Mark(stamp or 0.0, "park", run))
            elif set(fields) == {b"lease_until"}:
                found.append(Mark(float(fields[b"lease_until"]) - lease, "renew", run))
    return found


def fill_times(found: list[Mark]) -> list[Mark]:
    """Marks without a time of their own (0) get the last time before them in the file."""
    last = 0.0
    for mark in found:
        if mark.time:
            last = max(last, mark.time) if mark.kind != "renew" else last
        else:
            mark.time = last
    return found


# -- the journal -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One line a command sent: ``J tag p c k time host pid`` (c = -1: a parent), the
    command's own time and host name, and the pid of the worker that ran it (0: unknown),
    then ``sender=PID at=TIME`` (when the collector received it, laptop's clock)."""

    parent: int
    child: int
    turn: int
    time: float
    """On the laptop's clock (a host's clock offset taken off)."""
    host: str
    pid: int
    received: float = 0.0


def journal(path: Path, offsets: dict[str, float]) -> list[Line]:
    out: list[Line] = []
    if not path.exists():
        return out
    for raw in path.read_text(errors="replace").splitlines():
        words = raw.split()
        if len(words) < 8 or words[0] != "J":
            continue
        extra = dict(w.split("=", 1) for w in words[8:] if "=" in w)
        try:
            host = words[6]
            out.append(Line(int(words[2][1:]), int(words[3][1:]), int(words[4][1:]),
                            float(words[5]) - offsets.get(host, 0.0), host, int(words[7]),
                            float(extra.get("at", 0.0))))
        except ValueError:
            continue
    return out


# -- invariants --------------------------------------------------------------------------------


@dataclass
class Violation:
    invariant: str
    text: str
    run: str = ""


@dataclass
class Life:
    """A worker process: where, its pid, from when (started) until when (killed or stopped)."""

    host: str
    pid: int
    started: float
    ended: float = float("inf")


def holder_pid(lives: list[Life], host: str, at: float) -> int:
    """The worker process alive on ``host`` at ``at`` (0: none)."""
    for life in lives:
        if life.host == host and life.started <= at <= life.ended:
            return life.pid
    return 0


#: Seconds between a worker's kill and its box's end within which a line that found no
#: worker (pid 1: its box orphaned as the collector looked) is its own dying command.
ORPHANED_BY_KILL = 0.5


def killed_then(lives: list[Life], host: str, pid: int, at: float) -> bool:
    """Whether worker ``pid`` of ``host`` was killed within :data:`ORPHANED_BY_KILL`
    seconds of ``at`` (its end is noted once it was reaped, a moment after)."""
    return any(life.host == host and life.pid == pid and
               abs(life.ended - at) <= ORPHANED_BY_KILL for life in lives)


def zombies(lines: list[Line], runs: dict[tuple[int, int], str], timeline: dict[str, list[Mark]],
            lives: list[Life]) -> list[Violation]:
    """Journal lines written when their attempt no longer held the run: after another
    claim, a park or the settlement (an attempt is a worker process: host and pid; a line
    whose worker is unknown, pid 0, is checked against the claim's host only). A line
    whose box was orphaned as the collector looked (pid 1) is its holder's when the holder
    was killed that very moment (its box dies with it a few ms later); else a box outlived
    its worker, a zombie."""
    out: list[Violation] = []
    for line in lines:
        run = runs.get((line.parent, line.child))
        if run is None:
            out.append(Violation("zombie", f"journal line of an unknown agent: {line}"))
            continue
        before = [m for m in timeline.get(run, []) if m.kind != "renew" and m.time <= line.time]
        if not before:
            out.append(Violation("zombie", f"{line} before the run was first claimed", run))
            continue
        last = before[-1]
        if last.kind != "claim":
            out.append(Violation("zombie", f"{line} after the run was {last.kind}d "
                                           f"({last.time:.3f})", run))
            continue
        owner = (last.host, holder_pid(lives, last.host, last.time))
        if line.pid == 1 and line.host == owner[0] and \
                killed_then(lives, owner[0], owner[1], line.time):
            continue
        if owner != (line.host, line.pid if line.pid else owner[1]):
            out.append(Violation("zombie", f"{line} while the run was held by {owner} "
                                           f"(claimed {last.time:.3f})", run))
    return out


def clock_skewed(lines: list[Line], tolerance: float = 10.0) -> list[Violation]:
    """Lines whose own time (its host's offset taken off) is more than ``tolerance``
    seconds from when the collector got them: the offset assumed for their host is wrong
    (say, a command ran under libfaketime where the campaign thought not), and the zombie
    check would read their times wrong."""
    return [Violation("journal clock", f"{line} received at {line.received:.3f}")
            for line in lines if line.received and abs(line.time - line.received) > tolerance]


def settled_once(timeline: dict[str, list[Mark]], run_ids: Iterable[str],
                 events: Counter[str], agent_of: dict[str, str]) -> list[Violation]:
    """Each run settled exactly once (the append-only file), done, with one ``settled``
    event of its agent (the swarm's event stream)."""
    out: list[Violation] = []
    for run in run_ids:
        settles = [m for m in timeline.get(run, []) if m.kind == "settle"]
        if len(settles) != 1:
            out.append(Violation("settled once", f"run {run} settled {len(settles)} times", run))
        elif settles[0].state != "done":
            out.append(Violation("settled once", f"run {run} settled {settles[0].state}", run))
        agent = agent_of.get(run, "")
        if events[agent] != 1:
            out.append(Violation("settled once", f"agent {agent}: {events[agent]} settled "
                                                 "events", run))
    return out


def results_in_order(requests: list[dict[str, Any]], expected: list[str],
                     who: str, run: str = "") -> list[Violation]:
    """The requests a parent made after its children settled hold each child's result
    exactly once, in the order of its calls."""
    if not requests:
        return [Violation("results in order", f"{who} never got its children's results", run)]
    out: list[Violation] = []
    for request in requests:
        answers = []
        for text in _tool_results(request):
            try:
                answers.append(str(json.loads(text).get("answer", "")))
            except (ValueError, AttributeError):
                answers.append(text[:60])
        if answers != expected:
            missing = [a for a in expected if a not in answers]
            twice = [a for a, n in Counter(answers).items() if n > 1]
            out.append(Violation("results in order", f"{who}: {len(answers)} results, "
                                 f"missing {missing[:3]}, twice {twice[:3]}", run))
    return out


def _tool_results(request: dict[str, Any]) -> list[str]:
    """The results answering the last assistant message that made tool calls (a note the
    worker added after them, on a takeover, may follow them)."""
    return call_results(request)


def call_results(request: dict[str, Any]) -> list[str]:
    """The tool results right after the last assistant message with tool calls."""
    messages = request.get("messages") or []
    last = max((i for i, m in enumerate(messages)
                if m.get("role") == "assistant" and m.get("tool_calls")), default=-1)
    out: list[str] = []
    for message in messages[last + 1:] if last >= 0 else []:
        if message.get("role") != "tool":
            break
        content = message.get("content")
        out.append(content if isinstance(content, str) else json.dumps(content))
    return out


def paired(agent: str, raw: str | None) -> list[Violation]:
    """A session's messages (as stored) answer every tool call once, in place."""
    if raw is None:
        return [Violation("sessions", f"session of {agent} missing")]
    try:
        messages = json.loads(raw)
    except ValueError as exc:
        return [Violation("sessions", f"session of {agent} does not load: {exc}")]
    out: list[Violation] = []
    open_ids: list[str] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            call = message.get("tool_call_id")
            if call in open_ids:
                open_ids.remove(call)
            else:
                out.append(Violation("sessions", f"{agent}: tool result {call} for no call"))
            continue
        if open_ids:
            out.append(Violation("sessions", f"{agent}: calls {open_ids} left unanswered"))
            open_ids = []
        if role == "assistant":
            open_ids = [c.get("id") for c in message.get("tool_calls") or []]
    if open_ids:
        out.append(Violation("sessions", f"{agent}: calls {open_ids} left unanswered"))
    return out


def secrets_in(secret: str, sources: dict[str, bytes]) -> list[Violation]:
    needle = secret.encode()
    return [Violation("no API key", f"the API key is in {name}")
            for name, data in sources.items() if needle in data]


# -- the table ----------------------------------------------------------------------------------


@dataclass
class Injected:
    """One fault: its kind, target, and when it began and ended (laptop clock)."""

    kind: str
    target: str
    start: float
    end: float
    pid: int = 0


@dataclass
class Row:
    kind: str
    injected: int = 0
    affected: set[str] = field(default_factory=set)
    recovered: set[str] = field(default_factory=set)
    times: list[float] = field(default_factory=list)
    violations: int = 0

    def cells(self) -> list[str]:
        med = f"{statistics.median(self.times):.1f}" if self.times else "-"
        top = f"{max(self.times):.1f}" if self.times else "-"
        return [self.kind, str(self.injected), str(len(self.affected)),
                str(len(self.recovered)), med, top, str(self.violations)]


def _held(timeline: list[Mark], at: float) -> Mark | None:
    before = [m for m in timeline if m.kind != "renew" and m.time <= at]
    return before[-1] if before and before[-1].kind == "claim" else None


def _after(timeline: list[Mark], at: float, kinds: tuple[str, ...]) -> Mark | None:
    return next((m for m in timeline if m.time > at and m.kind in kinds), None)


def fault_rows(faults: list[Injected], timeline: dict[str, list[Mark]],
               model_faults: list[tuple[float, str, int]], run_of_task: dict[str, str],
               violations: list[Violation], parent_of: dict[str, str]) -> list[Row]:
    """One row per fault kind: what it hit, what recovered and how fast (see README)."""
    rows: dict[str, Row] = {}
    for fault in faults:
        row = rows.setdefault(fault.kind, Row(fault.kind))
        row.injected += 1
        for run, steps in timeline.items():
            if fault.kind in ("worker kill", "partition"):
                held = _held(steps, fault.start)
                if held is None or held.host != fault.target:
                    continue
                row.affected.add(run)
                nxt = _after(steps, fault.start, ("claim", "settle"))
                if nxt is not None:
                    row.recovered.add(run)
                    row.times.append(nxt.time - fault.start)
            elif fault.kind == "Redis kill":
                if _held(steps, fault.start) is None:
                    continue
                row.affected.add(run)
                nxt = _after(steps, fault.end, ("claim", "settle", "renew"))
                if nxt is not None:
                    row.recovered.add(run)
                    row.times.append(nxt.time - fault.start)
            elif fault.kind == "coordinator kill":
                settle = next((m for m in steps if m.kind == "settle"
                               and fault.start <= m.time <= fault.end), None)
                parent = parent_of.get(run, "")
                if settle is None:
                    continue
                row.affected.add(run)
                resumed = _after(timeline.get(parent, []), settle.time, ("claim",)) \
                    if parent else None
                if resumed is not None or not parent:
                    row.recovered.add(run)
                    if resumed is not None:
                        row.times.append(resumed.time - fault.start)
            elif fault.kind == "clock ahead" and any(
                    m.kind == "claim" and m.host == fault.target for m in steps):
                row.affected.add(run)
                if any(m.kind == "settle" for m in steps):
                    row.recovered.add(run)
    if model_faults and "model 429/500" in rows:
        row = rows["model 429/500"]
        first: dict[str, float] = {}
        for at, task, status in model_faults:
            if status >= 400:
                first.setdefault(task, at)
        row.affected = {run_of_task.get(t, t) for t in first}
        for at, task, status in model_faults:
            if status < 400 and task in first and at > first[task]:
                run = run_of_task.get(task, task)
                if run not in row.recovered:
                    row.recovered.add(run)
                    row.times.append(at - first[task])
    for row in rows.values():
        row.violations = sum(1 for v in violations if v.run and v.run in row.affected)
    return list(rows.values())


def by_run(found: list[Mark]) -> dict[str, list[Mark]]:
    out: dict[str, list[Mark]] = defaultdict(list)
    for mark in found:
        out[mark.run].append(mark)
    for steps in out.values():
        steps.sort(key=lambda m: m.time)
    return dict(out)
