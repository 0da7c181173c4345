"""Schedules: swarm jobs started by Celery beat on a cron schedule.

A schedule (``swarm schedule add``, or a ``.swarm/schedules/NAME.toml`` file in an
agent folder synced by ``swarm beat --folder``) is kept in Redis twice: its definition
(:func:`swarm.store.keys.schedules`) and a celery-redbeat entry, so any number of beat
processes share one schedule and redbeat's lock lets only one of them fire. A firing
sends the thin task ``swarm.job.submit(NAME)`` to the workers, which submits an
ordinary job (:func:`swarm.runtime.jobs.submit_job`).
"""
