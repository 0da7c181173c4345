"""``swarm serve``: submit, watch, cancel and approve swarm jobs over HTTP.

:mod:`swarm.serve.app` builds the ASGI app (FastAPI), :mod:`swarm.serve.auth` checks
bearer tokens, :mod:`swarm.serve.models` holds the request and response bodies and
:mod:`swarm.serve.jobs` the folders and settings of jobs (shared with schedules). Jobs are
ordinary swarm jobs (:func:`swarm.runtime.jobs.submit_job`) on the same Redis,
coordinators and workers as the command line.
"""
