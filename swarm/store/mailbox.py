"""Messages people send to a running agent (``swarm say``, the API, the page), one Redis
stream per agent (:func:`keys.mailbox`).

:meth:`Mailbox.send` adds one unless the agent has settled (in one script with the check,
so a settled agent never gets a message it would not read) and tells the swarm's event
stream. The agent's loop reads those after its session's ``said`` at its next turn boundary
(a worker's, in the round trip of the save just before it), adds them to its conversation
and saves it with ``said`` moved on, then deletes them: a crash before that save leaves them
to be read again, one after it leaves them skipped, so a message is neither lost nor added
twice.
"""

from __future__ import annotations

import time
from typing import cast

import redis

from swarm.domain.records import SETTLED
from swarm.errors import RequestError
from swarm.store import keys
from swarm.store.connection import Outage, ride
from swarm.store.sessions import RedisSessionStore, stream_after

#: Longest message, in characters (the API's task limit; a smaller context refuses sooner).
MAX_MESSAGE = 256 * 1024

_SEND = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'missing', ''} end
for _, s in ipairs(SETTLED_STATES) do
  if state == s then return {'settled', state} end
end
local id = redis.call('XADD', KEYS[2], '*', 'text', ARGV[1], 'from', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'kind', 'message', 'agent', ARGV[5],
           'ts', ARGV[6], 'text', ARGV[7], 'from', ARGV[2])
return {'sent', id}
""".replace("SETTLED_STATES", "{" + ", ".join(f"'{s}'" for s in SETTLED) + "}")


class Mailbox:
    """The mailbox of agent ``agent_id``: :meth:`send` from anywhere, :meth:`unread` and
    :meth:`delivered` from the agent's own loop."""

    def __init__(self, redis_: redis.Redis, agent_id: str,
                 outage: Outage | None = None,
                 sessions: RedisSessionStore | None = None) -> None:
        self.redis = redis_
        self.agent_id = agent_id
        self.key = keys.mailbox(agent_id)
        self.outage = outage
        """Rides out a Redis restart in the loop's reads (a root in a terminal)."""
        self.sessions = sessions
        """The agent's session store when it reads this mailbox with each save (its
        ``mail``): a turn boundary right after a save reads nothing more."""

    def send(self, text: str, sender: str = "") -> str:
        """Queue ``text`` for the agent's next turn; returns the message's id. Raises
        :class:`RequestError`: 404 for an unknown agent, 409 for a settled one, 413 for a
        message over :data:`MAX_MESSAGE` characters, 400 for a blank one."""
        if not text.strip():
            raise RequestError("the message is empty: say something", 400)
        if len(text) > MAX_MESSAGE:
            raise RequestError(
                f"the message has {len(text):,} characters, over the {MAX_MESSAGE:,} a message "
                "may have: put the material in a file in the agent's workspace and tell it "
                "where", 413)
        swarm_id = self.redis.hget(keys.agent(self.agent_id), "swarm")
        if not swarm_id:
            raise RequestError(f"no agent {self.agent_id!r}: `swarm status` lists them", 404)
        script = self.redis.register_script(_SEND)
        outcome, detail = cast("list[str]", script(
            keys=[keys.agent(self.agent_id), self.key, keys.events(str(swarm_id))],
            args=[text, sender, keys.LEDGER_TTL, keys.EVENTS_MAXLEN, self.agent_id,
                  f"{time.time():.3f}", text[:500]]))
        if outcome == "missing":
            raise RequestError(f"no agent {self.agent_id!r}: `swarm status` lists them", 404)
        if outcome == "settled":
            raise RequestError(
                f"agent {self.agent_id} has settled ({detail}): it reads no more messages. "
                "Give its parent (or a new job) the follow-up instead", 409)
        return detail

    def unread(self, after: str) -> list[tuple[str, str]]:
        """(id, text) of the messages after id ``after`` ("": all), oldest first."""
        entries = self.sessions.unread_mail(self.agent_id, after) \
            if self.sessions is not None else None
        if entries is None:
            entries = ride(self.outage, lambda: cast(
                "list[tuple[str, dict[str, str]]]",
                self.redis.xrange(self.key, stream_after(after), "+")))
        return [(mid, fields.get("text", "")) for mid, fields in entries]

    def delivered(self, ids: list[str]) -> None:
        """Forget messages now in the saved conversation (safe to repeat)."""
        if ids:
            ride(self.outage, lambda: self.redis.xdel(self.key, *ids))
