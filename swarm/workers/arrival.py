"""A child's workspace as it arrives: a new seeded child's agent asks the model while a
thread fetches and checks out its files, and its first tool call waits for them.

The agent is built for the workspace as :meth:`~swarm.workspace.seed.Seeds.plan` says it
will be (its path, the repository its objects are in, its view), its system prompt from
the snapshot's preface (its top-level names and instruction files, stored with the seed);
its ``guard``, which runs before every save and so before every tool call, waits for the
files (:meth:`Arrival.arrive`). A workspace that could not be made raises there (or when
the run ends, if the agent never called a tool), and the run fails saying why. A seed
without a preface (skills or typed tools in it, a link at its top) and every other
workspace (found, restored, continued) are made before the agent, as they always were.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from swarm.workspace.seed import Workspace

log = logging.getLogger(__name__)


class Arrival:
    """A child's workspace: :meth:`there` already, or :meth:`begin` made in a thread."""

    def __init__(self, expected: Workspace, preface: tuple[str, str] | None = None) -> None:
        self.expected = expected
        """The workspace as it will be (the one made may differ in its view only)."""
        self.preface = preface
        """What the system prompt reads of its files while they arrive (None: there)."""
        self.hook: Callable[[Workspace], None] | None = None
        """Run once, in the run's thread, when the workspace is first waited for there."""
        self._done = threading.Event()
        self._workspace: Workspace | None = None
        self._error: BaseException | None = None
        self._arrived = False
        self._lock = threading.Lock()
        self._made = False
        self._on_made: Callable[[Workspace], None] | None = None

    @classmethod
    def there(cls, workspace: Workspace) -> Arrival:
        arrival = cls(workspace)
        arrival._workspace = workspace
        arrival._done.set()
        return arrival

    @classmethod
    def begin(cls, expected: Workspace, make: Callable[[], Workspace],
              preface: tuple[str, str]) -> Arrival:
        arrival = cls(expected, preface)
        threading.Thread(target=arrival._make, args=(make,), daemon=True,
                         name=f"seed-{expected.top.name}").start()
        return arrival

    def when_made(self, hook: Callable[[Workspace], None]) -> None:
        """Run ``hook`` on the thread that makes the workspace, as soon as it is made and
        before a wait returns it (its errors are logged); not when it was made already,
        nor when it could not be."""
        with self._lock:
            if not self._made:
                self._on_made = hook

    def _make(self, make: Callable[[], Workspace]) -> None:
        try:
            self._workspace = make()
        except BaseException as exc:  # raised in the run's thread by wait()
            self._error = exc
        finally:
            with self._lock:
                self._made, hook = True, self._on_made
            try:
                if hook is not None and self._workspace is not None:
                    hook(self._workspace)
            except Exception:
                log.exception("a hook on a workspace made failed")
            finally:
                self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Workspace:
        """The workspace once made; what making it raised, raised again."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._workspace is not None
        return self._workspace

    def arrive(self) -> Workspace:
        """:meth:`wait`, then (once, in the calling thread: the run's) :attr:`hook`."""
        workspace = self.wait()
        if not self._arrived:
            self._arrived = True
            if self.hook is not None:
                self.hook(workspace)
        return workspace

    def settled(self) -> Workspace | None:
        """The workspace made, or None if it could not be (after the thread ended)."""
        self._done.wait()
        return self._workspace
