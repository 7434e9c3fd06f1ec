"""`python -m scaffold.predict`: the trainer's validation Dice reproduced bit for bit, the outputs it
writes, and one-line refusals of a bad run directory or a damaged checkpoint."""
from __future__ import annotations

import csv
import json
import shutil

import h5py
import numpy as np
import pytest

from helpers import cli, tiny_cfg
from scaffold import predict, worker
from scaffold.stats import read_rows

# 12 volumes of 8³ (4 of them validation), so the mean is a sum over several volumes.
OVERRIDES = ("data.n_instances=18", "epochs=3")


@pytest.fixture(scope="module")
def trained(cache, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    worker.run(tiny_cfg(cache, *OVERRIDES), run_dir)
    return run_dir


@pytest.mark.parametrize("which", ["best", "last"])
def test_predict_reproduces_the_trainers_validation_dice(trained, tmp_path, which):
    out = tmp_path / "out"
    summary = predict.run(predict.PredictConfig(run=str(trained), checkpoint=which, out=str(out), figures=0))
    rows = {int(r["epoch"]): r for r in read_rows(trained / "train_stats.csv")}
    epoch = summary["epoch"]
    if which == "last":
        assert epoch == max(rows)
    else:
        assert rows[epoch]["is_best"] == "1"
    assert summary["volumes"] == 4
    # Exact: the CSV holds repr() of the trainer's float, predict sums the same values the same way.
    assert summary["dice"] == float(rows[epoch]["val_dice"]) == summary["trainer_val_dice"]
    assert summary["loss"] == float(rows[epoch]["val_loss_avg"])
    per_volume = list(csv.DictReader((out / "per_volume.csv").open()))
    assert len(per_volume) == 4
    assert np.isclose(np.mean([float(r["hard_dice"]) for r in per_volume]), summary["dice"], atol=1e-6)
    for r in per_volume:  # the trainer's per-volume Dice is the mean of the per-class ones
        assert np.isclose(float(r["hard_dice"]), np.mean([float(r["hard_dice_1"]), float(r["hard_dice_2"])]))


def test_outputs_masks_confusion_and_figures(trained, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    summary = predict.run(predict.PredictConfig(run=str(trained), out=str(out), figures=2))
    with h5py.File(out / "predictions.h5") as f:
        masks = f["masks"][...]
        assert masks.shape == (4, 8, 8, 8) and masks.dtype == np.uint8
        assert f.attrs["epoch"] == summary["epoch"] and f.attrs["split"] == "val"
        assert f.attrs["run"] == str(trained) and f.attrs["checkpoint"].endswith("best.pt")
    confusion = np.array(summary["confusion"])
    assert confusion.shape == (3, 3) and confusion.sum() == 4 * 8**3
    # The predicted-label column sums are the predicted masks' label counts.
    assert (confusion.sum(0) == np.bincount(masks.reshape(-1), minlength=3)).all()
    with h5py.File(summary["input"]) as f:
        truth = f["val/masks"][...]
    assert (confusion.sum(1) == np.bincount(truth.reshape(-1), minlength=3)).all()
    # Hard Dice of class 1 from the written masks agrees with the table.
    pred, true = masks == 1, truth == 1
    dice1 = 2 * (pred & true).sum((1, 2, 3)) / np.maximum(pred.sum((1, 2, 3)) + true.sum((1, 2, 3)), 1)
    rows = list(csv.DictReader((out / "per_volume.csv").open()))
    assert np.allclose([float(r["hard_dice_1"]) for r in rows], dice1)
    figures = sorted(out.glob("slices_vol*.png"))
    assert len(figures) == 2 and all(f.read_bytes()[:4] == b"\x89PNG" for f in figures)
    assert json.loads((out / "metrics.json").read_text())["dice"] == summary["dice"]


def test_cli_writes_into_the_run_and_refuses_a_damaged_checkpoint(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    res = cli(f"run={run_dir}", "figures=0", cwd=tmp_path, module="scaffold.predict")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run_dir / "predict" / "best-val" / "metrics.json").is_file()
    best = run_dir / "checkpoints" / "best.pt"
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 0x01
    best.write_bytes(bytes(data))
    res = cli(f"run={run_dir}", f"out={tmp_path / 'damaged'}", cwd=tmp_path, module="scaffold.predict")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "best.pt: checksum mismatch" in lines[0], res.stderr
    assert not (tmp_path / "damaged").exists()


@pytest.mark.parametrize("args, expected", [
    ((), "run: required"),
    (("run=/no/such/run",), "run=/no/such/run: no such run directory"),
    (("run=RUN", "chekpoint=last"), "chekpoint: unknown key (did you mean `checkpoint`?)"),
    (("run=RUN", "split=test"), "split='test': expected val | train"),
    (("run=RUN", "checkpoint=/no/file.pt"), "checkpoint=/no/file.pt: no such file"),
    (("run=RUN", "input=/no/file.h5"), "input=/no/file.h5: no such file"),
])
def test_bad_arguments_are_one_line(trained, tmp_path, args, expected):
    res = cli(*(a.replace("RUN", str(trained)) for a in args), cwd=tmp_path, module="scaffold.predict")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], res.stderr


@pytest.mark.gpu
def test_predict_on_cuda_reproduces_the_graphed_evaluation(cache, tmp_path):
    """On CUDA the trainer evaluates through a captured graph with bf16 autocast and the ladder's Triton
    rungs; predict runs the same evaluation eagerly: the same bits."""
    run_dir = tmp_path / "run"
    result = worker.run(tiny_cfg(cache, *OVERRIDES, "device=cuda", "scale=4", "model.bottleneck=3"), run_dir)
    assert result["cuda_graph"]
    summary = predict.run(predict.PredictConfig(run=str(run_dir), checkpoint="last", device="cuda",
                                                out=str(tmp_path / "out"), figures=0))
    rows = {int(r["epoch"]): r for r in read_rows(run_dir / "train_stats.csv")}
    assert summary["dice"] == float(rows[summary["epoch"]]["val_dice"])
    assert summary["loss"] == float(rows[summary["epoch"]]["val_loss_avg"])


def test_help_lists_the_keys(tmp_path):
    res = cli("--help", cwd=tmp_path, module="scaffold.predict")
    assert res.returncode == 0
    for key in ("run:", "checkpoint:", "split:", "input:", "figures:"):
        assert key in res.stdout
