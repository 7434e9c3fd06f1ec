"""One process per run directory.

Two guarantees, both needed because Hydra names a run directory by the second it starts in:
- `claim_new` picks a fresh directory for a new run and creates it with an exclusive mkdir, so two runs
  started in the same second get two directories (`12-00-00` and `12-00-00-2`), never one shared.
- `RunLock` holds an exclusive advisory lock (flock) on `<run dir>/.lock` for the life of the process
  that trains in it. The kernel drops the lock when the process dies, however it dies (SIGKILL
  included), so a lock is never stale; a second live process on the same run (a concurrent resume, or a
  new run pointed at a directory in use) is refused in one line.
- `own` makes this process the directory's owner: it takes the lock and remembers what the process
  created there (the directory and its parents, the lock file, Hydra's record and log), so that a run
  that ends before it began removes those and nothing else. One process owns a directory (rank 0 under
  torchrun; the other ranks never lock it), takes the lock once and releases it once: a run refused by
  the lock deletes nothing, since it owns nothing.
flock is local to one machine on most network filesystems' default settings; two hosts resuming one run
on a shared filesystem at once are not detected there.
"""
from __future__ import annotations

import datetime as _dt
import errno
import os
import shutil
import socket
from pathlib import Path
from typing import Iterable, Optional

# What a run directory holds, by name (README's table says what each is).
LOCK_FILE = ".lock"
RUN_FILE = "run.json"  # marks a scaffold run directory; holds the resolved config for resume
RESULT_FILE = "result.json"
CENSUS_FILE = "census.json"
STATS_FILE = "train_stats.csv"
CHECKPOINT_DIR = "checkpoints"
# What Hydra writes into a run directory before the task runs: its record of the config and the log.
HYDRA_FILES = (".hydra", "train.log")


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory; the message is one line."""


def claim_new(pattern: str, now: Optional[_dt.datetime] = None) -> Path:
    """Create and return a run directory that no other run has: `pattern` with `${now:FMT}` resolved
    (Hydra's resolver syntax), or that name with `-2`, `-3`, ... when it is taken."""
    now = now or _dt.datetime.now()
    name = _resolve_now(pattern, now)
    base = Path(name)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"{base}: no free run directory name")  # 10,000 runs started in one second


def own_new(pattern: str, now: Optional[_dt.datetime] = None) -> "Claim":
    """`claim_new`, owned by this process: its lock taken, the folders it created remembered."""
    now = now or _dt.datetime.now()
    parents = _makedirs(Path(_resolve_now(pattern, now)).absolute().parent)
    path = claim_new(pattern, now).absolute()
    return own(path, made=parents + [path])


def claim_new_made(pattern: str, now: Optional[_dt.datetime] = None) -> list[Path]:
    """`claim_new`, returning every folder it created, outermost first (the new directory last): what
    `remove_if_empty` may take away again when nothing was written into them."""
    now = now or _dt.datetime.now()
    parents = _makedirs(Path(_resolve_now(pattern, now)).absolute().parent)
    return parents + [claim_new(pattern, now).absolute()]


