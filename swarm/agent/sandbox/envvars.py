"""The environment of a sandboxed command: only the runner's variables :data:`PASSED`
names (no key, no Redis URL), and the git settings that keep the box's git fast on the
worker's files."""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Iterable, Mapping

PASSED = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ",
          "TERM", "COLORTERM", "TMPDIR", "EDITOR", "VISUAL",
          "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
          "http_proxy", "https_proxy", "no_proxy", "all_proxy",
          "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
          "NODE_EXTRA_CA_CERTS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "UV_INDEX_URL",
          "VIRTUAL_ENV", "PYTHONPATH", "JAVA_HOME", "GOPATH", "GOROOT", "CARGO_HOME",
          "RUSTUP_HOME", "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME",
          "GIT_COMMITTER_EMAIL")
"""Variables of the runner's environment a sandboxed command gets (patterns allowed)."""


def environment(source: Mapping[str, str], extra_names: Iterable[str] = ()) -> dict[str, str]:
    """The variables of ``source`` that :data:`PASSED` or ``extra_names`` name."""
    named = _named((*PASSED, *extra_names))
    return {k: v for k, v in source.items() if named(k)}


@functools.lru_cache(maxsize=32)
def _named(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a name matches one of ``patterns`` (a set and one regular expression:
    ``fnmatch`` for each pattern and each variable was ~0.3 ms a box)."""
    exact = frozenset(p for p in patterns if not any(c in p for c in "*?["))
    wild = re.compile("|".join(fnmatch.translate(p) for p in patterns if p not in exact)
                      or "(?!)")
    return lambda name: name in exact or wild.match(name) is not None


#: The box's git tells a file changed since its index entry by size and whole-second
#: mtime and ctime only. The worker's files show the overflow uid in the box (and the index
#: holds the worker's uid 0): with git's default check, a command's first ``git status``
#: found every file changed, hashed the whole tree again and wrote the box's stat data into
#: the index, and then each capture by the worker hashed it all again (0.27 s a
#: ``git status`` and 0.25 s a capture of a 50 MB checkout, against 0.09 and 0.03). A
#: change within the index's own second is still caught: git reads such "racily clean"
#: entries' contents.
GIT_STAT_CHECK = ("core.checkStat", "minimal")


def add_git_stat_check(env: dict[str, str]) -> None:
    """Give git :data:`GIT_STAT_CHECK` through ``env``'s ``GIT_CONFIG_COUNT`` entries, after
    any the command's environment already has."""
    try:
        n = max(0, int(env.get("GIT_CONFIG_COUNT", "0")))
    except ValueError:
        n = 0
    env["GIT_CONFIG_COUNT"] = str(n + 1)
    env[f"GIT_CONFIG_KEY_{n}"], env[f"GIT_CONFIG_VALUE_{n}"] = GIT_STAT_CHECK

