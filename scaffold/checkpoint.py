"""Checkpoints `last` and `best`: everything a run needs to continue bit for bit, verified on load.

A checkpoint holds the model, optimizer and scheduler states, every RNG state, the epoch it closes, the
run's bookkeeping (steps, best epoch, training time) and the CSV rows so far (so a lost or damaged
train_stats.csv can be rebuilt). The file is torch.save's archive followed by a one-line trailer holding
the SHA-256 of the archive, computed while it is written: a flipped byte anywhere is caught on load
instead of training on altered weights. Every file is written to a temporary name, flushed to disk and
renamed, so a crash leaves the old file or the new one, never half of one.

`best` is a file of its own (a copy of the `last` it was written as), not a link: damage to one
leaves the other to fall back on. It records its own epoch, which a resume checks against the run's.
"""
from __future__ import annotations

import hashlib
import io
import logging
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch
from scaffold.files import atomic_open

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: SHA-256 trailer and CSV rows; 1 (no trailer) still loads, unverified
LAST = "last.pt"
BEST = "best.pt"
REQUIRED_KEYS = ("format", "epoch", "model", "optimizer", "scheduler", "rng", "progress")
TRAILER = b"\nscaffold-checkpoint sha256 "
TRAILER_LEN = len(TRAILER) + 64 + 1  # the tag, the hex digest, a newline


class CheckpointError(RuntimeError):
    """No usable checkpoint; the message is one line naming the file or folder."""


class NoCheckpoint(CheckpointError):
    """Neither `last` nor `best` exists (none was written yet): nothing damaged."""


class _Hashing:
    """A write-only file that hashes what passes through (torch.save streams into it)."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save(path: Path, state: dict[str, Any]) -> None:
    """Write a verified checkpoint atomically (ENOSPC and other write errors leave no temporary file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(path, "wb") as f:
            sink = _Hashing(f)
            torch.save({"format": FORMAT_VERSION, **state}, sink)
            f.write(TRAILER + sink.sha.hexdigest().encode() + b"\n")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write the checkpoint ({e.strerror or e})") from None


def copy_file(src: Path, dst: Path) -> None:
    """Copy a checkpoint file to `dst` atomically (a file of its own: no link shares its bytes)."""
    try:
        with open(src, "rb") as fin, atomic_open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout, 16 << 20)
    except OSError as e:
        raise CheckpointError(f"{dst}: cannot write the checkpoint ({e.strerror or e})") from None


def mark_best(folder: Path) -> None:
    """Make `best` a copy of the checkpoint just written as `last`."""
    copy_file(Path(folder) / LAST, Path(folder) / BEST)


def _body(path: Path) -> tuple[bytes, bool]:
    """The archive of a checkpoint file and whether a trailer's checksum verified it (format 1 has
    none)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e.strerror or e})") from None
    tail = data[-TRAILER_LEN:]
    if not tail.startswith(TRAILER):
        return data, False  # written before checksums (format 1), or its trailer is damaged: see below
    body, want = data[:-TRAILER_LEN], tail[len(TRAILER):-1].decode(errors="replace")
    got = hashlib.sha256(body).hexdigest()
    if got != want:
        raise CheckpointError(f"{path}: checksum mismatch (the file was altered or damaged after it was "
                              "written)")
    return body, True


def load_one(path: Path) -> dict[str, Any]:
    """A verified checkpoint's state; CheckpointError (one line) for a damaged or foreign file."""
    body, verified = _body(Path(path))
    try:
        state = torch.load(io.BytesIO(body), map_location="cpu", weights_only=False)
    except Exception as e:  # a torn or foreign file: torch raises many kinds of errors
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        raise CheckpointError(f"{path}: not a scaffold checkpoint (missing keys)")
    if state["format"] not in (1, FORMAT_VERSION):
        raise CheckpointError(f"{path}: checkpoint format {state['format']}, expected {FORMAT_VERSION}")
    if state["format"] != 1 and not verified:
        raise CheckpointError(f"{path}: checksum trailer missing or damaged")
    if not verified:
        log.warning("%s: written before checkpoints carried a checksum; loaded unverified", path)
    return state


