"""One process per run directory.

Two guarantees, both needed because Hydra names a run directory by the second it starts in:
- `claim_new` picks a fresh directory for a new run and creates it with an exclusive mkdir, so two runs
  started in the same second get two directories (`12-00-00` and `12-00-00-2`), never one shared.
- `RunLock` holds an exclusive advisory lock (flock) on `<run dir>/.lock` for the life of the process
  that trains in it. The kernel drops the lock when the process dies, however it dies (SIGKILL
  included), so a lock is never stale; a second live process on the same run (a concurrent resume, or a
  new run pointed at a directory in use) is refused in one line.
flock is local to one machine on most network filesystems' default settings; two hosts resuming one run
on a shared filesystem at once are not detected there.
"""
from __future__ import annotations

import datetime as _dt
import errno
import os
import socket
from pathlib import Path
from typing import Optional

# What a run directory holds, by name (README's table says what each is).
LOCK_FILE = ".lock"
RUN_FILE = "run.json"  # marks a scaffold run directory; holds the resolved config for resume
RESULT_FILE = "result.json"
CENSUS_FILE = "census.json"
STATS_FILE = "train_stats.csv"
CHECKPOINT_DIR = "checkpoints"


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

    def __init__(self, run_dir: Path):
        import fcntl

        self.path = Path(run_dir) / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(self.fd)
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise RunDirBusy(f"run directory {run_dir} is in use by another process ({holder or 'unknown'}): "
                                 "wait for it to end, or use another directory") from None
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def check_free(run_dir: Path) -> None:
    """Raise RunDirBusy when a live process holds `run_dir` (a probe: takes and drops the lock)."""
    if (Path(run_dir) / LOCK_FILE).exists():
        RunLock(run_dir).release()


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
