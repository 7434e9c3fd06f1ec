"""Fault injection for the multi-process tests, run by torchrun in place of `-m scaffold.train`:

    torchrun --standalone --nproc-per-node=3 tests/faults.py kill=1@5 KEY=VALUE ...

`kill=R@N` SIGKILLs rank R when it begins its N-th optimizer step (counted from the first step of the
first epoch); `raise=R@N` makes it raise instead; `term=R@N`, `int=R@N`, `usr1=R@N` and `hup=R@N` send
it SIGTERM, SIGINT, SIGUSR1 or SIGHUP there (the step then runs, as it would when the signal lands during
it); `stop=R@N` makes rank R write its pid to `stopped-R.pid` in the working directory and SIGSTOP
itself (a hung rank: alive, never arriving at the next collective; the test SIGCONTs or kills it after);
`agent=R@N` makes rank R send SIGTERM to its parent, torchrun's agent, as a scheduler's preemption
does (torchrun forwards it to every rank and kills them 30 s later). `enospc=N` makes the N-th
checkpoint write fail with ENOSPC after writing some bytes, as a full disk does; `only=R:KEY=VALUE`
gives rank R an override the others do not get; `early=term` sends SIGTERM as the dataset loads.
Without torchrun the one process is rank 0. The other arguments go to scaffold.train as they are.

Also a library of the tests' other injections: `sitecustomize` source that makes a folder look like a
read-only filesystem to the process, and byte flips.
"""
import errno
import os
import signal
import sys
import time
from pathlib import Path

from scaffold.trainer import Trainer
from scaffold.train import main

SIGNALS = {"term": signal.SIGTERM, "int": signal.SIGINT, "usr1": signal.SIGUSR1, "hup": signal.SIGHUP}


