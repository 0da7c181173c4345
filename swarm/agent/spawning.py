"""The plain ``agent`` calls of one answer: the answer's other calls run, the ``agent``
calls go to the swarm as one request, and the parent parks on it (its background calls were
sent before, :mod:`swarm.agent.background`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm import telemetry
from swarm.agent.tools import Call
from swarm.domain.spawn import SpawnCall
from swarm.errors import Parked

if TYPE_CHECKING:
    from swarm.agent.loop import Agent


def spawn(agent: Agent, calls: list[Call], started: dict[str, str]) -> dict[str, str]:
    """Run the calls that are not ``agent`` calls, hand the ``agent`` calls to the swarm
    and park: their results (and these) are appended in call order when all settle.
    When none of the ``agent`` calls can be sent (the spawner refused them all, e.g. a
    workspace over its snapshot cap), every call's result is returned instead."""
    assert agent.spawner is not None
    results: dict[str, str] = dict(started)
    spawns: list[SpawnCall] = []
    for call in calls:
        if call.id in started:
            continue
        if call.name == "agent" and not call.error:
            args = call.arguments
            with telemetry.span("tool agent", call_id=call.id, agent=agent.config.agent_id):
                trace = telemetry.traceparent()
            spawns.append(SpawnCall(call.id, str(args["message"]),
                                    str(args.get("agent_id", "")), args.get("output_schema"),
                                    trace, empty=args.get("seed") is False,
                                    type=str(args.get("type") or "")))
            agent.observer.on_tool_start(call, agent.summary(call))
            continue
        try:
            results[call.id] = agent.execute(call)
        except KeyboardInterrupt:
            raise agent.interrupted(calls, results) from None
        agent.observer.on_tool_result(call, results[call.id])
    spawns, refused = agent.spawner.prepare(spawns)
    results.update(refused)
    if not spawns:
        return results
    # Parked is saved before the request exists: the fan-in must never find this
    # session unparked (a load would then "repair" the calls it is about to answer).
    request_id = agent.spawner.request_id(agent.session.turns, spawns)
    agent.session.parked = request_id
    agent.save()
    agent.spawner.submit(request_id, agent.session.turns, spawns, results)
    raise Parked(request_id)

