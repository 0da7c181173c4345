"""A child's agent worked to its final answer, checked against its run's output schema."""

from __future__ import annotations

import logging
from typing import Any

import redis

from swarm.agent.loop import Agent
from swarm.agent.output import ask_for, check_output, retry_message
from swarm.domain.history import repair
from swarm.errors import (
    AgentStopped,
    Cancelled,
    LeaseLost,
    ModelError,
    Parked,
    WorkspaceError,
)
from swarm.errors import StoreError as SwarmStoreError
from swarm.store.ledger import Ledger, RunRecord
from swarm.workers.prompts import RESUMED

log = logging.getLogger(__name__)


def answer(agent: Agent, run: RunRecord, resume: bool,
           ledger: Ledger) -> tuple[str, dict[str, Any]]:
    """Work to a final answer; check it against the run's output schema (one retry). The
    state the run settles in, and its result."""
    session = agent.session
    try:
        if resume:
            text = agent.resume(since_turn=run.start_turn)
        elif 0 <= run.start_index < len(session.messages):
            # A worker died mid-run: carry on from the last saved step.
            agent.run_start = run.start_turn
            if session.parked:  # its spawn request never went out: answer the calls
                session.messages = repair(session.messages)
                session.parked = ""
            agent.messages.append({"role": "user", "content": RESUMED})
            agent.save()
            text = agent.resume(since_turn=run.start_turn)
        else:
            ledger.begin(run.id, session.turns, len(session.messages), session.usage)
            # Unsaved until the model answers: a worker that dies first leaves the
            # session at start_index, so the run starts again from its message.
            text = agent.run(ask_for(run.message, run.output_schema), save_task=False)
        if not run.output_schema:
            return "done", {"answer": text}
        value, problem = check_output(text, run.output_schema)
        if problem:
            text = agent.run(retry_message(problem))
            value, problem = check_output(text, run.output_schema)
        if problem:
            return "failed", {"answer": text,
                              "error": f"the answer did not match output_schema: {problem}"}
        return "done", {"answer": text, "output": value}
    except (Parked, LeaseLost, WorkspaceError):
        raise  # a workspace that could not be made fails the run saying so (ChildRunner.run)
    except Cancelled as exc:
        return exc.state, {"error": str(exc)}
    except (AgentStopped, ModelError) as exc:
        return "failed", {"error": f"{type(exc).__name__}: {exc}"}
    except (SwarmStoreError, redis.RedisError):
        raise  # Redis went away: the task fails, the lease runs out, a worker takes over
    except Exception as exc:  # a bug must not leave the parent waiting forever
        log.exception("child %s crashed", run.agent)
        return "failed", {"error": f"internal error: {type(exc).__name__}: {exc}"}
