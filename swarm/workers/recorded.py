"""What a swarm recorded when it was started or submitted, as a worker reads it: its
settings, MCP servers and agent types, each read at most every :data:`SETTINGS_TTL`
seconds per swarm (a fan-out's siblings share one read), and a child's settings made
from them."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from swarm.agent.agent_types import AgentType, AgentTypes
from swarm.cache import TTLCache
from swarm.config import Settings
from swarm.mcp_client.config import McpConfig
from swarm.store.ledger import Ledger

log = logging.getLogger(__name__)

#: Seconds a worker trusts what it read of a swarm's settings (they never change).
SETTINGS_TTL = 30.0

#: Settings of the model endpoint: from the worker's environment when it has them.
ENDPOINT = frozenset({"base_url", "model"})


def typed_settings(settings: Settings, kind: AgentType) -> Settings:
    """``settings`` for a child of type ``kind``: its model and endpoint (the key stays the
    worker's), its approval policies and its turn limit, where it gives them."""
    return settings.with_(model=kind.model or None, base_url=kind.base_url or None,
                          approval=kind.policies(), child_max_turns=kind.max_turns or None)


class Recorded:
    """The records of the swarms a worker runs children of, cached."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._settings: TTLCache[str, dict[str, Any]] = TTLCache(SETTINGS_TTL)
        self._mcp: TTLCache[str, McpConfig] = TTLCache(SETTINGS_TTL)
        self._types: TTLCache[str, AgentTypes] = TTLCache(SETTINGS_TTL)

    def child_settings(self, worker: Settings, swarm_id: str) -> Settings:
        """The worker's settings with the swarm's over them, but for a worker configured
        with its own endpoint (a deployment's workers), which keeps it; one without (local
        workers, the demo) uses the root's."""
        settings = worker.with_(**{
            k: v for k, v in self.swarm_settings(swarm_id).items()
            if not (k in ENDPOINT and ENDPOINT & worker.explicit)})
        if "stream" not in settings.explicit:
            # Nobody watches a child's tokens arrive: whole answers cost the worker less than
            # half the CPU of a parsed stream (and one read instead of one per chunk).
            settings = dataclasses.replace(settings, stream=False)
        return settings

    def swarm_settings(self, swarm_id: str) -> dict[str, Any]:
        """The swarm's settings (written once, when it was created)."""
        return self._settings.get_or_load(swarm_id,
                                          lambda: self.ledger.swarm_settings(swarm_id))

    def mcp_servers(self, swarm_id: str) -> McpConfig:
        """The MCP servers recorded with the swarm when it was started or submitted (as
        configured, ``${VAR}`` unexpanded: they expand from this worker's environment).
        Never read from a workspace: its commands write it (a ``.mcp.json`` planted there
        would have this worker start a program of their choosing)."""
        cached = self._mcp.get(swarm_id)
        if cached is not None:
            return cached
        raw = self.ledger.swarm_mcp(swarm_id)
        if raw is None:  # a swarm from before swarms (and jobs) recorded their MCP servers
            log.warning("swarm %s has no MCP configuration recorded: its agents get no MCP "
                        "servers", swarm_id)
            raw = {"mcpServers": {}}
        config = McpConfig.from_json(raw)
        self._mcp.put(swarm_id, config)
        return config

    def agent_types(self, swarm_id: str) -> AgentTypes:
        """The agent types recorded with the swarm when it was started or submitted. Never
        read from a workspace: its commands write it, and a type file planted there would
        give a child the instructions, tools and model of their choosing."""
        return self._types.get_or_load(
            swarm_id, lambda: AgentTypes.from_json(self.ledger.swarm_types(swarm_id)))
