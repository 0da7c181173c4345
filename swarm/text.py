"""Text shown to people and models: counts (``1 line``, ``2 lines``), URLs without their
credentials, and long results cut in the middle."""

from __future__ import annotations


def plural(count: int, noun: str, many: str = "") -> str:
    """``count`` and ``noun``, plural unless ``count`` is 1 (``many``, else ``noun + 's'``)."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"


def without_userinfo(url: str) -> str:
    """``url`` without its ``user:password@`` part, by string edits (never raises, so even a
    malformed URL loses it): ``http://alice:pw@host/v1`` -> ``http://host/v1``."""
    start = url.find("//") + 2 if "//" in url else 0
    ends = [i for i in (url.find(c, start) for c in "/?#") if i >= 0]
    end = min(ends, default=len(url))
    at = url.rfind("@", start, end)
    return url if at < 0 else url[:start] + url[at + 1:]


def public_url(url: str) -> str:
    """``url`` as it may be shown and logged: without what may hold credentials (the user
    info, the query, the fragment); a URL that does not parse is not shown at all."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(without_userinfo(url))
        return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    except ValueError:  # a malformed URL: show none of it rather than a secret
        return "the configured endpoint"


def cap_middle(text: str, cap: int) -> str:
    """``text`` cut to its first and last ``cap // 2`` characters when longer than ``cap``,
    with a marker of how much was cut (so no tool result floods the context)."""
    if len(text) <= cap:
        return text
    half = max(cap // 2, 1)
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[-half:]}"


def human_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KB``, ``61.2 MB``, ``2.0 GB`` (powers of 1000)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"
