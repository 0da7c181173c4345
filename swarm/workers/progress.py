"""What a running child reports as it works: its turns and commands, to the ledger and
Flower (through the process's :class:`Supervisor`), and its tokens to :class:`Control`."""

from __future__ import annotations

import logging
from collections.abc import Callable

from swarm import faults
from swarm.agent.loop import Observer
from swarm.agent.tools import Call
from swarm.domain.messages import ChatResult
from swarm.workers.limits import Control
from swarm.workers.supervisor import Supervisor

log = logging.getLogger(__name__)


class ProgressReporter(Observer):
    """Reports a child's turns and commands to the ledger, the event stream and Flower,
    through the process's :class:`Supervisor` (written in batches, not per call)."""

    def __init__(self, supervisor: Supervisor, swarm_id: str, agent_id: str,
                 send: Callable[..., None] | None = None, control: Control | None = None
                 ) -> None:
        self.supervisor, self.swarm_id, self.agent_id = supervisor, swarm_id, agent_id
        self.send, self.control = send, control
        self.turns = 0

    def on_model_result(self, result: ChatResult) -> None:
        self.turns += 1
        if self.control is not None:
            self.control.count(result.usage.total_tokens)

    def on_tool_result(self, call: Call, result: str) -> None:
        faults.point("worker-after-first-command")

    def on_tool_start(self, call: Call, summary: str) -> None:
        if self.control is not None:
            self.control.check_lease()  # never start a command on a lost lease
        last = f"{call.name}: {summary}"[:200]
        self.supervisor.progress(self.swarm_id, self.agent_id, last=last, turns=self.turns,
                                 tool=call.name)
        if self.send is not None:
            try:
                self.send("task-progress", agent=self.agent_id, turn=self.turns, last=last)
            except Exception as exc:  # progress is best effort
                log.debug("progress event not sent: %s", exc)
