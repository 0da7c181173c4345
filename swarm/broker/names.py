"""The names of swarm's Celery tasks, in one place: the workers register their tasks under
them (:mod:`swarm.workers.tasks`, :mod:`swarm.schedules.tasks`) and the senders send by
them (the coordinator, jobs, schedules), so neither imports the other. Flower and
``celery inspect`` show them; a renamed one strands the tasks queued under the old name.
Imports nothing (not Celery either)."""

from __future__ import annotations

#: A child's run for one ``agent`` call, or a job's root (its one argument: the run id,
#: also the task's id).
RUN = "swarm.agent.run"
#: A parked agent carried on once its children have settled (its one argument: the run id).
RESUME = "swarm.agent.resume"
#: A schedule's firing: submits the schedule's job (its one argument: the schedule's name).
SUBMIT_SCHEDULED = "swarm.job.submit"
