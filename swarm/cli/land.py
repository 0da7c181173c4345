"""``swarm land``: the children's changes kept in this folder's repository: list them,
show one, land one now, or delete them."""

from __future__ import annotations

from pathlib import Path

import click

from swarm.cli.options import Abort, handle_errors, settings_from
from swarm.errors import WorkspaceError
from swarm.workspace import gitstate as g
from swarm.workspace import homecoming
from swarm.workspace.seed import folder_cache


def _where(folder: Path) -> tuple[Path, g.WorkTree | None]:
    """The repository the kept changes of ``folder`` are in: its own git repository, or
    for a plain folder its cache on this machine (``SWARM_HOME/seeds/caches/``; one
    kept before plain folders had their own: ``SWARM_HOME/seeds/cache.git``)."""
    tree = g.discover(folder)
    if tree is not None:
        return tree.repo, tree
    home = settings_from().home
    cache = folder_cache(home, folder)
    if not (cache / "objects").is_dir():
        cache = home / "seeds" / "cache.git"
    if not (cache / "objects").is_dir():
        raise Abort(f"{folder} is not in a git repository and no swarm kept changes on this "
                    "machine")
    return cache, None


def _kept(repo: Path) -> list[tuple[str, str, str]]:
    """(swarm, agent, ref) of every child's changes kept in ``repo``."""
    out = []
    for ref in g.git("for-each-ref", "--format=%(refname)", "refs/swarm/", repo=repo).split():
        parts = ref.split("/")
        if len(parts) == 4 and parts[2] not in ("snap", "local"):
            out.append((parts[2], parts[3], ref))
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("agent_id", required=False)
@click.option("--show", is_flag=True, help="Print the child's changes (a diff) instead of "
                                           "landing them.")
@click.option("--clean", is_flag=True, help="Delete the kept changes: AGENT_ID's, the "
                                            "swarm's given with --swarm, or all.")
@click.option("--swarm", "swarm_id", default="", help="With --clean: only this swarm's.")
@click.option("-C", "folder", type=click.Path(file_okay=False, path_type=Path), default=".",
              help="Work in this folder instead of the current one.")
@handle_errors
def land(agent_id: str | None, show: bool, clean: bool, swarm_id: str, folder: Path) -> None:
    """The children's changes kept in this folder's repository.

    Every child's changes are kept as `refs/swarm/SWARM/AGENT` (not a branch: `git branch`
    does not list them) when its parent's workspace is here, landed or not; they go with
    the swarm (7 days), or at once with --clean.

    \b
    swarm land                  list them
    swarm land AGENT --show     print a child's changes (a diff over what it started from)
    swarm land AGENT            land them in the working tree now, uncommitted, merged with
                                what is there (a conflict changes nothing and names files)
    swarm land --clean [AGENT]  delete them (all, one child's, or --swarm S's)
    """
    folder = folder.resolve()
    repo, tree = _where(folder)
    kept = _kept(repo)
    if agent_id:
        kept = [k for k in kept if k[1].startswith(agent_id)]
        if not kept:
            raise Abort(f"no changes of a child {agent_id!r} are kept in {repo}: `swarm land` "
                        "lists those that are")
        if len(kept) > 1 and not clean:
            raise Abort(f"{agent_id!r} matches {len(kept)} children; give more of the id")
    if swarm_id:
        kept = [k for k in kept if k[0] == swarm_id]
    if clean:
        for _, _, ref in kept:
            g.git("update-ref", "-d", ref, repo=repo)
        click.echo(f"deleted {len(kept)} kept change{'s' if len(kept) != 1 else ''}", err=True)
        return
    if not agent_id:
        if not kept:
            click.echo(f"no children's changes are kept in {repo}", err=True)
        for swarm, agent, ref in kept:
            stat = g.git("diff", "--shortstat", f"{ref}^", ref, repo=repo).strip()
            click.echo(f"{agent}  swarm {swarm}  {stat or 'no changes'}")
        return
    _, agent, ref = kept[0]
    if show:
        click.echo(g.git("diff", "--no-ext-diff", "--no-textconv", f"{ref}^", ref, repo=repo))
        return
    top = tree.top if tree is not None else folder
    parent = homecoming.parent_of_folder(top, repo, tree, settings_from().home)
    body = {"agent_id": agent, "delta": g.rev(repo, ref), "seed": g.rev(repo, f"{ref}^")}
    try:
        done = homecoming.land(None, parent, [body], ref.split("/")[2])
    except WorkspaceError as exc:
        raise Abort(f"could not land {agent}: {exc}") from None
    if body.get("landing") == homecoming.LANDED:
        click.echo(f"landed {agent}: {done.files} files changed in {top} (uncommitted)",
                   err=True)
        return
    if body.get("landing") == homecoming.CONFLICT:
        raise Abort(f"{agent} was not landed: its changes conflict with your working tree in "
                    f"{', '.join(body['conflicts'])}; see them with `swarm land {agent} "
                    "--show`")
    raise Abort(f"{agent} was not landed: {body.get('home_error') or body.get('landing')}")

