"""The coordinator: spawn requests -> ledger -> Celery tasks; limits; fan-in; resume."""
