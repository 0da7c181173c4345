"""Git plumbing for workspaces that travel: trees of a folder as its agent sees it,
deterministic commits of them, bundles, three-way merges in the object store, a child's
repository of its own. Nothing here touches a user's index, ``HEAD`` or branches (each
tree is written through a temporary index), and nothing here talks to Redis
(:mod:`swarm.workspace.seed` does).

What a tree holds: in a git repository, ``HEAD`` plus staged, unstaged and untracked
files that no ignore rule excludes; in a plain folder, its files minus what
``.gitignore`` files exclude. In both, ``.swarmignore`` at the top adds rules, and the
usual secret files (:data:`SECRET_PATTERNS`) are left out unless a ``.swarmignore``
negation (``!.env.example``) lets one through. Files git already tracks are kept (they
are in the repository's history already).

Which git runs here: the worker's own, unconfined (as root on a root worker), on folders
sandboxed commands write. So no git process here finds its repository from a work tree:
each is given its git directory (``GIT_DIR``: a :class:`WorkTree`'s repository, chosen by
the worker and never read from the work tree's ``.git``, or a bare cache), its work tree
and its index, and :data:`SAFE` overrides whatever config would run a program (hooks,
fsmonitor, signing, remote helpers). The repositories' own config, hooks and ``info``
stay read-only in the box (:mod:`swarm.agent.sandbox`), so the filter and diff drivers a
``.gitattributes`` may select are the ones their owner configured. Only a root in a
terminal finds its repository from its folder (:func:`discover`), before its commands run.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import WorkspaceError

#: Left out of every snapshot unless git tracks them or a ``.swarmignore`` negation
#: lets them through.
SECRET_PATTERNS = (".env*", "*.pem", "*.key", "id_rsa*", "id_dsa*", "id_ecdsa*",
                   "id_ed25519*", ".netrc", ".pgpass", ".npmrc", ".pypirc", "*.p12", "*.pfx",
                   "*.kdbx", ".aws/", ".ssh/", ".gnupg/", ".docker/config.json",
                   "credentials.json", "*.tfstate")

#: Commits made for transport are deterministic: the same tree (and parent) gives the same
#: commit id on every host, so a snapshot's id is its content.
IDENT = {"GIT_AUTHOR_NAME": "swarm", "GIT_AUTHOR_EMAIL": "swarm@localhost",
         "GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_NAME": "swarm",
         "GIT_COMMITTER_EMAIL": "swarm@localhost", "GIT_COMMITTER_DATE": "1700000000 +0000"}

#: A full object id: SHA-1 (40 hex digits) or SHA-256 (64).
_OBJECT_ID = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")

#: The id of git's empty tree.
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"

#: Config every git process here runs with (over any file's): nothing it reads from a
#: repository or a work tree makes it start a program.
SAFE = (("core.hooksPath", "/dev/null"), ("core.fsmonitor", "false"),
        ("commit.gpgSign", "false"), ("tag.gpgSign", "false"),
        ("protocol.allow", "never"), ("protocol.file.allow", "always"),
        ("core.alternateRefsCommand", "true"), ("credential.helper", ""),
        ("submodule.recurse", "false"), ("fetch.recurseSubmodules", "false"),
        ("safe.bareRepository", "explicit"), ("gc.auto", "0"), ("maintenance.auto", "false"))

#: The worker's own variables git still gets (identity, which config files it reads).
_KEPT = ("GIT_AUTHOR_", "GIT_COMMITTER_", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM",
         "GIT_CONFIG_NOSYSTEM")


def _environ(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GIT_") or k.startswith(_KEPT)}
    # A path given to git is that path, never a glob ("pages/[id].tsx").
    env.update(GIT_TERMINAL_PROMPT="0", GIT_LITERAL_PATHSPECS="1",
               GIT_CONFIG_COUNT=str(len(SAFE)))
    for n, (key, value) in enumerate(SAFE):
        env[f"GIT_CONFIG_KEY_{n}"], env[f"GIT_CONFIG_VALUE_{n}"] = key, value
    return {**env, **(extra or {})}


def git(*args: str, repo: Path | None = None, cwd: Path | None = None,
        env: dict[str, str] | None = None, timeout: float = 300, input: str | None = None,
        raw: bool = False) -> str:
    """``git ARGS`` (output stripped, but with ``raw``: for ``-z`` output, where a name may
    begin or end with a space) in the repository ``repo`` (its git directory), or as
    ``env`` says (``GIT_DIR`` and the rest), given ``input`` on its stdin;
    :class:`WorkspaceError` with git's message. Names that are not UTF-8 come back as
    Python does file names (``surrogateescape``)."""
    if repo is not None:  # its config is its own (never a commondir file's)
        env = {"GIT_DIR": str(repo), "GIT_COMMON_DIR": str(repo), **(env or {})}
        cwd = cwd or repo
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True,
                             encoding="utf-8", errors="surrogateescape",
                             timeout=timeout, env=_environ(env), input=input,
                             stdin=subprocess.DEVNULL if input is None else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WorkspaceError(f"git {args[0]} failed: {exc}") from None
    if out.returncode != 0:
        raise WorkspaceError(f"git {' '.join(args[:2])} failed: {out.stderr.strip()[-500:]}")
    return out.stdout if raw else out.stdout.strip()


def git_head(*args: str, repo: Path, limit: int, timeout: float = 60) -> tuple[str, bool]:
    """The first ``limit`` bytes of ``git ARGS``'s output in the repository ``repo`` (decoded,
    a broken last character replaced), and whether there was more (git is stopped then: a
    large diff is never read whole); :class:`WorkspaceError` with git's message."""
    env = _environ({"GIT_DIR": str(repo), "GIT_COMMON_DIR": str(repo)})
    try:
        with subprocess.Popen(["git", *args], cwd=repo, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            out = proc.stdout.read(limit + 1)
            more = len(out) > limit
            if more:
                proc.kill()
            err = proc.stderr.read(4000)
            code = proc.wait(timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WorkspaceError(f"git {args[0]} failed: {exc}") from None
    if code != 0 and not more:
        raise WorkspaceError(f"git {' '.join(args[:2])} failed: "
                             f"{err.decode(errors='replace').strip()[-500:]}")
    return out[:limit].decode("utf-8", errors="replace"), more


def merge_trees(repo: Path, ours: str, theirs: str) -> tuple[str, list[str]]:
    """Merge commits ``theirs`` into ``ours`` (their merge base: the commit both are
    over) without a work tree or an index: the merged tree, and the paths in conflict
    (then the tree holds conflict markers and must not be used)."""
    env = _environ({"GIT_DIR": str(repo), "GIT_COMMON_DIR": str(repo)})
    try:
        out = subprocess.run(["git", "merge-tree", "--write-tree", "-z", "--name-only",
                              "--no-messages", ours, theirs], cwd=repo, capture_output=True,
                             timeout=300, stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WorkspaceError(f"git merge-tree failed: {exc}") from None
    if out.returncode not in (0, 1):
        raise WorkspaceError(f"git merge-tree failed: "
                             f"{out.stderr.decode(errors='replace').strip()[-500:]}")
    tree, *paths = out.stdout.decode(errors="surrogateescape").split("\0")
    conflicts = sorted({p for p in paths if p}) if out.returncode == 1 else []
    return tree.strip(), conflicts


def own_repository(top: Path, odb: Path, branch: str, start: str) -> Path:
    """A repository of its own at ``top/.git`` for a child's commands: ``branch`` at
    commit ``start`` of ``odb``, whose objects it borrows (read-only, through
    ``objects/info/alternates``); no index yet. Made by the worker before any command
    runs there; the worker's git never uses it afterwards (its config is the child's)."""
    # What `git init --template=` writes, without a git process (one a child at width).
    dot = top / ".git"
    info = dot / "objects" / "info"
    info.mkdir(parents=True, exist_ok=True)
    (dot / "objects" / "pack").mkdir(exist_ok=True)
    (dot / "refs" / "tags").mkdir(parents=True, exist_ok=True)
    sha256 = len(start) == 64
    (dot / "config").write_text(
        f"[core]\n\trepositoryformatversion = {1 if sha256 else 0}\n"
        f"\tfilemode = {'true' if _exec_bits(dot) else 'false'}\n"
        "\tbare = false\n\tlogallrefupdates = true\n"
        + ("[extensions]\n\tobjectformat = sha256\n" if sha256 else ""))
    (info / "alternates").write_text(f"{(odb / 'objects').resolve()}\n")
    ref = dot / "refs" / "heads" / branch
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(f"{start}\n")
    (dot / "HEAD").write_text(f"ref: refs/heads/{branch}\n")
    return dot


def _exec_bits(folder: Path) -> bool:
    """Whether files in ``folder`` keep an executable bit (git's ``core.filemode`` probe)."""
    probe = folder / f".filemode-{os.getpid()}-{threading.get_ident()}"
    try:
        probe.touch(0o644)
        probe.chmod(0o755)
        return bool(probe.stat().st_mode & 0o100)
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def ok(*args: str, repo: Path | None = None, cwd: Path | None = None,
       env: dict[str, str] | None = None) -> bool:
    """Whether ``git ARGS`` succeeds."""
    try:
        git(*args, repo=repo, cwd=cwd, env=env)
    except WorkspaceError:
        return False
    return True


@dataclass(frozen=True)
class WorkTree:
    """A work tree and the git folders the worker chose for it: the repository ``repo``
    (its git directory) and ``name``, its worktree's folder under ``repo/worktrees`` (""
    for the repository's main work tree). Git reads its index and ``HEAD`` from there,
    never from the work tree's ``.git``, which a command may have rewritten."""

    top: Path
    repo: Path
    name: str = ""

    @property
    def admin(self) -> Path:
        """The worktree's own git folder (its index, ``HEAD``)."""
        return self.repo / "worktrees" / self.name if self.name else self.repo

    @property
    def head(self) -> str:
        """Its ``HEAD`` as a ref name of the repository."""
        return f"worktrees/{self.name}/HEAD" if self.name else "HEAD"

    def env(self, index: Path | None = None) -> dict[str, str]:
        """Git on this work tree with ``index`` (default: its own)."""
        return {"GIT_DIR": str(self.repo), "GIT_COMMON_DIR": str(self.repo),
                "GIT_WORK_TREE": str(self.top),
                "GIT_INDEX_FILE": str(index or self.admin / "index")}


def discover(path: Path) -> WorkTree | None:
    """The work tree holding ``path`` and its repository, found from ``path`` as git finds
    them (None outside git): for a root in a terminal or a job, in its own folder, before
    its commands run (:meth:`swarm.workspace.seed.Seeds.pinned` keeps what it found)."""
    if not path.is_dir() or not inside_git(path):
        return None
    try:
        top, common, own = git("rev-parse", "--path-format=absolute", "--show-toplevel",
                               "--git-common-dir", "--git-dir", cwd=path).splitlines()
    except (WorkspaceError, ValueError):
        return None
    common_path, own_path = Path(common), Path(own)
    dot = Path(top) / ".git"
    if dot.is_dir() and not dot.is_symlink():  # a repository's own: a commondir is planted
        return WorkTree(Path(top), dot)
    name = "" if own_path == common_path else own_path.name
    return WorkTree(Path(top), common_path, name)


def inside_git(path: Path) -> bool:
    """Whether ``path`` or a folder above it has a ``.git`` (no process started)."""
    path = path.resolve()
    return any((p / ".git").exists() for p in (path, *path.parents))


def ensure_bare(path: Path) -> Path:
    """A bare repository at ``path`` (created if missing): a host's cache of snapshots."""
    if not (path / "objects").is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        git("init", "-q", "--bare", str(path))
        git("config", "gc.auto", "0", repo=path)
    return path


@functools.cache
def _user_excludes() -> tuple[str, ...]:
    """The lines of the user's global excludes file (read once per process)."""
    configured = ""
    with contextlib.suppress(WorkspaceError):
        configured = git("config", "--global", "--path", "core.excludesFile")
    xdg = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "git" / "ignore"
    for source in (Path(configured) if configured else None, xdg):
        if source is not None and source.is_file():
            return tuple(source.read_text(errors="replace").splitlines())
    return ()


def _excludes(top: Path) -> Path:
    """An excludes file: the user's global one, the secret patterns, then ``.swarmignore``
    (later lines win, so a negation there lets a secret pattern's file through). Kept by
    its content in this process's own folder (:func:`_scratch`): written once, then read
    by every tree of a folder with the same rules."""
    lines = [*_user_excludes(), *SECRET_PATTERNS]
    ignore = top / ".swarmignore"
    if ignore.is_file():
        lines += ignore.read_text(errors="replace").splitlines()
    text = "\n".join(lines) + "\n"
    folder = _scratch(os.getpid())
    path = folder / hashlib.sha256(text.encode()).hexdigest()[:32]
    # Looked for each time: git takes a missing excludes file for an empty one (no secret
    # left out), and a tmp cleaner may take it from a long-lived worker.
    if not path.is_file():
        folder.mkdir(mode=0o700, exist_ok=True)
        tmp = folder / f".{path.name}.{threading.get_ident()}"
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


@functools.cache
def _scratch(pid: int) -> Path:
    """A private folder of the process ``pid`` (this one: a forked child makes its own),
    removed as it exits."""
    folder = Path(tempfile.mkdtemp(prefix="swarm-git-"))

    def remove() -> None:
        if os.getpid() == pid:  # not in a forked child that inherited the handler
            shutil.rmtree(folder, ignore_errors=True)

    atexit.register(remove)
    return folder


def write_tree(top: Path | WorkTree, *, odb: Path | None = None,
               index: Path | None = None, keep: Path | None = None) -> str:
    """The tree of a folder as its agent sees it. A git :class:`WorkTree` is read through
    a copy of its index (unchanged files are not hashed again); a plain folder ``top`` is
    read into the bare repository ``odb`` with ``index`` (kept between snapshots of the
    same folder, for the same reason). ``keep``: where to copy the index that holds the
    tree, its entries' file times fresh (to write the folder from later)."""
    if not isinstance(top, WorkTree):
        assert odb is not None and index is not None
        index.parent.mkdir(parents=True, exist_ok=True)
        return _add_and_write(top, {"GIT_DIR": str(odb), "GIT_WORK_TREE": str(top),
                                    "GIT_INDEX_FILE": str(index)}, keep, UNTRUSTED_CTIME)
    with tempfile.TemporaryDirectory(prefix="swarm-tree-") as tmp:
        temp = Path(tmp) / "index"
        with contextlib.suppress(FileNotFoundError):
            # With its mtime: git tells "racily clean" entries by it.
            shutil.copy2(top.admin / "index", temp)
        return _add_and_write(top.top, top.env(temp), keep)


#: How git reads the indexes swarm keeps of its own folders (a child's workspace, the
#: host's shared checkouts, a plain folder's): a file's ctime is not a change. The host
#: changes those of a shared checkout's files without changing them (ACL entries, the
#: links of the next snapshot's checkout). A file's size and mtime still tell, as they do
#: for :func:`~swarm.workspace.views.changed`: a rewrite of the same size whose writer put
#: its mtime back (``cp -p``, ``touch -r``) goes unseen.
UNTRUSTED_CTIME = ("-c", "core.trustctime=false")


def _add_and_write(folder: Path, env: dict[str, str], keep: Path | None,
                   config: tuple[str, ...] = ()) -> str:
    git(*config, "-c", f"core.excludesFile={_excludes(folder)}", "-c", "core.autocrlf=false",
        "add", "-A", "--ignore-errors", "--", ".", cwd=folder, env=env)
    tree = git("write-tree", cwd=folder, env=env)
    if keep is not None:
        shutil.copy2(env["GIT_INDEX_FILE"], keep)
    return tree


@functools.lru_cache(maxsize=4096)
def tree_of(repo: Path, commit: str) -> str:
    """The tree of ``commit`` (a full id) in ``repo``, asked of git once per process (a
    commit's tree never changes)."""
    return git("rev-parse", "--verify", "-q", f"{commit}^{{tree}}", repo=repo)


def commit(repo: Path, tree: str, parents: list[str], message: str,
           deterministic: bool = True) -> str:
    """A commit of ``tree`` in the repository ``repo`` (its git directory). A deterministic
    one is written here, the bytes ``git commit-tree`` writes with :data:`IDENT` (a git
    process less a child's capture: ~1-2 ms of CPU)."""
    if deterministic and not _shared(repo) and all(
            _OBJECT_ID.fullmatch(x) and len(x) == len(tree) for x in (tree, *parents)):
        return _write_commit(repo, tree, parents, message)
    args = ["commit-tree", tree, "-m", message]
    for parent in parents:
        args += ["-p", parent]
    return git(*args, repo=repo, env=IDENT if deterministic else None)


@functools.lru_cache(maxsize=256)
def _shared(repo: Path) -> bool:
    """Whether ``repo``'s config may set ``core.sharedRepository`` (git gives the objects
    it writes there a group's permissions: it writes them itself)."""
    try:
        return "sharedrepository" in (repo / "config").read_text(errors="replace").lower()
    except OSError:
        return False


def _write_commit(repo: Path, tree: str, parents: list[str], message: str) -> str:
    """:func:`commit`'s loose object, written as git writes one (a read-only temporary
    file renamed into place), unless it is there."""
    author = f"{IDENT['GIT_AUTHOR_NAME']} <{IDENT['GIT_AUTHOR_EMAIL']}> {IDENT['GIT_AUTHOR_DATE']}"
    committer = (f"{IDENT['GIT_COMMITTER_NAME']} <{IDENT['GIT_COMMITTER_EMAIL']}> "
                 f"{IDENT['GIT_COMMITTER_DATE']}")
    body = "".join([f"tree {tree}\n", *(f"parent {p}\n" for p in parents),
                    f"author {author}\n", f"committer {committer}\n\n", message,
                    "" if message.endswith("\n") else "\n"]).encode()
    data = b"commit %d\0" % len(body) + body
    # The repository's object format is its ids': 40 hex digits SHA-1, 64 SHA-256.
    sid = (hashlib.sha1 if len(tree) == 40 else hashlib.sha256)(data).hexdigest()
    folder = repo / "objects" / sid[:2]
    path = folder / sid[2:]
    if path.exists():
        return sid
    temp = folder / f"tmp_obj_{os.urandom(8).hex()}"
    try:
        folder.mkdir(exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        with os.fdopen(fd, "wb") as out:
            out.write(zlib.compress(data, 1))
        os.replace(temp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise WorkspaceError(f"writing commit {sid} in {repo} failed: {exc}") from None
    return sid


def has(repo: Path, sha: str) -> bool:
    return bool(sha) and ok("cat-file", "-e", f"{sha}^{{commit}}", repo=repo)


def tree_stats(repo: Path, tree: str) -> tuple[int, int]:
    """(files, bytes) of a tree."""
    files = size = 0
    for line in git("ls-tree", "-r", "-l", tree, repo=repo).splitlines():
        meta = line.split("\t", 1)[0].split()
        if len(meta) == 4 and meta[1] == "blob":
            files += 1
            size += int(meta[3]) if meta[3].isdigit() else 0
    return files, size


#: Bytes of a preface's files at most (larger: no preface, the child waits for its files).
PREFACE_MAX = 64 * 1024


def preface(repo: Path, tree: str) -> tuple[list[str], dict[str, str]] | None:
    """What an agent's system prompt reads of a workspace whose files are the tree
    ``tree``: its top-level names (a folder's ending in ``/``) and the text of its
    ``AGENTS.md`` and ``.swarm/instructions.md`` (by path), so a child's first model
    request need not wait for its files. None where the prompt would read more (skills or
    typed tools under ``.swarm/``), a name is a symbolic link (a folder or not, the
    listing follows it), or the files pass :data:`PREFACE_MAX`."""
    def entries(of: str) -> list[tuple[str, str, str]]:
        out = git("ls-tree", "-z", of, repo=repo, raw=True)
        found = []
        for item in filter(None, out.split("\0")):
            head, _, name = item.partition("\t")
            mode, _kind, sha = head.split()
            found.append((mode, sha, name))
        return found

    top = entries(tree)
    files: dict[str, str] = {}
    wanted = {"AGENTS.md": "", ".swarm/instructions.md": ""}
    for mode, sha, name in top:
        if mode == "120000":
            return None
        if name == ".swarm":
            if mode != "040000":
                return None
            for sub_mode, sub_sha, sub in entries(sha):
                if sub in ("skills", "tools"):
                    return None
                if sub == "instructions.md":
                    if sub_mode not in ("100644", "100755"):
                        return None
                    wanted[".swarm/instructions.md"] = sub_sha
        elif name == "AGENTS.md":
            if mode not in ("100644", "100755"):
                return None
            wanted[name] = sha
    size = 0
    for rel, sha in wanted.items():
        if sha:
            size += int(git("cat-file", "-s", sha, repo=repo))
            if size > PREFACE_MAX:
                return None
            files[rel] = git("cat-file", "blob", sha, repo=repo, raw=True).encode(
                "utf-8", "surrogateescape").decode("utf-8", "replace")
    return [name + "/" if mode in ("040000", "160000") else name
            for mode, _sha, name in top], files


#: The first line of a whole snapshot's stored form (:func:`bundle`): a pack and its index.
PACK_HEAD = b"# swarm pack v1\n"


def bundle(repo: Path, sha: str, base: str = "") -> bytes:
    """Commit ``sha`` as stored (:func:`unbundle` reads it; it keeps it by the ref
    ``refs/swarm/snap/<sha>``). Whole (no ``base``): a pack of its objects with the pack's
    index (:data:`PACK_HEAD`, then ``SHA PACKNAME INDEXSIZE``, the index, the pack), which a
    host writes into its repository as it is: no ``index-pack`` reads every object again
    there. Over ``base``: a git bundle of only the objects ``base`` lacks (those of its tree
    too, whether or not ``base`` is an ancestor: a snapshot is a commit without parents, and
    two snapshots of one repository share most of their files), a changed file as a delta
    over its version in ``base``, one ``pack-objects`` behind a header written here (what
    ``git bundle create`` writes). Nothing is written in ``repo``: :func:`keep` the commit
    there if it must outlive a ``git gc``."""
    if not base:
        return _whole(repo, sha)
    # `git bundle create ref ^base` leaves out what is reachable from base only through
    # history; --shallow marks every tree of base as there (git's "aggressive edges"),
    # --thin lets a changed file travel as a delta (the fetch's index-pack completes it).
    pack = _pack_objects(repo, ["--thin", "--shallow", "--stdout"], f"{sha}\n^{base}\n")
    # v2 for SHA-1 ids; v3 names the object format otherwise.
    head = "# v2 git bundle\n" if len(sha) == 40 else \
        "# v3 git bundle\n@object-format=sha256\n"
    return f"{head}-{base} swarm base\n{sha} refs/swarm/snap/{sha}\n\n".encode() + pack


def _pack_objects(repo: Path, args: list[str], revs: str, cwd: Path | None = None) -> bytes:
    window = [] if "--thin" in args else ["-c", "pack.window=0"]
    try:
        done = subprocess.run(
            ["git", "-c", "pack.compression=1", "-c", "pack.packSizeLimit=0", *window,
             "pack-objects", "--revs",
             "--delta-base-offset", "-q", *args], input=revs.encode(), capture_output=True,
            timeout=300, env=_environ({"GIT_DIR": str(repo), "GIT_COMMON_DIR": str(repo)}),
            cwd=cwd or repo)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WorkspaceError(f"git pack-objects failed: {exc}") from None
    if done.returncode != 0:
        raise WorkspaceError("git pack-objects failed: "
                             f"{done.stderr.decode(errors='replace').strip()[-500:]}")
    return done.stdout


def _whole(repo: Path, sha: str) -> bytes:
    # git writes the pack in the repository, then renames it to the name given: a folder
    # on the repository's file system (a /tmp elsewhere fails with EXDEV), where git looks
    # for no pack (only files directly in objects/pack are).
    # A box of the root's writes there too: the files are read from the folder made (its
    # descriptor), as regular files only (not a link it put in their place).
    packs = repo / "objects" / "pack"
    packs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".swarm-pack-", dir=packs) as tmp:
        folder = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            names = _pack_objects(repo, [str(Path(tmp) / "p")],
                                  f"{sha}\n", cwd=Path(tmp)).decode().split()
            if len(names) != 1:
                raise WorkspaceError(f"git pack-objects made {len(names)} packs of "
                                     f"{sha[:12]}, not one")
            try:
                index = _regular(folder, f"p-{names[0]}.idx")
                pack = _regular(folder, f"p-{names[0]}.pack")
            except OSError as exc:
                raise WorkspaceError(f"the pack of {sha[:12]} cannot be read: {exc}") from None
        finally:
            os.close(folder)
    return PACK_HEAD + f"{sha} {names[0]} {len(index)}\n".encode() + index + pack


def _regular(folder: int, name: str) -> bytes:
    """The bytes of the regular file ``name`` in the folder ``folder`` (OSError for a link,
    or anything else)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
        return file.read()


def unbundle(repo: Path, sha: str, data: bytes) -> None:
    """Put the stored commit ``sha`` (and its objects: :func:`bundle`) into ``repo``, kept
    by a ref. A whole one's pack and index are written there as they are (the pack
    first: git sees a pack once its index is there); WorkspaceError when they are not
    ``sha``'s."""
    ref = f"refs/swarm/snap/{sha}"
    if data.startswith(PACK_HEAD):
        end = data.index(b"\n", len(PACK_HEAD))
        commit, name, size = data[len(PACK_HEAD):end].decode().split()
        body = memoryview(data)[end + 1:]
        if commit != sha or not all(c in "0123456789abcdef" for c in name) or \
                len(name) not in (40, 64) or not size.isdigit() or \
                not 0 < int(size) < len(body):
            raise WorkspaceError(f"the stored snapshot {sha[:12]} is not what it says")
        packs = repo / "objects" / "pack"
        packs.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        try:
            for suffix, part in ((".pack", body[int(size):]), (".idx", body[:int(size)])):
                final = packs / f"pack-{name}{suffix}"
                if not final.exists():
                    temp = packs / f".tmp-{os.getpid()}-{threading.get_ident()}-{name}{suffix}"
                    temp.write_bytes(part)
                    os.replace(temp, final)
                    written.append(final)
            keep(repo, sha)  # git reads there, through the index, that the commit is in it
        except (OSError, WorkspaceError) as exc:
            for path in reversed(written):  # a later fetch writes them again
                with contextlib.suppress(OSError):
                    path.unlink()
            raise WorkspaceError(f"the stored snapshot {sha[:12]} could not be put in "
                                 f"{repo}: {exc}") from None
        return
    with tempfile.TemporaryDirectory(prefix="swarm-bundle-") as tmp:
        path = Path(tmp) / "b.bundle"
        path.write_bytes(data)
        git("-c", "gc.auto=0", "-c", "maintenance.auto=false", "fetch", "-q",
            "--no-write-fetch-head", str(path), f"{ref}:{ref}", repo=repo)


def keep(repo: Path, sha: str) -> None:
    """A ref on ``sha`` so no ``git gc`` drops it while the swarm may need it."""
    git("update-ref", f"refs/swarm/snap/{sha}", sha, repo=repo)


def checkout_files(repo: Path, sha: str, into: Path, files: list[str] | None = None) -> None:
    """Write the files of commit ``sha`` (or only ``files`` of it) under ``into``, through
    a temporary index (no ``.git`` there)."""
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarm-index-") as tmp:
        env = {"GIT_DIR": str(repo), "GIT_WORK_TREE": str(into),
               "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if files is None:
            git("read-tree", "-u", "--reset", sha, cwd=into, env=env)
        elif files:
            git("read-tree", sha, cwd=into, env=env)
            git("checkout-index", "-f", "--", *files, cwd=into, env=env)


def rev(repo: Path, name: str) -> str:
    """The commit ``name`` is, or ""."""
    try:
        return git("rev-parse", "--verify", "-q", f"{name}^{{commit}}", repo=repo)
    except WorkspaceError:
        return ""
