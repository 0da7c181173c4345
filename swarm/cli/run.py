"""``swarm run TASK``: one job, non-interactive; the answer alone on stdout."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import click

from swarm import telemetry
from swarm.agent import tools
from swarm.agent.approval import TerminalApprover
from swarm.agent.protocols import Spawner
from swarm.cli.options import Abort, agent_options, handle_errors, interrupt_on_term, settings_from
from swarm.cli.render import TerminalView, same_destination
from swarm.config import Settings
from swarm.domain.approval import ApprovalRequest, Decision
from swarm.domain.session import Session
from swarm.errors import Cancelled, Interrupted, LimitReached
from swarm.runtime.build import local_agent
from swarm.runtime.root import RootSwarm, moved_on
from swarm.store.connection import Outage, Store, open_store
from swarm.store.ledger import SETTLED, AgentRecord, Ledger
from swarm.store.sessions import RedisSessionStore

if TYPE_CHECKING:  # rich: imported when the swarm is first shown
    from swarm.cli.live import LiveTree

EXIT_LIMIT = 3
EXIT_CANCELLED = 4
EXIT_INTERRUPTED = 130
INTERRUPTED = "interrupted (Ctrl-C, SIGTERM or a closed terminal)"


class LimitExit(Abort):
    exit_code = EXIT_LIMIT


class CancelledExit(Abort):
    exit_code = EXIT_CANCELLED


class InterruptedExit(Abort):
    exit_code = EXIT_INTERRUPTED


def check_model_configured(settings: Settings) -> None:
    if settings.base_url == Settings().base_url and not settings.api_key:
        raise Abort(
            "no model configured: set SWARM_BASE_URL (an OpenAI-compatible endpoint, e.g. "
            "http://127.0.0.1:8080/v1), SWARM_MODEL and SWARM_API_KEY (or OPENAI_* / EVA_*). "
            "No model at hand? `swarm demo` shows a swarm at work with a scripted model.")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("task", nargs=-1)
@click.option("-f", "--task-file", metavar="FILE",
              help="Read the task from FILE (UTF-8; - for stdin), after TASK's words if any.")
@agent_options
@click.option("--workers", type=click.IntRange(min=0), default=None, envvar="SWARM_WORKERS",
              help="Local worker processes to start when the agent spawns children (default: "
                   "1 on the embedded server, 0 with SWARM_REDIS_URL: use the deployment's). "
                   "[env: SWARM_WORKERS]")
@handle_errors
def run(task: tuple[str, ...], task_file: str | None, yes: bool | None, model: str | None,
        base_url: str | None, new: bool, max_turns: int | None, child_max_turns: int | None,
        workspace: Path,
        workers: int | None) -> None:
    """Run TASK in the workspace until the model answers, then print the answer on stdout.

    \b
      swarm run "list the five largest files here"
      swarm run -f task.md                    # the task is the file's text
      git diff | swarm run "review this diff:" -

    A `-` among TASK's words (or `-f -`) reads the task from stdin; the text of the file
    or of stdin follows the words after a blank line. An empty task is refused, and
    so is one that would take SWARM_COMPACT_AT (75%) of the model's context or more, before
    any model call (over half of it, a warning). The text of -f is the task itself: put
    large material in a file in the workspace instead and tell the agent to read it.

    Thinking, commands and their output go to stderr, so `answer=$(swarm run "...")` gets
    the answer alone. Commands the safety reviewer does not pass as read-only are asked
    about on the terminal (closed stdin denies); --yes approves everything. With the task
    on stdin, the questions are asked on the terminal (/dev/tty), as `sudo` and `less` do;
    with no terminal they are denied: use --yes or SWARM_APPROVAL policies.

    When the model calls the `agent` tool, its children run as Celery tasks: on the
    embedded default, a coordinator and local workers start in the background as the
    run starts (they boot while the model thinks) and stop on their own once the
    answer is printed. They box the children's commands in bubblewrap; where that does
    not work here, they run them unconfined, as the root runs its own, and say so once
    (with SWARM_SANDBOX=auto or bwrap they refuse them instead).

    Interrupted (Ctrl-C, a closed terminal): on the embedded default the children are
    cancelled with it; with SWARM_REDIS_URL they keep running on the deployment and
    `swarm attach SWARM_ID` collects the answer.

    Every agent stops by itself at a limit: --max-turns (the root, 200 model calls),
    --child-max-turns (a child, 50), SWARM_REPEAT_LIMIT (the same calls refused 3
    answers in a row), SWARM_TOKEN_BUDGET (the swarm's tokens, the root's counted).

    Exit codes: 0 answered, 1 error, 3 a limit stopped the root (--max-turns,
    SWARM_REPEAT_LIMIT, SWARM_TOKEN_BUDGET), 4 cancelled (swarm cancel), 130 interrupted.
    """
    settings = settings_from(yes=yes, model=model, base_url=base_url, max_turns=max_turns,
                             child_max_turns=child_max_turns)
    text, from_stdin = task_text(task, task_file)
    check_model_configured(settings)
    interrupt_on_term()
    view = answer_view(settings)
    with answers_from(from_stdin) as answers:
        answer = run_job(settings, workspace, text, workers=workers, new=new, view=view,
                         answers=answers)
    if not view.shown(answer):
        click.echo(answer)


def task_text(words: tuple[str, ...], task_file: str | None) -> tuple[str, bool]:
    """The task: TASK's words, then the text of ``task_file`` or of stdin (a ``-`` word)
    after a blank line; and whether stdin was read."""
    dashes = words.count("-")
    if dashes + (task_file is not None) > 1:
        raise click.UsageError("give the task's text once: -f FILE or - (stdin), not both")
    source = task_file if task_file is not None else ("-" if dashes else None)
    parts = [" ".join(w for w in words if w != "-")]
    if source is not None:
        parts.append(read_task_file(source).rstrip("\r\n"))
    text = "\n\n".join(p for p in parts if p.strip())
    if not text.strip():
        raise click.UsageError(
            "the task is empty: give it as words (swarm run \"...\"), -f FILE or - (stdin)")
    return text, source == "-"


def read_task_file(source: str, what: str = "task", option: str = "--task-file") -> str:
    """The UTF-8 text of file ``source`` (``-``: stdin); a clear error when it cannot be read.
    ``what`` it holds and the ``option`` that named it are for the messages."""
    param = f"'-f' / '{option}'" if source != "-" else "'-' (stdin)"
    if source == "-":
        stream = sys.stdin.buffer
        if stream.isatty():
            click.echo(f"reading the {what} from stdin; end it with Ctrl-D", err=True)
        data = stream.read()
        name = "stdin"
    else:
        path = Path(source).expanduser()
        try:
            data = path.read_bytes()
        except IsADirectoryError:
            raise click.BadParameter(f"{source} is a folder; give a file", param_hint=param
                                     ) from None
        except FileNotFoundError:
            raise click.BadParameter(f"no file {source}", param_hint=param) from None
        except OSError as exc:
            raise click.BadParameter(f"cannot read {source}: {exc.strerror or exc}",
                                     param_hint=param) from None
        name = source
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(
            f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "convert it first, e.g. `iconv -f latin1 -t utf-8`", param_hint=param) from None


@contextlib.contextmanager
def answers_from(from_stdin: bool) -> Iterator[IO[str] | None]:
    """Where approval answers are read: stdin (None), unless it held the task; then the
    terminal (/dev/tty), else nowhere (every question is denied)."""
    if not from_stdin:
        yield None
        return
    try:
        tty: IO[str] = open("/dev/tty", encoding="utf-8")  # noqa: SIM115
    except OSError:  # no controlling terminal: nobody to ask
        yield io.StringIO()
        return
    with tty:
        yield tty


def answer_view(settings: Settings) -> TerminalView:
    """The answer streams to stdout when stdout and stderr go to one place (a terminal,
    ``2>&1``): printed again at the end, it would show twice."""
    return TerminalView.for_settings(
        settings, stream_answer=same_destination(sys.stdout, sys.stderr))


def run_job(settings: Settings, workspace: Path, task: str, *, workers: int | None = None,
            new: bool = False, view: TerminalView | None = None, attach: str = "",
            answers: IO[str] | None = None) -> str:
    """Run ``task`` as the root agent of ``workspace`` (parking while children work); with
    ``attach`` (a swarm id), take over that swarm's root instead and finish it. Approvals
    are asked on stderr and answered from ``answers`` (default: stdin)."""
    if not workspace.is_dir():
        raise Abort(f"workspace {workspace} does not exist; create it or pass -C to another")
    view = view or TerminalView.for_settings(settings)
    roots: list[RootSwarm] = []
    trees: list[LiveTree] = []

    approver = TerminalApprover(stdin=answers)
    terminal = (answers or sys.stdin).isatty()

    def spawner(store: Store, session: Session, outage: Outage) -> Spawner:
        # Children's approval requests are put to a person only at a terminal; otherwise
        # they wait for `swarm approve` (and are denied when no one answers in time).
        root = RootSwarm(settings, store, workers=workers, swarm_id=attach, outage=outage)
        roots.append(root)
        root.prestart()  # local workers boot while the model thinks
        spawner = root.spawner(store, session)

        def tree() -> LiveTree:
            # Made with the swarm's first event: a job that never fans out needs no tree
            # (nor rich), and the first spawn is written before it is drawn.
            if not trees:
                trees.append(view.swarm_view(store.redis, root.swarm_id))
            return trees[0]

        root.on_event = lambda event: tree().on_swarm_event(event)
        root.notice = view.on_notice
        if terminal:

            def ask(request: ApprovalRequest) -> Decision:
                tree().pause()  # stop drawing before the prompt
                return approver(request).decision

            root.ask = ask
        return spawner

    try:
        with local_agent(settings, workspace, approver=approver, observer=view,
                         new=new, spawner=spawner, keep_parked=bool(attach)) as local:
            root = roots[0]
            if local.unconfined:
                view.on_notice(local.unconfined)
            if local.repaired:
                view.on_notice("the last run stopped mid-step; its unfinished tool calls "
                               "were marked interrupted")
            state, error, answer = "failed", "", ""
            tools.prewarm()  # while the model thinks about its first answer
            try:
                with telemetry.span("swarm", task=task[:200], workspace=str(workspace)):
                    answer = (root.attach(local.agent, local.sessions) if attach
                              else root.run(local.agent, task, local.sessions))
                state = "done"
            except LimitReached as exc:
                error = f"{type(exc).__name__}: {exc}"
                raise LimitExit(str(exc)) from None
            except Cancelled as exc:
                state, error = "cancelled", str(exc)
                raise CancelledExit(f"{exc}; the session is saved") from None
            except (Interrupted, KeyboardInterrupt):
                state, error = "cancelled", INTERRUPTED
                raise InterruptedExit(
                    "interrupted; the session is saved" + root.on_interrupt()) from None
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                for tree in trees:
                    tree.close()
                if root.landed():  # what the children's work did to the folder, last
                    view.on_notice(root.landed())
                # Its record keeps what it did and how it ended, whatever comes later.
                root.finish(state, local.agent.session, answer, error)
                root.close()  # before the store closes: the local processes are told
                telemetry.flush()
    finally:
        for root in roots:  # also when the agent could not be built (say, a wrong model id)
            root.close()
    return answer


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("swarm_id", required=False)
@click.option("-y", "--yes", is_flag=True, default=None, envvar="SWARM_YES",
              help="Approve every tool call of the root without asking. [env: SWARM_YES]")
@click.option("--workers", type=click.IntRange(min=0), default=None, envvar="SWARM_WORKERS",
              help="Local worker processes to start (as for `swarm run`).")
@handle_errors
def attach(swarm_id: str | None, yes: bool | None, workers: int | None) -> None:
    """Collect the answer of a swarm whose `swarm run` went away (default: the latest).

    Waits for its children (showing their progress and approval requests), resumes the
    root agent in its workspace, and prints its answer on stdout. A swarm that has
    settled is not resumed: its kept answer is printed (exit 0), or how it ended is
    said (exit 4 cancelled, 1 failed). Only the swarm's own conversation is resumed: if
    a later run in its folder went on with it, attach refuses and changes nothing.
    """
    settings = settings_from(yes=yes)
    interrupt_on_term()
    with open_store(settings) as store:
        ledger = Ledger(store.redis)
        swarm_id = swarm_id or ledger.latest_swarm()
        info = ledger.swarm(swarm_id) if swarm_id else {}
        if not swarm_id or not info:
            raise Abort(f"no swarm {swarm_id or ''!r} to attach to; `swarm status` lists them")
        root = ledger.agent(info.get("root") or swarm_id)
        if info.get("state") in SETTLED:
            click.echo(settled_answer(swarm_id, info, root))
            return
        if root is None or root.kind != "root":
            raise Abort(f"swarm {swarm_id} is a job run by the workers, not a terminal's root; "
                        f"`swarm status {swarm_id}` follows it")
        gone = moved_on(ledger, root, RedisSessionStore(store.redis).load(root.session_id))
    if gone:
        raise Abort(f"swarm {swarm_id} cannot be resumed: {gone}. `swarm status {swarm_id}` "
                    "shows what its children did; `swarm land` lands their work")
    view = answer_view(settings)
    answer = run_job(settings, Path(info["workspace"]), "", workers=workers, attach=swarm_id,
                     view=view)
    if not view.shown(answer):
        click.echo(answer)


def settled_answer(swarm_id: str, info: dict[str, str], root: AgentRecord | None) -> str:
    """The answer of a swarm that settled, or an error saying how it ended (with the exit
    code of a `swarm run` that ended so)."""
    state = info.get("state", "")
    why = (root.error if root is not None else "") or info.get("error", "")
    if state == "done":
        if root is not None and root.kept:
            return root.answer
        raise Abort(f"swarm {swarm_id} is done; its answer was not kept with it (a swarm "
                    f"from before answers were): `swarm logs {swarm_id}` shows its conversation")
    if state == "cancelled":
        raise CancelledExit(f"swarm {swarm_id} was cancelled" + (f": {why}" if why else ""))
    raise Abort(f"swarm {swarm_id} {state.replace('_', ' ')}: "
                f"{why or 'no reason was recorded'}")
