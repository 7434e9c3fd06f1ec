"""The ScaFFold problem, exactly: the compatibility preset, `epochs=-1` (until the target), and CE
weights estimated from an evenly spaced sample of the training masks."""
from __future__ import annotations

import json

import numpy as np

import pytest

from helpers import TINY, cli
from scaffold.stats import read_rows
from scaffold.loss import class_weights, sampled_counts


def test_ce_weights_from_an_evenly_spaced_sample():
    masks = np.zeros((20, 2, 2, 2), dtype=np.uint8)
    masks[::2, 0, 0, 0] = 1  # even-numbered masks hold one foreground voxel
    masks[19] = 2  # the last mask is all class 2
    every = sampled_counts(masks, 1.0, 3)
    assert every.tolist() == [20 * 8 - 10 - 8, 10, 8]
    tenth = sampled_counts(masks, 0.1, 3)  # 2 of 20: the first and the last
    assert tenth.tolist() == [7, 1, 8]
    assert not np.allclose(class_weights(tenth).numpy(), class_weights(every).numpy())
    assert sampled_counts(masks, 0.01, 3).tolist() == [7, 1, 0]  # at least one mask


def test_ce_sample_picks_are_upstreams():
    """ceil(fraction * n) masks at the truncated positions of a float32 linspace: for the default
    dataset's 168 training masks, 17 masks, 0 10 20 31 41 52 62 73 83 93 104 114 125 135 146 156 167
    (rounding to the nearest would pick 0 10 21 31 42 52 63 ...)."""
    n = 168
    masks = np.zeros((n, 1, 1, 1), dtype=np.uint8)
    expected = [int(10.4375 * i) for i in range(17)]  # (n - 1) / 16 = 10.4375, exact in float32
    masks[expected, 0, 0, 0] = 1
    counts = sampled_counts(masks, 0.1, 2)
    assert counts.tolist() == [0, 17]  # every picked mask is one of those, and there are 17
    masks[:] = 0
    masks[[21, 42, 63], 0, 0, 0] = 1  # the nearest-rounding picks: none of them is taken
    assert sampled_counts(masks, 0.1, 2).tolist() == [17, 0]


def test_the_scaffold_preset_runs_until_the_target(cache, tmp_path):
    run = tmp_path / "run"
    res = cli("benchmark=scaffold", *TINY, "target_dice=0.05", f"data.cache_dir={cache}",
              f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["epochs"] == -1 and config["checkpoint_interval"] == -1
    assert config["data"]["class_rule"] == "upstream" and config["data"]["ce_weight_sample_fraction"] == 0.1
    assert config["data"]["sampler"] == "upstream"
    assert config["warmup_steps"] == 1 and config["scale"] == 3  # the command line still wins over the preset
    result = json.loads((run / "result.json").read_text())
    assert result["target_epoch"] == result["epochs"] and result["time_to_target_s"] is not None
    ckpts = run / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())  # no checkpoint at all, as upstream's -1
    # Both figures of merit: upstream's (the summed epoch_duration, and its inverse) beside ours.
    rows = read_rows(run / "train_stats.csv")
    assert result["epoch_time_to_target_s"] == pytest.approx(sum(float(r["epoch_duration"]) for r in rows))
    assert result["upstream_fom"] == pytest.approx(1.0 / result["epoch_time_to_target_s"])
    assert "upstream's figure of merit: sum of epoch_duration" in res.stdout + res.stderr
    assert result["step_tflop"] > 0 and result["bf16_peak_tflops"] is None and result["peak_fraction"] is None
    assert all(float(r["step_tflops"]) > 0 for r in rows)


def test_an_unknown_benchmark_is_one_line(tmp_path):
    res = cli("benchmark=nope", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: benchmark=nope: no such preset (choose from: scaffold)"]


def test_a_bad_class_rule_is_one_line(tmp_path):
    res = cli("data.class_rule=loose", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["error: data.class_rule='loose': expected upstream | rms"]


def test_warmup_runs_distinct_batches_then_validation_and_leaves_the_run_unchanged(cache, tmp_path, monkeypatch):
    from helpers import params, same_params, tiny_cfg
    from scaffold import worker
    from scaffold.trainer import Trainer, Volumes

    seen, inside = [], [False]
    real_take, real_warmup = Volumes.take, Trainer.warmup

    def take(self, masks, index):
        if inside[0]:
            seen.append(("train" if masks is self.train else "val", tuple(index.tolist())))
        return real_take(self, masks, index)

    def warmup(self, steps):
        inside[0] = True
        try:
            return real_warmup(self, steps)
        finally:
            inside[0] = False

    monkeypatch.setattr(Volumes, "take", take)
    monkeypatch.setattr(Trainer, "warmup", warmup)
    worker.run(tiny_cfg(cache, "epochs=1", "warmup_steps=64"), tmp_path / "warm")
    # TINY holds 3 training volumes and 1 validation volume: every one of them, once, in order.
    assert seen == [("train", (0,)), ("train", (1,)), ("train", (2,)), ("val", (0,))]
    monkeypatch.undo()
    worker.run(tiny_cfg(cache, "epochs=1", "warmup_steps=0"), tmp_path / "cold")
    assert same_params(params(tmp_path / "warm"), params(tmp_path / "cold"))


def test_checkpoint_interval_minus_one_writes_no_checkpoint(cache, tmp_path):
    from helpers import tiny_cfg
    from scaffold import worker

    result = worker.run(tiny_cfg(cache, "epochs=2", "checkpoint_interval=-1"), tmp_path / "run")
    assert result["epochs"] == 2 and result["best_epoch"] >= 1
    ckpts = tmp_path / "run" / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())
