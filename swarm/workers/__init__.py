"""The worker process: thin Celery tasks that take ids, the child runner, its supervisor
and workspaces."""
