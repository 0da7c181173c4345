"""An MCP tool's result as the text the model sees: text as it is, structured content as
JSON (unless a text block already says the same), images, audio and binary resources as a
short note, all within the output cap."""

from __future__ import annotations

import json
from typing import Any

from mcp.types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from swarm.text import cap_middle


def as_text(result: CallToolResult, cap: int) -> str:
    """The blocks of ``result`` one after another, capped (head and tail kept)."""
    parts = [_block(block) for block in result.content]
    structured = result.structured_content
    if structured is not None and not _said(parts, structured):
        parts.append(json.dumps(structured, ensure_ascii=False, default=str))
    return cap_middle("\n".join(parts) if parts else "(no output)", cap)


def _block(block: Any) -> str:
    if isinstance(block, TextContent):
        return block.text
    if isinstance(block, ImageContent | AudioContent):
        kind = "image" if isinstance(block, ImageContent) else "audio"
        return f"[{kind} {block.mime_type}, {_size(block.data)}: not shown]"
    if isinstance(block, ResourceLink):
        return f"[resource link {block.uri}" + (f" ({block.name})" if block.name else "") + "]"
    if isinstance(block, EmbeddedResource):
        resource = block.resource
        if isinstance(resource, TextResourceContents):
            return f"[resource {resource.uri}]\n{resource.text}"
        if isinstance(resource, BlobResourceContents):
            return (f"[resource {resource.uri}, {resource.mime_type or 'binary'}, "
                    f"{_size(resource.blob)}: not shown]")
    return f"[{getattr(block, 'type', type(block).__name__)} content: not shown]"


def _size(base64: str) -> str:
    size = len(base64) * 3 // 4 - base64[-2:].count("=")
    return f"{size / 1024:.0f} KiB" if size >= 1024 else f"{size} bytes"


def _said(parts: list[str], structured: Any) -> bool:
    """Whether a text block already says what the structured content holds: the same JSON,
    or the value the SDK's servers wrap as ``{"result": value}`` (a tool returning a string
    or a number)."""
    values = [structured]
    if isinstance(structured, dict) and list(structured) == ["result"]:
        values.append(structured["result"])
    for text in parts:
        if any(text == v for v in values if isinstance(v, str)):
            return True
        try:
            if json.loads(text) in values:
                return True
        except ValueError:
            continue
    return False
