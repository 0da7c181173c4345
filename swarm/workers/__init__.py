"""The worker process: thin Celery tasks that take ids (``tasks``), the child runner
(``child``) and what it runs with: its limits (``limits``), its progress reports
(``progress``), its model clients (``models``), what it tells the child (``prompts``), the
process's supervisor (``supervisor``). Its children's workspaces are
:mod:`swarm.workspace`."""