def remove_stale_temporaries(run_dir: Path) -> Optional[str]:
    """Remove the temporary files a killed process left beside the run's files (scaffold.files names
    them `.NAME.PID-HEX.tmp`; a SIGKILL during a checkpoint write leaves one up to a checkpoint's size).
    Only the run directory's owner calls this, holding its lock, so no live writer owns one. Returns a
    one-line note of what was removed, or None."""
    pattern = re.compile(r"^\..+\.\d+-[0-9a-f]{8}\.tmp$")
    removed, size = 0, 0
    for folder in (Path(run_dir), Path(run_dir) / "checkpoints"):
        if not folder.is_dir():
            continue
        for f in folder.iterdir():
            if pattern.match(f.name) and f.is_file() and not f.is_symlink():
                size += f.stat().st_size
                f.unlink(missing_ok=True)
                removed += 1
    if not removed:
        return None
    return (f"removed {removed} temporary file(s) left by an interrupted write ({size / 2**20:.1f} MiB) "
            f"in {run_dir}")


def load_latest(folder: Path) -> tuple[dict[str, Any], Path]:
    """The `last` checkpoint, or `best` with a warning when `last` is missing or damaged."""
    folder = Path(folder)
    last, best = folder / LAST, folder / BEST
    if not last.exists() and not best.exists():
        raise NoCheckpoint(f"{folder}: no checkpoint to resume from (neither {LAST} nor {BEST})")
    problem = None
    if last.exists():
        try:
            return load_one(last), last
        except CheckpointError as e:
            problem = str(e)
    if best.exists():
        try:
            state = load_one(best)
        except CheckpointError as e:
            raise CheckpointError(f"{problem}; and {e}") from None
        log.warning("%s; resuming from %s (epoch %d) instead", problem or f"{last}: missing", best,
                    state["epoch"])
        return state, best
    raise CheckpointError(f"{problem}; and {best}: missing")


def repair_best(folder: Path, state: dict[str, Any], loaded_from: Path) -> Optional[str]:
    """Check `best` against the run's best epoch (from the checkpoint resumed); rewrite it from `last`
    when it is stale or damaged and `last` is that epoch. Returns a one-line note of what was done, or
    None when `best` is right. (A kill between writing `last` and its `best` copy leaves `best` one
    best epoch behind; the CSV and the run's bookkeeping already name the new one.)"""
    folder = Path(folder)
    want = int(state["progress"].get("best_epoch", 0))
    if want == 0:
        return None  # no finite epoch yet: no best
    best = folder / BEST
    try:
        have: Optional[int] = int(load_one(best)["epoch"]) if best.exists() else None
    except CheckpointError:
        have = -1
    if have == want:
        return None
    what = "missing" if have is None else "damaged" if have == -1 else f"epoch {have}"
    if int(state["epoch"]) == want and loaded_from.name == LAST:
        mark_best(folder)
        return f"{best} was {what}, the best epoch is {want}: rewritten from {LAST}"
    return (f"{best} is {what} but the best epoch is {want}, which no checkpoint holds any more: "
            f"{BEST} is left as it is")


