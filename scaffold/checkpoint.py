"""Checkpoints `last` and `best`: everything a run needs to continue bit for bit.

A checkpoint holds the model, optimizer and scheduler states, every RNG state, the epoch it closes and the
run's bookkeeping (steps, best epoch, training time). It is written to a temporary file in the same folder,
flushed to disk and renamed over the old one, so a crash leaves either the old or the new file, never half
of one. `best` is a hard link to the `last` of the best epoch when possible (no second serialization).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from scaffold.files import atomic_open

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
LAST = "last.pt"
BEST = "best.pt"
REQUIRED_KEYS = ("format", "epoch", "model", "optimizer", "scheduler", "rng", "progress")


class CheckpointError(RuntimeError):
    """No usable checkpoint; the message is one line naming the file or folder."""


def save(path: Path, state: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        torch.save({"format": FORMAT_VERSION, **state}, f)


def mark_best(folder: Path) -> None:
    """Make `best` the checkpoint just written as `last` (hard link; copy where links are refused)."""
    last, best = Path(folder) / LAST, Path(folder) / BEST
    tmp = best.with_name(BEST + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(last, tmp)
    except OSError:
        import shutil

        shutil.copyfile(last, tmp)
    os.replace(tmp, best)


def _load_one(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a torn or foreign file: torch raises many kinds of errors
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        raise CheckpointError(f"{path}: not a scaffold checkpoint (missing keys)")
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {state['format']}, expected {FORMAT_VERSION}")
    return state


def load_latest(folder: Path) -> tuple[dict[str, Any], Path]:
    """The `last` checkpoint, or `best` with a warning when `last` is missing or corrupt."""
    folder = Path(folder)
    last, best = folder / LAST, folder / BEST
    if not last.exists() and not best.exists():
        raise CheckpointError(f"{folder}: no checkpoint to resume from (neither {LAST} nor {BEST})")
    problem = None
    if last.exists():
        try:
            return _load_one(last), last
        except CheckpointError as e:
            problem = str(e)
    if best.exists():
        state = _load_one(best)
        log.warning("%s; resuming from %s (epoch %d) instead", problem or f"{last}: missing", best,
                    state["epoch"])
        return state, best
    raise CheckpointError(problem)
