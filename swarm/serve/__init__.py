"""``swarm serve``: submit, watch, cancel and approve swarm jobs over HTTP, and ``swarm mcp``:
the same as MCP tools.

:mod:`swarm.serve.service` does what both front ends offer (jobs, their events, approvals);
:mod:`swarm.serve.app` builds the HTTP API (FastAPI) on it, :mod:`swarm.serve.mcp` the MCP
server (stdio, and Streamable HTTP at ``/mcp`` of the app), :mod:`swarm.serve.page` the
page at ``/`` (``static/``: HTML, one script, one style sheet); :mod:`swarm.serve.auth` checks
bearer tokens, :mod:`swarm.serve.models` holds the request and response bodies and
:mod:`swarm.serve.jobs` the folders and settings of jobs (shared with schedules). Jobs are
ordinary swarm jobs (:func:`swarm.runtime.jobs.submit_job`) on the same Redis,
coordinators and workers as the command line.
"""