def remove_if_empty(made: list[Path]) -> None:
    """Remove the folders of `made` (outermost first) from the innermost out, while they are empty."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            break  # something is in it: leave it and its parents


def _resolve_now(pattern: str, now: _dt.datetime) -> str:
    out, rest = [], pattern
    while "${now:" in rest:
        head, tail = rest.split("${now:", 1)
        fmt, rest = tail.split("}", 1)
        out += [head, now.strftime(fmt)]
    return "".join(out + [rest])


def is_fixed(pattern: str) -> bool:
    """Whether `pattern` uses no interpolation but `${now:...}` (so this module can resolve it)."""
    return "${" not in pattern.replace("${now:", "")


class RunLock:
    """An exclusive lock on a run directory, held until `release` or the process's end."""

    def __init__(self, run_dir: Path, remove_on_failure: bool = False):
        """`remove_on_failure`: the lock file is new (this process creates it); when the pid cannot be
        written into it (a full disk), it is removed, so no 0-byte lock file is left."""
        import fcntl

        self.path = Path(run_dir) / LOCK_FILE
        for _ in range(100):
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(self.fd)
                os.close(self.fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise RunDirBusy(f"run directory {run_dir} is in use by another process "
                                     f"({holder or 'unknown'}): wait for it to end, or use another directory"
                                     ) from None
                raise
            # The file locked must still be the one at the path: an owner that ended before its run
            # began removes its lock file (holding the lock), and a lock on a removed file guards nothing.
            try:
                if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(self.fd)
        else:
            raise RunDirBusy(f"run directory {run_dir}: its lock file keeps being replaced")
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError:  # a full disk: a lock file created here goes (removed while still held)
            if remove_on_failure:
                self.path.unlink(missing_ok=True)
            self.release()
            raise

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def check_free(run_dir: Path) -> None:
    """Raise RunDirBusy when a live process holds `run_dir` (a probe: takes and drops the lock)."""
    if (Path(run_dir) / LOCK_FILE).exists():
        RunLock(run_dir).release()


class Claim:
    """This process's ownership of a run directory: its lock, and what this process created there."""

    def __init__(self, run_dir: Path, lock: RunLock, made: list[Path], ours: set[str]):
        self.path, self.lock, self.made, self.ours = Path(run_dir), lock, made, ours

    def release(self, remove_unused: bool = False) -> None:
        """Give the directory up; with `remove_unused`, first remove what this process created in it when
        the run never began (no run.json): the lock file, Hydra's record and log where this process wrote
        them, and the directories it made once empty. Nothing else is ever removed."""
        if self.lock.fd is None:
            return
        _CLAIMS.pop(_key(self.path), None)
        try:
            if remove_unused and not (self.path / RUN_FILE).exists():
                for name in sorted(self.ours - {LOCK_FILE}):
                    target = self.path / name
                    if target.is_dir() and not target.is_symlink():
                        shutil.rmtree(target, ignore_errors=True)
                    else:
                        target.unlink(missing_ok=True)
                if LOCK_FILE in self.ours:
                    (self.path / LOCK_FILE).unlink(missing_ok=True)  # still holding it: see RunLock
                for folder in reversed(self.made):
                    try:
                        folder.rmdir()
                    except OSError:
                        break  # something else is in it: leave it and its parents
        finally:
            self.lock.release()


_CLAIMS: dict[str, Claim] = {}


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def owned(run_dir: Path) -> Optional[Claim]:
    """This process's claim on `run_dir`, if it owns it."""
    return _CLAIMS.get(_key(run_dir))


def _makedirs(path: Path) -> list[Path]:
    """mkdir -p, returning the directories it created, outermost first."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    made = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
            made.append(folder)
        except FileExistsError:
            pass
    return made


def own(run_dir: Path, made: Iterable[Path] = (), ours: Iterable[str] = ()) -> Claim:
    """Make this process the owner of `run_dir` (created when missing): take its lock, remembering what this
    process created (`made`: directories it created before; `ours`: names it already wrote there). The
    claim already held is returned when this process owns the directory. RunDirBusy when another process
    holds it: then nothing is created and nothing removed."""
    run_dir = Path(run_dir).absolute()
    held = owned(run_dir)
    if held is not None:
        return held
    made = [Path(m).absolute() for m in made] + _makedirs(run_dir)
    had_lock = (run_dir / LOCK_FILE).exists()
    try:
        lock = RunLock(run_dir, remove_on_failure=not had_lock)
    except BaseException:
        for folder in reversed(made):  # created here and still empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    ours = set(ours) | ({LOCK_FILE} if not had_lock else set())
    if run_dir in made:  # a directory this process made: what Hydra writes into it is this process's too
        ours |= set(HYDRA_FILES)
    claim = Claim(run_dir, lock, made, ours)
    _CLAIMS[_key(run_dir)] = claim
    return claim


def release_all(remove_unused: bool = False) -> None:
    """Give up every directory this process owns (the command line's end)."""
    for claim in list(_CLAIMS.values()):
        claim.release(remove_unused)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def config_hash(config: dict) -> str:
    """The SHA-256 of a run's resolved config (JSON, keys sorted): recorded in run.json beside the
    config, checked on resume (an edited run.json would otherwise be trusted), and compared across
    ranks at start."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
