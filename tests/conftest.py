"""Shared fixtures: a real Redis-compatible server per session, the scripted model over HTTP."""

pytest_plugins = ["tests.plugins.redis_server", "tests.plugins.model_server"]
