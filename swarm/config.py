"""Settings: every ``SWARM_*`` environment variable swarm reads is a knob of :data:`KNOBS`.

Most knobs are fields of :class:`Settings`; precedence for each: CLI flag > ``SWARM_*`` >
``OPENAI_*`` > ``EVA_*`` > default. The others are read by one command or module itself
(their knob says which), and a few are swarm's own plumbing between its processes.

Over 400 lines because :data:`KNOBS` (the one list of every variable, with its help and
precedence) and :class:`Settings` (whose fields most knobs are, parsed and checked by it)
change together; split, each would need the other.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from swarm.errors import ConfigError

#: A session lock lives this long unless its holder renews it (default of SWARM_LOCK_TTL).
LOCK_TTL = 30
#: An idle session is forgotten after this long (default of ``SWARM_SESSION_TTL``).
SESSION_TTL = 30 * 24 * 3600

POLICIES = ("always", "never", "once", "review")


class Secret(str):
    """A string that never shows itself in a repr, a log line (``%s``, ``%r``), an f-string
    or a traceback: all show ``***``. :meth:`reveal` gives the value, for the one place
    that sends it (the ``Authorization`` header)."""

    def __repr__(self) -> str:
        return "Secret('***')" if self else "Secret('')"

    def __str__(self) -> str:
        return "***" if self else ""

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def reveal(self) -> str:
        return str.__str__(self)


@dataclass(frozen=True)
class Knob:
    """One setting: the environment variables it reads, first match wins."""

    env: tuple[str, ...]
    help: str
    read_by: str = ""
    """Empty for a :class:`Settings` field; else what reads the variable itself."""
    internal: bool = False
    """Set by swarm for its own processes, or by the tests; not a user setting."""


KNOBS: dict[str, Knob] = {
    "base_url": Knob(("SWARM_BASE_URL", "OPENAI_BASE_URL", "EVA_BASE_URL"),
                     "OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080/v1"),
    "model": Knob(("SWARM_MODEL", "OPENAI_MODEL", "EVA_MODEL_NAME"),
                  "model id; when unset and /models lists exactly one, that one"),
    "api_key": Knob(("SWARM_API_KEY", "OPENAI_API_KEY", "EVA_API_KEY"), "bearer token"),
    "redis_url": Knob(("SWARM_REDIS_URL",),
                      "Redis URL; unset starts the embedded server. Redis Sentinel: "
                      "sentinel://host1:26379;sentinel://host2:26379 (with SWARM_REDIS_MASTER)"),
    "redis_master": Knob(("SWARM_REDIS_MASTER",),
                         "with a sentinel:// SWARM_REDIS_URL: the name of the master the "
                         "sentinels watch"),
    "home": Knob(("SWARM_HOME",), "embedded server data, hints.md, logs"),
    "max_turns": Knob(("SWARM_MAX_TURNS",),
                      "model calls per run of the root (and the most a child may make) before "
                      "it stops; 0 = no cap"),
    "child_max_turns": Knob(("SWARM_CHILD_MAX_TURNS",),
                            "berserk: model calls per run of a child before it stops; 0 = no "
                            "cap (SWARM_MAX_TURNS still applies)"),
    "repeat_limit": Knob(("SWARM_REPEAT_LIMIT",),
                         "answers in a row making the same tool calls and getting the same "
                         "refusal or error before the agent is stopped; 0 = never"),
    "command_timeout": Knob(("SWARM_COMMAND_TIMEOUT",), "default run_cli timeout, seconds"),
    "command_timeout_max": Knob(("SWARM_COMMAND_TIMEOUT_MAX",), "ceiling for run_cli timeouts"),
    "output_cap": Knob(("SWARM_OUTPUT_CAP",),
                       "characters of command output, of an MCP result and of a child's answer "
                       "its parent gets, kept head and tail"),
    "context_length": Knob(("SWARM_CONTEXT_LENGTH",),
                           "context window when /models does not tell one"),
    "compact_at": Knob(("SWARM_COMPACT_AT",), "fraction of the context that triggers compaction"),
    "connect_timeout": Knob(("SWARM_CONNECT_TIMEOUT",), "seconds to connect to the model"),
    "read_timeout": Knob(("SWARM_READ_TIMEOUT",), "seconds to wait for the next byte"),
    "retries": Knob(("SWARM_RETRIES",), "tries per model call on 429/5xx/timeouts"),
    "backoff_max": Knob(("SWARM_BACKOFF_MAX",), "longest wait between tries, seconds"),
    "stream": Knob(("SWARM_STREAM",), "stream answers (1) or not (0)"),
    "answer_max": Knob(("SWARM_ANSWER_MAX",),
                       "characters of one model answer kept (text, thinking, tool calls' "
                       "arguments); the rest is cut, and the answer says so to the model"),
    "call_timeout": Knob(("SWARM_CALL_TIMEOUT",),
                         "seconds one model call may take from request to last byte, however "
                         "slowly the bytes come; then it fails"),
    "approval": Knob(("SWARM_APPROVAL",),
                     "per-tool policies, e.g. 'run_cli=review,mcp__github__*=always,*=once' "
                     "(always|never|once|review; globs allowed)"),
    "yes": Knob(("SWARM_YES",), "approve every tool call"),
    "lock_ttl": Knob(("SWARM_LOCK_TTL",), "seconds a session lock lives without renewal"),
    "session_ttl": Knob(("SWARM_SESSION_TTL",), "seconds an idle session is kept in Redis"),
    "max_depth": Knob(("SWARM_MAX_DEPTH",), "berserk: deepest child level"),
    "max_children": Knob(("SWARM_MAX_CHILDREN",), "berserk: children per swarm"),
    "max_parallel": Knob(("SWARM_MAX_PARALLEL",), "berserk: children in flight"),
    "token_budget": Knob(("SWARM_TOKEN_BUDGET",),
                         "tokens per swarm, every agent counted (the root too); 0 = no cap"),
    "child_timeout": Knob(("SWARM_CHILD_TIMEOUT",),
                          "berserk: wall seconds per child (asked to wrap up at 80%)"),
    "approval_timeout": Knob(("SWARM_APPROVAL_TIMEOUT",),
                             "berserk: seconds a child waits for a person's answer; then denied"),
    "lease": Knob(("SWARM_LEASE",),
                  "seconds a worker's claim on a child lives without renewal; then taken over"),
    "reclaim_idle": Knob(("SWARM_RECLAIM_IDLE",),
                         "seconds before a dead coordinator's pending requests are taken over"),
    "takeover_grace": Knob(("SWARM_TAKEOVER_GRACE",),
                           "seconds a child's task (or a parent's resume) has to be claimed by "
                           "a worker before a coordinator sends it again"),
    "snapshot_max": Knob(("SWARM_SNAPSHOT_MAX",),
                         "bytes of files in one workspace snapshot a child is seeded from "
                         "(over it the agent call is refused, saying so); 0 = no cap"),
    "snapshot_swarm_max": Knob(("SWARM_SNAPSHOT_SWARM_MAX",),
                               "bytes of workspace snapshots one swarm may store in Redis; "
                               "0 = no cap"),
    "seed_view": Knob(("SWARM_SEED_VIEW",),
                      "a seeded child's workspace on a worker: auto (a copy-on-write overlayfs "
                      "view of one shared checkout per host, where the worker can mount one; "
                      "else a full checkout), checkout (always a full checkout)"),
    "land_check": Knob(("SWARM_LAND_CHECK",),
                       "a command run in the parent's workspace (like its commands) after each "
                       "child's work lands there; a landing it fails is undone (the agent "
                       "call's `check` wins)"),
    "sandbox": Knob(("SWARM_SANDBOX",),
                    "run commands in bubblewrap: auto (when a trial works), bwrap, none; "
                    "workers default to auto, the root in a terminal to none"),
    "sandbox_network": Knob(("SWARM_SANDBOX_NETWORK",),
                            "sandboxed commands' network: 1 (user-mode internet through "
                            "slirp4netns; the worker's host, the Redis hosts and "
                            "SWARM_SANDBOX_DENY unreachable), 0 (none), host (the host's own, "
                            "every port of it exposed)"),
    "sandbox_deny": Knob(("SWARM_SANDBOX_DENY",),
                         "comma-separated IPv4 addresses or networks (10.0.0.0/8) sandboxed "
                         "commands may not reach, beside the worker's host and Redis"),
    "sandbox_allow": Knob(("SWARM_SANDBOX_ALLOW",),
                          "comma-separated IPv4 addresses, networks or ADDRESS:PORT (needs "
                          "nftables) sandboxed commands may reach though denied"),
    "sandbox_memory": Knob(("SWARM_SANDBOX_MEMORY",),
                           "memory one sandboxed command may use (cgroup), e.g. 2G, 512M; "
                           "0 = no limit"),
    "sandbox_pids": Knob(("SWARM_SANDBOX_PIDS",),
                         "processes and threads one sandboxed command may have (cgroup)"),
    "sandbox_cpu": Knob(("SWARM_SANDBOX_CPU",),
                        "CPU weight of one sandboxed command (cgroup, 1-10000; 100 = as much "
                        "as any other group)"),
    "sandbox_show": Knob(("SWARM_SANDBOX_SHOW",),
                         "comma-separated host folders sandboxed commands see read-only beside "
                         "the system's (/usr, /etc, /opt, ...)"),
    "sandbox_uid": Knob(("SWARM_SANDBOX_UID",),
                        "host uid and gid a root worker runs sandboxed commands as (not 0)"),
    "mcp_start_timeout": Knob(("SWARM_MCP_START_TIMEOUT",),
                              "seconds an MCP server has to start and list its tools; "
                              "past that it is skipped"),
    "sandbox_env": Knob(("SWARM_SANDBOX_ENV",),
                        "comma-separated names of more variables sandboxed commands get"),
    "wait_notice": Knob(("SWARM_WAIT_NOTICE",),
                        "seconds between 'waiting for MODEL at URL' lines while the model is "
                        "silent and stderr is not a terminal; 0 = no waiting notices"),
    # Not Settings fields: read by the command or module named in read_by.
    "workers": Knob(("SWARM_WORKERS",), "local worker processes to start for children "
                    "(default: 1 on the embedded server, else 0)",
                    read_by="swarm run/attach --workers"),
    "worker_concurrency": Knob(("SWARM_WORKER_CONCURRENCY",),
                               "children one worker process runs at once (threads)",
                               read_by="swarm worker --concurrency"),
    "queues": Knob(("SWARM_QUEUES",), "comma-separated Celery queues a worker takes tasks from",
                   read_by="swarm worker --queues"),
    "price_input": Knob(("SWARM_PRICE_INPUT",),
                        "US dollars per million prompt tokens, for cost estimates",
                        read_by="swarm run/status/top/report (swarm.report.display.Prices)"),
    "price_output": Knob(("SWARM_PRICE_OUTPUT",),
                         "US dollars per million completion tokens, for cost estimates",
                         read_by="swarm run/status/top/report (swarm.report.display.Prices)"),
    "prices": Knob(("SWARM_PRICES",),
                   "prices of models by name, MODEL=IN/OUT comma-separated (US dollars per "
                   "million prompt/completion tokens)",
                   read_by="swarm run/status/top/report (swarm.report.display.Prices)"),
    "serve_host": Knob(("SWARM_SERVE_HOST",), "address the HTTP API listens on",
                       read_by="swarm serve --host"),
    "serve_port": Knob(("SWARM_SERVE_PORT",), "port of the HTTP API", read_by="swarm serve --port"),
    "serve_root": Knob(("SWARM_SERVE_ROOT",),
                       "folder API jobs' workspaces must lie in (default SWARM_HOME/jobs)",
                       read_by="swarm serve --root, swarm mcp --root"),
    "serve_token": Knob(("SWARM_SERVE_TOKEN",),
                        "one admin API bearer token (it sees every job) from the environment, "
                        "beside `swarm token` ones",
                        read_by="swarm serve"),
    "parent_pid": Knob(("SWARM_PARENT_PID",),
                       "the process whose local coordinator and workers stop when it is gone",
                       read_by="swarm.runtime.local", internal=True),
    "sandbox_fallback": Knob(("SWARM_SANDBOX_FALLBACK",),
                             "1 on the local workers a root in a terminal starts on its own "
                             "embedded server while it runs its commands unconfined: where "
                             "they cannot box commands, such roots' children run unconfined",
                             read_by="swarm.agent.sandbox.for_worker", internal=True),
    "secrets_fd": Knob(("SWARM_SECRETS_FD",),
                       "pipe a re-executed worker reads its secret variables from",
                       read_by="swarm.secrets", internal=True),
    "fault": Knob(("SWARM_FAULT",), "fault-injection point where the process dies (tests)",
                  read_by="swarm.faults", internal=True),
}


def _default_home() -> Path:
    return Path.home() / ".swarm"


@dataclass(frozen=True)
class Settings:
    """Every setting of swarm. Build with :meth:`from_env`; never mutate, use :meth:`with_`."""

    base_url: str = "https://api.openai.com/v1"
    model: str = ""
    api_key: Secret = field(default_factory=lambda: Secret(""))
    redis_url: str = ""
    redis_master: str = ""
    home: Path = field(default_factory=_default_home)
    max_turns: int = 200
    child_max_turns: int = 50
    repeat_limit: int = 3
    command_timeout: int = 300
    command_timeout_max: int = 3600
    output_cap: int = 20_000
    context_length: int = 128_000
    compact_at: float = 0.75
    connect_timeout: float = 10.0
    read_timeout: float = 300.0
    retries: int = 5
    backoff_max: float = 30.0
    stream: bool = True
    answer_max: int = 1_000_000
    call_timeout: float = 1800.0
    approval: dict[str, str] = field(default_factory=lambda: {"run_cli": "review"})
    yes: bool = False
    lock_ttl: int = LOCK_TTL
    session_ttl: int = SESSION_TTL
    max_depth: int = 3
    max_children: int = 200
    max_parallel: int = 64
    token_budget: int = 0
    child_timeout: int = 3600
    approval_timeout: int = 300
    lease: int = 30
    reclaim_idle: int = 15
    takeover_grace: int = 60
    snapshot_max: int = 100_000_000
    snapshot_swarm_max: int = 1_000_000_000
    seed_view: str = "auto"
    land_check: str = ""
    sandbox: str = "none"
    sandbox_network: str = "1"
    sandbox_deny: str = ""
    sandbox_allow: str = ""
    sandbox_memory: str = "2G"
    sandbox_pids: int = 1024
    sandbox_cpu: int = 100
    sandbox_show: str = ""
    sandbox_uid: int = 65534
    sandbox_env: str = ""
    wait_notice: float = 10.0
    mcp_start_timeout: float = 30.0
    explicit: frozenset[str] = frozenset()
    """The settings given by a flag, an environment variable or :meth:`with_` (not defaults)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read settings from ``env`` (default ``os.environ``); ``overrides`` (CLI flags) win.

        An override of ``None`` means "not given" and is ignored.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for name, knob in KNOBS.items():
            if knob.read_by:
                continue
            raw = next((env[k] for k in knob.env if env.get(k, "") != ""), None)
            if raw is not None:
                values[name] = _parse(name, str(types[name]), raw, knob.env[0])
        for name, value in overrides.items():
            if name not in types:
                raise ConfigError(f"unknown setting {name!r}")
            if value is not None:
                values[name] = _coerce(name, value)
        settings = cls(**values, explicit=frozenset(values))
        settings.validate()
        return settings

    def with_(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied (``None`` values are ignored), validated like
        :meth:`from_env`'s: a swarm's settings from the ledger or a test's are no exception."""
        given = {k: _coerce(k, v) for k, v in changes.items() if v is not None}
        settings = replace(self, **given, explicit=self.explicit | frozenset(given))
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise :class:`ConfigError` for values that cannot work."""
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"SWARM_BASE_URL={self.base_url!r} is not an http(s) URL; "
                "set it to your endpoint, e.g. http://127.0.0.1:8080/v1"
            )
        if not 0.1 <= self.compact_at <= 0.95:
            raise ConfigError("SWARM_COMPACT_AT must be between 0.1 and 0.95, e.g. 0.75")
        if self.redis_url.strip().lower().startswith("sentinel://") and not self.redis_master:
            raise ConfigError("SWARM_REDIS_URL lists Redis Sentinels; set SWARM_REDIS_MASTER to "
                              "the name of the master they watch (the NAME of `sentinel "
                              "monitor NAME host port quorum`)")
        if self.seed_view not in ("auto", "checkout"):
            raise ConfigError(f"SWARM_SEED_VIEW={self.seed_view!r} is not one of auto, checkout")
        if self.sandbox not in ("auto", "bwrap", "none"):
            raise ConfigError(f"SWARM_SANDBOX={self.sandbox!r} is not one of auto, bwrap, none")
        if not 0 < self.sandbox_uid < 0xFFFFFFFF:
            raise ConfigError(f"SWARM_SANDBOX_UID={self.sandbox_uid} is not an unprivileged uid; "
                              "set it to a uid of its own (default 65534, nobody), never 0")
        if self.sandbox_network.strip().lower() not in _TRUE | _FALSE | {"host"}:
            raise ConfigError(f"SWARM_SANDBOX_NETWORK={self.sandbox_network!r} is not one of "
                              "1, 0, host")
        self._validate_box()
        for tool, policy in self.approval.items():
            if policy not in POLICIES:
                raise ConfigError(
                    f"approval policy {policy!r} for {tool!r} is not one of {', '.join(POLICIES)}"
                )
        for name in ("command_timeout", "command_timeout_max", "output_cap", "context_length",
                     "retries", "lock_ttl", "session_ttl", "connect_timeout", "read_timeout",
                     "max_depth", "max_children", "max_parallel", "child_timeout",
                     "approval_timeout", "lease", "reclaim_idle", "takeover_grace",
                     "mcp_start_timeout", "answer_max", "call_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{KNOBS[name].env[0]} must be a positive number")
        for name in ("max_turns", "child_max_turns", "repeat_limit", "backoff_max",
                     "token_budget", "snapshot_max", "snapshot_swarm_max"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{KNOBS[name].env[0]} must be 0 or more")

    def _validate_box(self) -> None:
        try:
            parse_size(self.sandbox_memory)
        except ValueError:
            raise ConfigError(f"SWARM_SANDBOX_MEMORY={self.sandbox_memory!r} is not a size "
                              "(2G, 512M, a number of bytes; 0 = no limit)") from None
        if not 1 <= self.sandbox_cpu <= 10000:
            raise ConfigError("SWARM_SANDBOX_CPU must be a weight from 1 to 10000 (100: as "
                              "much as any other group)")
        if self.sandbox_pids < 1:
            raise ConfigError("SWARM_SANDBOX_PIDS must be a positive number")
        try:
            check_entries(_split(self.sandbox_deny), _split(self.sandbox_allow))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def policy_for(self, tool: str) -> str:
        """The approval policy of ``tool``: its own entry, else that of the longest glob
        matching it (``mcp__github__*``; ``*`` is the shortest), else ``once``."""
        if tool in self.approval:
            return self.approval[tool]
        globs = [p for p in self.approval if any(c in p for c in "*?[") and fnmatchcase(tool, p)]
        return self.approval[max(globs, key=len)] if globs else "once"

    def turn_limit(self, child: bool) -> tuple[int, str]:
        """The model calls one run may make (0: no cap) and the setting that says so: a
        root's ``max_turns``; a child's ``child_max_turns``, or ``max_turns`` if lower."""
        limits = [(self.max_turns, "SWARM_MAX_TURNS")]
        if child:
            limits.insert(0, (self.child_max_turns, "SWARM_CHILD_MAX_TURNS"))
        return min(((n, name) for n, name in limits if n), default=(0, ""))

    @property
    def embedded(self) -> bool:
        """True when no Redis URL is set and swarm runs its own server."""
        return not self.redis_url


def _split(text: str) -> list[str]:
    return [e.strip() for e in text.split(",") if e.strip()]


def parse_policies(raw: str) -> dict[str, str]:
    """Parse ``'run_cli=review,*=once'`` into a dict; raise :class:`ConfigError` on bad input."""
    out: dict[str, str] = {"run_cli": "review"}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        tool, sep, policy = part.partition("=")
        if not sep or not tool.strip():
            raise ConfigError(
                f"SWARM_APPROVAL entry {part!r} is not TOOL=POLICY, e.g. 'run_cli=always'"
            )
        out[tool.strip()] = policy.strip()
    return out


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(name: str, type_name: str, raw: str, var: str) -> Any:
    raw = raw.strip()
    try:
        if name == "approval":
            return parse_policies(raw)
        if type_name == "bool":
            low = raw.lower()
            if low not in _TRUE | _FALSE:
                raise ValueError(raw)
            return low in _TRUE
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "Path":
            return Path(raw).expanduser()
        if type_name == "Secret":
            return Secret(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a valid {type_name}") from None


def _coerce(name: str, value: Any) -> Any:
    if name == "api_key" and not isinstance(value, Secret):
        return Secret(str(value))
    if name == "home":
        return Path(value).expanduser()
    return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.I)


def parse_size(text: str) -> int:
    """Bytes of ``2G``, ``512M``, ``1.5g``, ``1048576``; ValueError otherwise."""
    found = _SIZE.match(text)
    if found is None:
        raise ValueError(text)
    scale = 1 << (10 * " kmgt".index(found.group(2).lower() or " "))
    return int(float(found.group(1)) * scale)


def check_entries(deny: Iterable[str], allow: Iterable[str]) -> None:
    """ValueError naming an entry of ``SWARM_SANDBOX_DENY``/``_ALLOW`` that is not an IPv4
    address or network (or, allowed, ``ADDR:PORT``)."""
    for entry in deny:
        try:
            ipaddress.IPv4Network(entry, strict=False)
        except ValueError:
            raise ValueError(f"SWARM_SANDBOX_DENY entry {entry!r} is not an IPv4 address or "
                             "network (10.0.0.0/8)") from None
    for entry in allow:
        address, _, port = entry.partition(":") if entry.count(":") == 1 else (entry, "", "")
        try:
            ipaddress.IPv4Network(address, strict=False)
            if port and not 0 < int(port) < 65536:
                raise ValueError(port)
        except ValueError:
            raise ValueError(f"SWARM_SANDBOX_ALLOW entry {entry!r} is not an IPv4 address, "
                             "network or ADDRESS:PORT (192.0.2.7:8080)") from None
