"""The ScaFFold problem, exactly: the compatibility preset, `epochs=-1` (until the target), and CE
weights estimated from an evenly spaced sample of the training masks."""
from __future__ import annotations

import json

import numpy as np

from helpers import TINY, cli
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


def test_the_scaffold_preset_runs_until_the_target(cache, tmp_path):
    run = tmp_path / "run"
    res = cli("benchmark=scaffold", *TINY, "target_dice=0.05", f"data.cache_dir={cache}",
              f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["epochs"] == -1 and config["checkpoint_interval"] == 0
    assert config["data"]["class_rule"] == "upstream" and config["data"]["ce_weight_sample_fraction"] == 0.1
    assert config["warmup_steps"] == 1  # the command line still wins over the preset (TINY sets 1)
    result = json.loads((run / "result.json").read_text())
    assert result["target_epoch"] == result["epochs"] and result["time_to_target_s"] is not None


def test_an_unknown_benchmark_is_one_line(tmp_path):
    res = cli("benchmark=nope", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: benchmark=nope: no such preset (choose from: scaffold)"]


def test_a_bad_class_rule_is_one_line(tmp_path):
    res = cli("data.class_rule=loose", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["error: data.class_rule='loose': expected upstream | rms"]
