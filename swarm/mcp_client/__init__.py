"""swarm as an MCP client: the tools of the MCP servers configured in the agent folder.

- :mod:`~swarm.mcp_client.config` reads ``.mcp.json``, ``.swarm/mcp.json`` and
  ``SWARM_HOME/mcp.json``;
- :mod:`~swarm.mcp_client.bridge` runs the SDK (asyncio) on one loop thread per process;
- :mod:`~swarm.mcp_client.pool` keeps one server per configuration per process;
- :mod:`~swarm.mcp_client.tools` offers an agent its servers' tools and calls them;
- :mod:`~swarm.mcp_client.results` turns a tool's result into text for the model.
"""
