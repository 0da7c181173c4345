"""The live tree of a swarm in the terminal (rich ``Live``), for ``swarm run`` and ``swarm top``.

Each agent shows its short id, its agent type (``[leaf]``) and label, state, depth,
elapsed time, turns, tokens and its last command (or its error); a summary line counts
running / done / failed agents, total tokens and, when ``SWARM_PRICE_INPUT`` /
``SWARM_PRICE_OUTPUT`` (US dollars per million prompt / completion tokens) are set, the
estimated cost.

The view reads the ledger itself, from a background thread, at most ``1 / interval``
times a second (4 by default) and only when events arrived (or once a second, for
changes that send none): a burst of events costs no more Redis round trips than one.
When the stream is not a terminal, every event is one plain line instead (the
``describe`` text of :class:`swarm.cli.render.TerminalView`), so CI logs stay readable.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import redis
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from swarm.report.display import Prices, fmt_duration, fmt_tokens
from swarm.report.view import AgentView, SwarmReader, SwarmView, visible_rows
from swarm.store.ledger import Ledger

STATE_STYLE = {
    "running": "bold yellow", "parked": "blue", "queued": "dim", "waiting": "dim",
    "done": "green", "failed": "bold red", "timed_out": "red", "cancelled": "magenta",
    "refused": "red",
}
#: Seconds between reads of the ledger when nothing happens (elapsed times still tick).
IDLE_RELOAD = 1.0


def render(view: SwarmView, prices: Prices, height: int) -> RenderableType:
    """The summary line and as many rows of the tree as fit in ``height`` lines."""
    summary = Text(view.summary(prices), style="bold red" if view.failures()
                   else "bold")
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="dim",
                  padding=(0, 1), expand=False)
    table.add_column("agent", no_wrap=True, overflow="ellipsis", max_width=48)
    table.add_column("state", no_wrap=True)
    table.add_column("d", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("turns", justify="right", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("last command / error", no_wrap=True, overflow="ellipsis", ratio=1)
    now = view.taken
    for row in visible_rows(view.agents, max(height - 3, 2)):
        indent = "  " * row.level
        agent = row.agent
        if agent is None:
            table.add_row(Text(indent + row.note, style="dim"), "", "", "", "", "", "")
            continue
        table.add_row(
            _name(agent, indent), Text(agent.state, style=STATE_STYLE.get(agent.state, "")),
            str(agent.depth), fmt_duration(agent.elapsed(now)), str(agent.turns or ""),
            fmt_tokens(agent.tokens) if agent.tokens else "",
            Text(agent.doing(), style="red" if agent.is_failure else "dim"))
    return Group(summary, table)


def _name(agent: AgentView, indent: int | str) -> Text:
    text = Text(f"{indent}{agent.id[:9]} ", style="cyan")
    if agent.type:
        text.append(f"[{agent.type}] ", style="magenta")
    text.append(agent.label or "")
    return text


class LiveTree:
    """A live view of one swarm for a terminal; plain event lines elsewhere.

    Pass :meth:`on_swarm_event` as the root's event callback and call :meth:`close` at
    the end. The display starts at the first event and pauses by itself when the root
    is woken (its ``joined`` event), so the root's own output is never drawn over.
    """

    def __init__(self, redis_: redis.Redis, swarm_id: str, *, console: Console | None = None,
                 fallback: Callable[[dict[str, str]], None] | None = None,
                 prices: Prices | None = None, interval: float = 0.25,
                 enabled: bool | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.swarm_id = swarm_id
        self.enabled = (self.console.is_terminal and not self.console.is_dumb_terminal
                        if enabled is None else enabled)
        self.fallback = fallback or self._plain
        self.prices = prices if prices is not None else Prices.from_env_or_none()
        self.interval = interval
        self.reader = SwarmReader(redis_)
        self.view: SwarmView | None = None
        self.loads = 0
        """Ledger reads so far (each is three pipelined round trips)."""
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._live: Live | None = None
        self._thread: threading.Thread | None = None
        self._loaded_at = 0.0

    def _plain(self, event: dict[str, str]) -> None:
        from swarm.runtime.root import describe

        self.console.file.write(describe(event) + "\n")
        self.console.file.flush()

    # -- events ------------------------------------------------------------------------------

    def on_swarm_event(self, event: dict[str, str]) -> None:
        """Note that something changed; the view reads the ledger on its own schedule."""
        if not self.enabled:
            self.fallback(event)
            return
        if event.get("kind") == "joined" and event.get("agent") == self.swarm_id:
            self.pause()  # the root goes on: leave the final tree on screen
            return
        self._dirty.set()
        if self._live is None:
            self._start()

    def pause(self) -> None:
        """Draw the tree one last time and stop the display (a new event restarts it)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5)
        with self._lock:
            if self._live is not None:
                with contextlib.suppress(redis.RedisError):
                    self.refresh(reload=True)
                self._live.stop()
                self._live = None

    def close(self) -> None:
        """Stop the display for good (idempotent)."""
        self.pause()

    # -- drawing -----------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._live is not None:
                return
            self._live = Live(console=self.console, auto_refresh=False, transient=False,
                              redirect_stdout=False, redirect_stderr=False,
                              vertical_overflow="crop")
            self._live.start()
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="swarm-live", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            reload = self._dirty.is_set() or time.monotonic() - self._loaded_at >= IDLE_RELOAD
            try:
                self.refresh(reload=reload)
            except redis.RedisError:  # the view is best effort; the root reports real errors
                continue

    def refresh(self, reload: bool = True) -> None:
        """Redraw; with ``reload``, read the ledger first (else only the clocks move)."""
        with self._lock:
            if reload or self.view is None:
                self._dirty.clear()
                view = self.reader.load(self.swarm_id)
                self.loads += 1
                self._loaded_at = time.monotonic()
                if view is None:
                    return
                self.view = view
            else:
                self.view.taken = time.time()
            if self._live is not None:
                self._live.update(self.renderable(), refresh=True)

    def renderable(self) -> RenderableType:
        if self.view is None:
            return Text(f"swarm {self.swarm_id}: waiting for the ledger", style="dim")
        return render(self.view, self.prices, self.console.size.height)

    # -- swarm top ---------------------------------------------------------------------------

    def follow(self, poll: float = 0.5) -> SwarmView | None:
        """Show the swarm until it settles (or Ctrl-C); returns the last view.

        On a terminal: the live tree. Elsewhere: every event as a plain line, from the
        first, then the summary line.
        """
        if not self.enabled:
            return self._follow_plain(poll)
        with self._lock:
            self._live = Live(console=self.console, auto_refresh=False, transient=False,
                              redirect_stdout=False, redirect_stderr=False,
                              vertical_overflow="crop")
            self._live.start()
        try:
            while True:
                self.refresh(reload=True)
                if self.view is None or self.view.settled:
                    return self.view
                time.sleep(poll)
        finally:
            with self._lock:
                if self._live is not None:
                    self._live.stop()
                    self._live = None

    def _follow_plain(self, poll: float) -> SwarmView | None:
        ledger = Ledger(self.reader.redis)
        last = "0-0"
        while True:
            view = self.reader.load(self.swarm_id)
            self.loads += 1
            entries = ledger.events_since(self.swarm_id, last, count=1000,
                                          block_ms=None if view is None or view.settled
                                          else int(poll * 1000))
            for entry_id, fields in entries:
                last = entry_id
                self.fallback(fields)
            if view is None or (view.settled and not entries):
                self.view = view
                if view is not None:
                    self.console.file.write(view.summary(self.prices) + "\n")
                    self.console.file.flush()
                return view