def _inject(kind: str, rank: int, at: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    real = Trainer.step
    calls = {"n": 0}

    def step(self, masks):
        calls["n"] += 1
        if calls["n"] == at:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind in SIGNALS:
                os.kill(os.getpid(), SIGNALS[kind])
            elif kind == "stop":  # hung, not dead: the pid is left for the test to clean up
                Path(f"stopped-{rank}.pid").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "agent":  # the launcher (torchrun's agent) forwards it to every rank
                _term_parent_and_await_forward(self)
            elif kind not in ("kill", "agent", "stop"):
                raise RuntimeError(f"injected failure on rank {rank} at step {at}")
        return real(self, masks)

    Trainer.step = step


def _term_parent_and_await_forward(trainer, timeout_s: float = 30.0) -> None:
    """SIGTERM to the parent, then wait (bounded) until the SIGTERM it forwards here has reached the
    trainer's handler, before the step runs: the forward lands during this step however slowly a loaded
    machine delivers it, as it does on an idle one (else a busy host let the ranks finish the epoch
    first). Polled: the signal may reach any of the process's threads, and Python runs its handler in
    the main thread between bytecodes, so a blocking wait here could miss it."""
    os.kill(os.getppid(), signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while trainer.stop.signum is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the launcher did not forward SIGTERM within {timeout_s:.0f} s")
        time.sleep(0.005)


def _full_disk(at: int) -> None:
    """The at-th checkpoint write writes a little, then fails as a full disk does."""
    import scaffold.checkpoint as ckpt

    real = ckpt.torch.save
    calls = {"n": 0}

    def save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *args, **kwargs)

    ckpt.torch.save = save


def read_only_site(folder: Path, root: Path) -> Path:
    """Write a sitecustomize.py into `folder` that makes everything under `root` look like a read-only
    filesystem to the process (EROFS on creating, writing, renaming or removing); returns `folder`.
    Tests run as root, for whom permission bits block nothing, so this is how they get a read-only
    mount without privileges."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f"""
import errno, os
_ROOT = {str(Path(root).resolve())!r}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _under(path, dir_fd=None):
    try:
        return os.path.realpath(os.fsdecode(path)).startswith(_ROOT)
    except TypeError:
        return False

def _ro(path):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

def _wrap_open(real):
    def open_(path, flags, *a, **k):
        if flags & _WRITE and _under(path):
            _ro(path)
        return real(path, flags, *a, **k)
    return open_

def _wrap_path(real):
    def fn(path, *a, **k):
        if _under(path):
            _ro(path)
        return real(path, *a, **k)
    return fn

os.open = _wrap_open(os.open)
for _name in ("mkdir", "unlink", "remove", "rmdir", "replace", "rename"):
    setattr(os, _name, _wrap_path(getattr(os, _name)))
import builtins, io
_real_open = io.open
def _open(file, mode="r", *a, **k):
    if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and _under(file):
        _ro(file)
    return _real_open(file, mode, *a, **k)
builtins.open = io.open = _open
""")
    return folder


def full_disk_site(folder: Path, root: Path) -> Path:
    """Write a sitecustomize.py into `folder` that makes everything under `root` look like a full
    filesystem to the process (a full tmpfs, a disk out of blocks): files and folders are created, but
    no byte can be written to them (ENOSPC), so a careless writer leaves 0-byte files. Returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f"""
import builtins, errno, io, os
_ROOT = {str(Path(root).resolve())!r}
_FULL = set()  # descriptors opened for writing under _ROOT

def _under(path):
    try:
        return os.path.realpath(os.fsdecode(path)).startswith(_ROOT)
    except TypeError:
        return False

def _enospc(*a):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

_real_open, _real_close, _real_write, _real_pwrite = os.open, os.close, os.write, os.pwrite
def _open(path, flags, mode=0o777, *, dir_fd=None):
    fd = _real_open(path, flags, mode, dir_fd=dir_fd)
    if flags & (os.O_WRONLY | os.O_RDWR) and dir_fd is None and _under(path):
        _FULL.add(fd)
    else:
        _FULL.discard(fd)
    return fd
def _close(fd):
    _FULL.discard(fd)
    return _real_close(fd)
os.open, os.close = _open, _close
os.write = lambda fd, data: _enospc() if fd in _FULL and len(data) else _real_write(fd, data)
os.pwrite = lambda fd, data, off: _enospc() if fd in _FULL and len(data) else _real_pwrite(fd, data, off)

class _FullFileIO(io.FileIO):
    def write(self, b):
        if len(memoryview(b)):
            _enospc()
        return 0

_real_io_open = io.open
def _io_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True,
             opener=None):
    full = (file in _FULL) if isinstance(file, int) else (
        isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and _under(file))
    if not full:
        return _real_io_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    raw_mode = mode.replace("t", "").replace("b", "")
    raw = _FullFileIO(file, raw_mode, closefd, opener=opener or (lambda p, f: _open(p, f, 0o666)))
    buffered = (io.BufferedRandom if "+" in mode else io.BufferedWriter)(raw)
    if "b" in mode:
        return buffered
    return io.TextIOWrapper(buffered, encoding or "utf-8", errors, newline)
builtins.open = io.open = _io_open
""")
    return folder


def flip_byte(path: Path, offset: int) -> None:
    """Flip every bit of one byte of a file in place (offset < 0 counts from the end)."""
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0xFF
    Path(path).write_bytes(bytes(data))


if __name__ == "__main__":
    args = []
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key in ("kill", "raise", "agent", "stop", *SIGNALS):
            rank, at = value.split("@")
            _inject(key, int(rank), int(at))
        elif key == "enospc":
            _full_disk(int(value))
        elif key == "early":  # early=term: SIGTERM while the dataset loads (before run.json exists)
            import scaffold.data.store as store

            real_load, early = store.load, SIGNALS[value]

            def load(*a, **k):
                os.kill(os.getpid(), early)
                return real_load(*a, **k)

            store.load = load
        elif key == "only":  # only=R:KEY=VALUE: an override given to rank R alone
            rank, _, override = value.partition(":")
            if int(os.environ.get("RANK", "0")) == int(rank):
                args.append(override)
        else:
            args.append(arg)
    sys.argv = [sys.argv[0], *args]
    main()
