"""logger=tensorboard: the CSV's epoch rows as TensorBoard scalars, the figures as images; and the
one-line errors when the logger is unknown or its package is missing."""
import importlib.util
import math

import numpy as np
import pytest

from helpers import tiny_cfg
from scaffold import tracking, worker
from scaffold.config import ConfigError
from scaffold.plan import validate
from scaffold.stats import COLUMNS, read_rows

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def test_event_file_holds_every_csv_column_per_epoch(cache, tmp_path):
    worker.run(tiny_cfg(cache, "logger=tensorboard", "epochs=2"), tmp_path)
    rows = read_rows(tmp_path / "train_stats.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"]
    events = list((tmp_path / tracking.TB_DIR).glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / tracking.TB_DIR), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(COLUMNS) - {"epoch"}  # every column is numeric; the epoch is the step
    for column in tags:
        logged = [(e.step, e.value) for e in acc.Scalars(column)]
        assert [s for s, _ in logged] == [1, 2], column
        for (_, value), row in zip(logged, rows):
            expected = np.float32(float(row[column]))  # event files store float32
            assert value == expected or (math.isnan(value) and math.isnan(expected)), column
    images = set(acc.Tags()["images"])
    if (tmp_path / "val_dice.png").exists():  # figures only with matplotlib
        assert images == {"figures/train_loss", "figures/val_loss", "figures/val_dice"}
        assert acc.Images("figures/val_dice")[0].step == 2


def test_default_logger_writes_no_event_files(cache, tmp_path):
    worker.run(tiny_cfg(cache, "epochs=1"), tmp_path)
    assert not (tmp_path / tracking.TB_DIR).exists()


def test_unknown_logger_is_a_one_line_error(cache):
    with pytest.raises(ConfigError, match=r"^logger='mlflow': expected none \| tensorboard$"):
        validate(tiny_cfg(cache, "logger=mlflow"))


def test_missing_tensorboard_fails_before_any_work(cache, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        worker.run(tiny_cfg(cache, "logger=tensorboard", f"data.cache_dir={tmp_path / 'cache'}"),
                   tmp_path / "run")
    assert str(err.value) == ("logger=tensorboard needs the tensorboard package: "
                              "pip install 'scaffold-unet[tensorboard]'")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
