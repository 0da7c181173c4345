"""The coordinator process: spawn requests -> ledger -> Celery tasks; limits; fan-in; resume."""
