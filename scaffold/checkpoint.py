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
import shutil
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


def load_latest(folder: Path) -> tuple[dict[str, Any], Path]:
    """The `last` checkpoint, or `best` with a warning when `last` is missing or damaged."""
    folder = Path(folder)
    last, best = folder / LAST, folder / BEST
    if not last.exists() and not best.exists():
        raise CheckpointError(f"{folder}: no checkpoint to resume from (neither {LAST} nor {BEST})")
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
