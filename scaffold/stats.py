"""train_stats.csv: one row per epoch, written and flushed as the epoch ends.

The first ten columns are upstream ScaFFold's, with the same meanings:
  epoch                  1-based epoch number
  epoch_loss             sum over the epoch's training samples of the per-sample loss
  overall_loss           epoch_loss / training samples (the mean training loss)
  val_loss_epoch         sum over the validation samples of the per-sample loss
  val_loss_avg           val_loss_epoch / validation samples
  train_dice             mean soft foreground Dice of the training steps (sample-weighted)
  val_dice               mean hard foreground Dice over the validation samples (nan when a sample's
                         logits are not finite: the run then stops, as for a non-finite loss)
  epoch_duration         wall-clock seconds of the epoch (training + evaluation)
  optimizer_steps        optimizer steps this epoch
  total_optimizer_steps  optimizer steps since the run began
Ours follow:
  lr                     the learning rate the epoch trained with
  step_ms_median         median wall time of the epoch's optimizer steps (ms)
  step_tflops            the model's FLOPs per step (scaffold/model/flops.py: convolutions, forward and
                         backward) over step_ms_median: achieved TFLOP/s per device
  is_best                1 when this epoch is a new best so far: its val_loss_avg is lower than every
                         earlier epoch's (a tie keeps the earlier). Several rows can say 1; the best epoch
                         of the run is the last of them (result.json's best_epoch).
  train_time             cumulative epoch_duration so far (training + evaluation; checkpoint writes,
                         logging and start-up excluded: result.json's time_to_target_s includes them)
  cpu_time               CPU seconds this process (all its threads) spent in the epoch; beside
                         epoch_duration it tells a starved run (cpu_time well below threads x wall) from
                         a slow one
  load_avg               the machine's 1-minute load average at the end of the epoch (nan where the
                         platform has none): other work competing for the cores
Only the timing and machine columns (WALL_CLOCK) may differ between two runs of the same config.
"""
from __future__ import annotations

import csv
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Optional
from scaffold.files import atomic_open

log = logging.getLogger("scaffold")

UPSTREAM_COLUMNS = (
    "epoch", "epoch_loss", "overall_loss", "val_loss_epoch", "val_loss_avg", "train_dice", "val_dice",
    "epoch_duration", "optimizer_steps", "total_optimizer_steps",
)
COLUMNS = UPSTREAM_COLUMNS + ("lr", "step_ms_median", "step_tflops", "is_best", "train_time", "cpu_time",
                              "load_avg")
WALL_CLOCK = ("epoch_duration", "step_ms_median", "step_tflops", "train_time", "cpu_time", "load_avg")


def load_average() -> Optional[tuple[float, float, float]]:
    """The machine's 1, 5 and 15-minute load averages, or None where the platform has none."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):  # Windows has no getloadavg
        return None


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        # repr round-trips exactly: the CSV is part of the determinism contract.
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)


class StatsError(RuntimeError):
    """train_stats.csv cannot be continued; the message is one line."""


class StatsFile:
    """Appends rows to train_stats.csv. On resume it keeps the rows through the checkpoint's epoch and
    drops later ones; when the file is missing, unreadable or disagrees with the rows the checkpoint
    recorded (`known`), it is rebuilt from those (the old file kept beside it), and said so. A tracker
    (scaffold.tracking), when given, receives every row after it is on disk."""

    def __init__(self, path: Path, keep_through_epoch: int = 0, tracker: Any = None,
                 known: Optional[list[dict[str, Any]]] = None):
        self.path = Path(path)
        self.tracker = tracker
        if keep_through_epoch > 0:
            self._resume(keep_through_epoch, known)
        else:
            self._write_atomic([])

    def _resume(self, last_epoch: int, known: Optional[list[dict[str, Any]]]) -> None:
        # (a record from before a column existed gives nan there)
        expected = [[_cell(r.get(c, math.nan)) for c in COLUMNS] for r in known or []
                    if int(r["epoch"]) <= last_epoch]
        problem, rows = _check(self.path, last_epoch, expected if known is not None else None)
        if problem is None:
            self._write_atomic(rows)
            return
        if known is None or len(expected) != last_epoch:
            raise StatsError(f"{self.path}: {problem}, and the checkpoint holds no record of the epochs to "
                             "rebuild it from (restore the file, or start a new run)")
        kept = ""
        if self.path.exists():
            aside, n = self.path.with_name(f"{self.path.name}.damaged"), 1
            while aside.exists():  # an earlier damaged copy is kept too
                n += 1
                aside = self.path.with_name(f"{self.path.name}.damaged-{n}")
            os.replace(self.path, aside)
            kept = f"; the old file is kept as {aside.name}"
        self._write_atomic([dict(zip(COLUMNS, r)) for r in expected])
        log.warning("%s: %s: rebuilt from the checkpoint's records of epochs 1-%d%s", self.path, problem,
                    last_epoch, kept)

    def _write_atomic(self, rows: Iterable[dict[str, str]]) -> None:
        with atomic_open(self.path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            for row in rows:
                writer.writerow([row.get(c, "") for c in COLUMNS])

    def append(self, row: dict[str, Any]) -> None:
        missing = [c for c in COLUMNS if c not in row]
        if missing:
            raise KeyError(f"stats row lacks columns {missing}")
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([_cell(row[c]) for c in COLUMNS])
            f.flush()
            os.fsync(f.fileno())
        if self.tracker is not None:
            self.tracker.log_epoch(row)


def _check(path: Path, last_epoch: int, expected: Optional[list[list[str]]]
           ) -> tuple[Optional[str], list[dict[str, str]]]:
    """(what is wrong with the CSV, or None; its rows through `last_epoch`)."""
    if not path.exists():
        return "missing", []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            lines = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        return f"unreadable ({type(e).__name__})", []
    if header is None or tuple(header) != COLUMNS:
        return "not a train_stats.csv of this version (header differs)", []
    try:
        kept = [x for x in lines if int(x[0]) <= last_epoch]
    except (ValueError, IndexError):
        return "damaged (a row without an epoch number)", []
    if [int(x[0]) for x in kept] != list(range(1, last_epoch + 1)):
        return f"damaged (its rows do not run from epoch 1 to {last_epoch})", []
    if expected is not None and kept != expected:
        return "damaged (its rows differ from the checkpoint's records)", []
    return None, [dict(zip(COLUMNS, x)) for x in kept]


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
