"""Celery on the swarm's Redis, shared by the coordinator (which sends tasks) and the
workers (which run them): the app and its settings, and Flower events. kombu's Redis
transport is :class:`swarm.patches.RedisTransport`."""
