"""``swarm run TASK``: one job, non-interactive; the answer alone on stdout."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

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
from swarm.runtime.root import RootSwarm
from swarm.store.connection import Store, open_store
from swarm.store.ledger import Ledger

if TYPE_CHECKING:  # rich: imported when the swarm is first shown
    from swarm.cli.live import LiveTree

EXIT_LIMIT = 3
EXIT_CANCELLED = 4
EXIT_INTERRUPTED = 130


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
@click.argument("task", nargs=-1, required=True)
@agent_options
@click.option("--workers", type=click.IntRange(min=0), default=None, envvar="SWARM_WORKERS",
              help="Local worker processes to start when the agent spawns children (default: "
                   "1 on the embedded server, 0 with SWARM_REDIS_URL: use the deployment's). "
                   "[env: SWARM_WORKERS]")
@handle_errors
def run(task: tuple[str, ...], yes: bool | None, model: str | None, base_url: str | None,
        new: bool, max_turns: int | None, child_max_turns: int | None, workspace: Path,
        workers: int | None) -> None:
    """Run TASK in the workspace until the model answers, then print the answer on stdout.

    Thinking, commands and their output go to stderr, so `answer=$(swarm run "...")` gets
    the answer alone. Commands the safety reviewer does not pass as read-only are asked
    about on the terminal (closed stdin denies); --yes approves everything.

    When the model calls the `agent` tool, its children run as Celery tasks: on the
    embedded default, a coordinator and local workers start in the background as the
    run starts (they boot while the model thinks) and stop on their own once the
    answer is printed.

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
    check_model_configured(settings)
    interrupt_on_term()
    view = answer_view(settings)
    answer = run_job(settings, workspace, " ".join(task), workers=workers, new=new, view=view)
    if not view.shown(answer):
        click.echo(answer)


def answer_view(settings: Settings) -> TerminalView:
    """The answer streams to stdout when stdout and stderr go to one place (a terminal,
    ``2>&1``): printed again at the end, it would show twice."""
    return TerminalView.for_settings(
        settings, stream_answer=same_destination(sys.stdout, sys.stderr))


def run_job(settings: Settings, workspace: Path, task: str, *, workers: int | None = None,
            new: bool = False, view: TerminalView | None = None, attach: str = "") -> str:
    """Run ``task`` as the root agent of ``workspace`` (parking while children work); with
    ``attach`` (a swarm id), take over that swarm's root instead and finish it."""
    if not workspace.is_dir():
        raise Abort(f"workspace {workspace} does not exist; create it or pass -C to another")
    view = view or TerminalView.for_settings(settings)
    roots: list[RootSwarm] = []
    trees: list[LiveTree] = []

    approver = TerminalApprover()

    def spawner(store: Store, session: Session) -> Spawner:
        # Children's approval requests are put to a person only at a terminal; otherwise
        # they wait for `swarm approve` (and are denied when no one answers in time).
        root = RootSwarm(settings, store, workers=workers, swarm_id=attach)
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
        if sys.stdin.isatty():

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
            state, error = "failed", ""
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
                state = "cancelled"
                raise CancelledExit(f"{exc}; the session is saved") from None
            except (Interrupted, KeyboardInterrupt):
                state = "cancelled"
                raise InterruptedExit(
                    "interrupted; the session is saved" + root.on_interrupt()) from None
            finally:
                for tree in trees:
                    tree.close()
                if root.landed():  # what the children's work did to the folder, last
                    view.on_notice(root.landed())
                root.finish(state, error)
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
    root agent in its workspace, and prints its answer on stdout.
    """
    settings = settings_from(yes=yes)
    interrupt_on_term()
    with open_store(settings) as store:
        ledger = Ledger(store.redis)
        swarm_id = swarm_id or ledger.latest_swarm()
        info = ledger.swarm(swarm_id) if swarm_id else {}
    if not swarm_id or not info:
        raise Abort(f"no swarm {swarm_id or ''!r} to attach to; `swarm status` lists them")
    if info.get("state") not in ("running", "detached", "cancelled", "failed"):
        raise Abort(f"swarm {swarm_id} is {info.get('state')}; nothing to collect "
                    "(`swarm logs` shows its conversation)")
    view = answer_view(settings)
    answer = run_job(settings, Path(info["workspace"]), "", workers=workers, attach=swarm_id,
                     view=view)
    if not view.shown(answer):
        click.echo(answer)
