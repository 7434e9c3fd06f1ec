"""Experiment tracking: the CSV's epoch rows and the run's figures, also sent to a tracker.

`logger=none` (the default) tracks nothing beyond the run directory; `logger=tensorboard` writes
TensorBoard event files under `<run_dir>/tensorboard/` (`tensorboard --logdir outputs`), which needs the
extra: `pip install 'scaffold-unet[tensorboard]'`.

A tracker sees one row per epoch, the same dict the CSV is written from, after the epoch's single read
of the device: it never runs inside a step, so it adds no host synchronisation. Only rank 0 tracks,
as only rank 0 writes the CSV.

Another backend (MLflow, W&B) is a `Tracker` subclass with the same three methods, its package name in
`REQUIRES` and an entry in `TRACKERS`; `logger=<name>` then validates and works like tensorboard.
"""
from __future__ import annotations

import importlib.util
import numbers
from pathlib import Path
from typing import Any, Iterable

from scaffold.config import ConfigError

TB_DIR = "tensorboard"


class Tracker:
    """What the run reports to a tracker; every method may be a no-op."""

    def log_epoch(self, row: dict[str, Any]) -> None:
        """One epoch's statistics (the CSV row: column -> value, `epoch` 1-based)."""

    def log_figures(self, paths: Iterable[Path]) -> None:
        """The run's figures (PNG files), once, at the end of the run."""

    def close(self) -> None:
        """Flush and release whatever the tracker holds."""


class NullTracker(Tracker):
    """logger=none, and every rank but 0."""


class TensorBoardTracker(Tracker):
    """Every numeric column as a scalar (tag = column name, step = epoch); the figures as images."""

    def __init__(self, log_dir: Path, purge_from_epoch: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # On resume the CSV drops rows past the checkpoint; purge_step makes TensorBoard drop the
        # same epochs from the earlier event file, so the curves do not show both trajectories.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_from_epoch)
        self.last_epoch = 0

    def log_epoch(self, row: dict[str, Any]) -> None:
        epoch = int(row["epoch"])
        for key, value in row.items():
            if key != "epoch" and isinstance(value, numbers.Real):  # bool counts: is_best as 0/1
                self.writer.add_scalar(key, float(value), global_step=epoch)
        self.last_epoch = epoch
        self.writer.flush()  # once per epoch: a crashed run keeps its curves, a live view is current

    def log_figures(self, paths: Iterable[Path]) -> None:
        paths = list(paths)
        if not paths:
            return
        # Figures exist only when matplotlib is installed, so its PNG reader is there too.
        import matplotlib.pyplot as plt

        for path in paths:
            image = plt.imread(str(path))  # float32 (H, W, RGB[A]) in [0, 1]
            self.writer.add_image(f"figures/{Path(path).stem}", image[..., :3], global_step=self.last_epoch,
                                  dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


TRACKERS = {"none": NullTracker, "tensorboard": TensorBoardTracker}
LOGGERS = tuple(TRACKERS)
REQUIRES = {"tensorboard": "tensorboard"}  # logger -> the package it imports


def check_available(logger: str) -> None:
    """ConfigError (one line) when the logger's package is not installed; imports nothing."""
    package = REQUIRES.get(logger)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(f"logger={logger} needs the {package} package: "
                          f"pip install 'scaffold-unet[{logger}]'")


def make_tracker(cfg: Any, run_dir: Path, resume_epoch: int = 0) -> Tracker:
    """The tracker `cfg.logger` names, writing under run_dir (call on rank 0 only). `resume_epoch`: the
    checkpoint's epoch when resuming; the tracker forgets what an earlier attempt logged after it."""
    logger = str(getattr(cfg, "logger", "none"))
    if logger not in TRACKERS:
        raise ConfigError(f"logger={logger!r}: expected {' | '.join(LOGGERS)}")
    check_available(logger)
    if logger == "tensorboard":
        return TensorBoardTracker(Path(run_dir) / TB_DIR, resume_epoch + 1 if resume_epoch > 0 else None)
    return TRACKERS[logger]()
