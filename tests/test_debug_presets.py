"""The `debug` presets (conf/debug/): debug=smoke runs the whole pipeline in one epoch; every preset
composes into a valid config."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import REPO, cli
from scaffold.cli import register
from scaffold.config import Config
from scaffold.plan import validate
from scaffold.stats import read_rows


@pytest.mark.parametrize("preset, expect", [
    ("smoke", {"epochs": 1, "scale": 3}),
    ("overfit", {"target_metric": "train_dice", "target_dice": 0.99}),
    ("profile", {"profile": True, "epochs": 1}),
])
def test_presets_compose_into_valid_configs(preset, expect):
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"debug={preset}"])
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in cfg.items() if k != "hydra"})
    validate(cfg)
    for key, value in expect.items():
        assert cfg[key] == value


def test_smoke_runs_one_epoch(tmp_path):
    run_dir = tmp_path / "run"
    res = cli("debug=smoke", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_rows(run_dir / "train_stats.csv")
    assert [int(r["epoch"]) for r in rows] == [1]
    assert (run_dir / "checkpoints" / "best.pt").is_file()


def test_target_metric_train_dice_stops_on_the_training_dice(cache, tmp_path):
    from helpers import tiny_cfg
    from scaffold import worker

    worker.run(tiny_cfg(cache, "epochs=3"), tmp_path / "base")  # the target is never reached
    base = read_rows(tmp_path / "base" / "train_stats.csv")
    train, val = ([float(r[c]) for r in base] for c in ("train_dice", "val_dice"))
    target = max(train)
    first = lambda values: next((e for e, v in enumerate(values, 1) if v >= target), None)  # noqa: E731
    assert first(train) != first(val)  # the two metrics would stop at different epochs
    result = worker.run(tiny_cfg(cache, "epochs=3", "target_metric=train_dice", f"target_dice={target!r}"),
                        tmp_path / "run")
    assert result["target_epoch"] == first(train)
    assert len(read_rows(tmp_path / "run" / "train_stats.csv")) == first(train)
