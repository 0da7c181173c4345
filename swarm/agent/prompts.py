"""The system prompt: instructions, memory hints, the environment, the agent folder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

INSTRUCTIONS = """You are swarm, an autonomous agent that gets work done in a shell.
You act through tools; the user sees your final answer, so make it complete and concrete.

How to work:
- Use run_cli to inspect, build, run and verify. Look before you change things; check your work
  (run the tests, read the output) before you say it is done.
- Every run_cli call starts in your workspace with a fresh bash; stdin is closed, so never start
  interactive programs, editors or pagers. Use non-interactive flags (-y, --no-pager).
- Keep output small: filter with grep/head/tail rather than printing huge files.
- When a command fails, read the error and adapt; do not repeat the same failing command.
- If a tool call is denied, do not try to get around the denial: find another way or explain.
- When the job is done, answer without calling tools: say what you did and what you found.

Memory: the <memory_hints> below are notes you (or other copies of you) left earlier. Use them,
and keep reusable knowledge in files so that your future self can find it again."""


@dataclass(frozen=True)
class PromptParts:
    """Everything the system prompt is made of, gathered by the caller."""

    hints: str = ""
    base: str = INSTRUCTIONS
    """What the agent is and how it works: swarm's own, or a declared type's body."""
    environment: str = ""
    instructions: str = ""
    """AGENTS.md and .swarm/instructions.md, already read."""
    skills: Sequence[tuple[str, str]] = ()
    """(name, first line) of each .swarm/skills/*.md."""
    tool_errors: Sequence[str] = ()
    """.swarm/tools files that were skipped, and why."""
    extra: str = ""
    """Set by the runtime, e.g. a child's role in a swarm."""


def system_prompt(parts: PromptParts) -> str:
    """Assemble the system prompt from its parts; empty parts are left out."""
    sections = [parts.base]
    if parts.extra:
        sections.append(parts.extra)
    sections.append(f"<memory_hints>\n{parts.hints.strip()}\n</memory_hints>")
    if parts.environment:
        sections.append(f"<environment>\n{parts.environment.strip()}\n</environment>")
    if parts.instructions:
        sections.append(
            f"<project_instructions>\n{parts.instructions.strip()}\n</project_instructions>")
    if parts.skills:
        lines = "\n".join(f"- {name}: {summary}" for name, summary in parts.skills)
        sections.append(
            "<skills>\nLoad a skill with load_skill(name) when the task matches it:\n"
            f"{lines}\n</skills>")
    if parts.tool_errors:
        lines = "\n".join(f"- {err}" for err in parts.tool_errors)
        sections.append(f"<tool_errors>\nThese tool files were skipped:\n{lines}\n</tool_errors>")
    return "\n\n".join(sections)
