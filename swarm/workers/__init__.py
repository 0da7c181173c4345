"""Celery workers: the app, thin tasks that take ids, and the child runner."""