class Writer:
    """Writes checkpoints off the training's critical path: at most one write in flight, and the host
    waits for none of them at an epoch's end.

    `submit(state, best)` snapshots every tensor of `state` into host buffers (pinned on CUDA, reused
    from one checkpoint to the next) with copies queued on a side stream, makes the training stream
    wait for those copies before it runs on (a device-side dependency: the host never waits), and hands
    the snapshot to a writer thread: wait for the copies, torch.save with its checksum, atomic rename,
    then the `best` copy. A kill at any moment leaves the previous `last` and `best` (each written whole
    or not at all), so the guarantees of `save` hold.

    When a write is still going at `submit`, the new snapshot waits as the *pending* one, in a second set
    of buffers, and is written when the write before it ends. A newer snapshot replaces a pending one
    (the newest state is the one worth writing), except that a `best` snapshot is never replaced by a
    non-best one: that `submit` waits until the writer has taken the best one. So `last` on disk trails
    the training by at most the write in flight, `best` is never lost, and the host waits only in that
    case and in `flush`. A failed write (a full disk) drops what was pending and surfaces, once, as a
    CheckpointError from the next `submit` or `flush`."""

    def __init__(self, folder: Path, background: bool = True):
        self.folder = Path(folder)
        self.background = background
        self.thread = None  # the writer thread while it has work
        self.error: Optional[BaseException] = None
        self.buffers: list[dict[int, torch.Tensor]] = [{}, {}]  # two sets, by tensor position
        self.waited_s = 0.0  # host time spent waiting for the writer (ideally zero until the end)
        self._cv = threading.Condition()
        self._pending: Optional[tuple[int, dict, Any, bool]] = None  # (buffer set, snapshot, event, best)
        self._writing: Optional[int] = None  # the buffer set being written
        self._stream = None  # the side stream of the snapshot copies (one: copies stay in order)

    def submit(self, state: dict[str, Any], best: bool) -> None:
        if not self.background:
            self._raise()
            save(self.folder / LAST, state)
            if best:
                mark_best(self.folder)
            return
        t0 = time.perf_counter()
        with self._cv:
            while self._pending is not None and self._pending[3] and not best and self.error is None:
                self._cv.wait()  # the pending best must be taken before anything replaces it
            self.waited_s += time.perf_counter() - t0
            self._raise()
            if self._pending is not None:
                index = self._pending[0]  # not taken yet: its buffers are free to overwrite
            else:
                index = 0 if self._writing != 0 else 1
            snapshot, done = self._snapshot(state, self.buffers[index])
            self._pending = (index, snapshot, done, best)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
                self.thread.start()
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait for the write in flight and the pending one; raise an error of theirs."""
        t0 = time.perf_counter()
        with self._cv:
            while self.thread is not None:
                self._cv.wait()
            self.waited_s += time.perf_counter() - t0
            self._raise()

    def _raise(self) -> None:
        """Raise a failed write's error once (called with the lock held, or without a writer)."""
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"{self.folder / LAST}: the background write failed "
                                  f"({type(error).__name__}: {error})") from error

    def _snapshot(self, state: dict[str, Any], buffers: dict[int, torch.Tensor]):
        """A copy of `state` whose tensors live in `buffers` (one of this writer's sets); the event
        that says the copies are done (None on the CPU, where they are done on return)."""
        tensors: list[torch.Tensor] = []

        def collect(obj):
            if torch.is_tensor(obj):
                tensors.append(obj)
                return ("__tensor__", len(tensors) - 1)
            if isinstance(obj, dict):
                return {k: collect(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(collect(v) for v in obj)
            return obj

        skeleton = collect(state)
        cuda = [t for t in tensors if t.is_cuda]
        stream = None
        if cuda:
            if self._stream is None or self._stream.device != cuda[0].device:
                self._stream = torch.cuda.Stream(cuda[0].device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(cuda[0].device))
        copies = []
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            for i, t in enumerate(tensors):
                buf = buffers.get(i)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                    buffers[i] = buf
                buf.copy_(t.detach(), non_blocking=t.is_cuda)
                copies.append(buf)
        done = None
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            # Training may not overwrite a tensor before its copy has been read.
            torch.cuda.current_stream(cuda[0].device).wait_stream(stream)

        def rebuild(obj):
            if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__":
                return copies[obj[1]]
            if isinstance(obj, dict):
                return {k: rebuild(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(rebuild(v) for v in obj)
            return obj

        return rebuild(skeleton), done

    def _loop(self) -> None:
        """The writer thread: write the pending snapshot until there is none (or a write fails)."""
        while True:
            with self._cv:
                if self._pending is None or self.error is not None:
                    self._pending = None  # after a failure nothing more is written on top of it
                    self._writing, self.thread = None, None
                    self._cv.notify_all()
                    return
                index, snapshot, done, best = self._pending
                self._pending, self._writing = None, index
                self._cv.notify_all()
            try:
                if done is not None:
                    done.synchronize()  # this thread waits for the copies; training does not
                save(self.folder / LAST, snapshot)
                if best:
                    mark_best(self.folder)
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
                with self._cv:
                    self.error = e
            finally:
                with self._cv:
                    self._writing = None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
