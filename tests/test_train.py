"""The training application end to end at a tiny scale: CSV, best epoch, figures, checkpoints, resume,
sweeps, bad input, divergence."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, cli, params, same_params, stable_rows, tiny_cfg
from scaffold import worker
from scaffold.stats import COLUMNS, UPSTREAM_COLUMNS, read_rows


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, cache):
    """An uninterrupted 3-epoch run that several tests compare against."""
    run_dir = tmp_path_factory.mktemp("baseline")
    result = worker.run(tiny_cfg(cache), run_dir)
    return run_dir, result


def test_csv_header_rows_and_best_epoch(baseline):
    run_dir, result = baseline
    header = (run_dir / "train_stats.csv").read_text().splitlines()[0].split(",")
    assert tuple(header[:10]) == UPSTREAM_COLUMNS
    assert tuple(header) == COLUMNS
    rows = read_rows(run_dir / "train_stats.csv")
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    steps = [int(r["optimizer_steps"]) for r in rows]
    assert steps == [3, 3, 3]  # 3 training volumes, batch 1
    assert [int(r["total_optimizer_steps"]) for r in rows] == [3, 6, 9]
    for r in rows:
        assert math.isclose(float(r["overall_loss"]), float(r["epoch_loss"]) / 3, rel_tol=1e-12)
        assert math.isclose(float(r["val_loss_avg"]), float(r["val_loss_epoch"]) / 1, rel_tol=1e-12)
        assert 0.0 <= float(r["val_dice"]) <= 1.0
    # is_best follows the running minimum of val_loss_avg (strict: a tie keeps the earlier epoch).
    best = math.inf
    for r in rows:
        v = float(r["val_loss_avg"])
        assert r["is_best"] == str(int(v < best))
        best = min(best, v)
    best_row = min(rows, key=lambda r: (float(r["val_loss_avg"]), int(r["epoch"])))
    assert result["best_epoch"] == int(best_row["epoch"])


def test_run_directory_contents(baseline):
    run_dir, _ = baseline
    for name in ("train_stats.csv", "run.json", "result.json", "census.json", "checkpoints/last.pt",
                 "checkpoints/best.pt", "train_loss.png", "val_loss.png", "val_dice.png"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "train_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    census = json.loads((run_dir / "census.json").read_text())
    assert census["conv"]["vendor"] > 0  # on the CPU every site runs on the vendor rung
    result = json.loads((run_dir / "result.json").read_text())
    assert result["cuda_graph"] is False and result["graph_capture_s"] == 0.0  # CPU: eager steps
    assert result["memory"] is None and result["plan"]["predicted_gib"] is None  # no device memory to model


def test_two_runs_give_identical_bits(baseline, cache, tmp_path):
    run_dir, _ = baseline
    worker.run(tiny_cfg(cache), tmp_path)
    assert stable_rows(tmp_path / "train_stats.csv") == stable_rows(run_dir / "train_stats.csv")
    assert same_params(params(tmp_path), params(run_dir))


def test_strict_mode_gives_the_same_bits_as_default(baseline, cache, tmp_path):
    run_dir, _ = baseline
    try:
        worker.run(tiny_cfg(cache, "determinism=strict"), tmp_path)
    finally:
        import torch

        torch.use_deterministic_algorithms(False)
    assert stable_rows(tmp_path / "train_stats.csv") == stable_rows(run_dir / "train_stats.csv")
    assert same_params(params(tmp_path), params(run_dir))


KILLER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from helpers import tiny_cfg
    from scaffold import worker
    from scaffold.trainer import Trainer
    calls = 0
    real_step = Trainer.step
    def step(self, *a, **k):
        global calls
        calls += 1
        if calls == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(self, *a, **k)
    Trainer.step = step
    worker.run(tiny_cfg(Path({cache!r})), Path({run_dir!r}))
""")


def test_sigkill_in_second_epoch_then_resume_is_bitwise_identical(baseline, cache, tmp_path):
    run_dir, _ = baseline
    killed = tmp_path / "killed"
    # 3 steps of epoch 1 + 1 step into epoch 2 (the warm-up runs its own step on a copy of the model):
    # killed in the middle of epoch 2.
    script = KILLER.format(tests=str(REPO / "tests"), kill_at=3 + 2, cache=str(cache),
                           run_dir=str(killed))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert len(read_rows(killed / "train_stats.csv")) == 1
    res = cli(f"resume={killed}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert stable_rows(killed / "train_stats.csv") == stable_rows(run_dir / "train_stats.csv")
    assert same_params(params(killed), params(run_dir))


def test_corrupt_last_falls_back_to_best(cache, tmp_path):
    run_dir = tmp_path / "run"
    worker.run(tiny_cfg(cache), run_dir)
    best_epoch = next(int(r["epoch"]) for r in reversed(read_rows(run_dir / "train_stats.csv"))
                      if r["is_best"] == "1")
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"torn")
    res = cli(f"resume={run_dir}", "epochs=4", "progress=false", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resuming from" in res.stdout + res.stderr and "best.pt" in res.stdout + res.stderr
    rows = read_rows(run_dir / "train_stats.csv")
    assert [int(r["epoch"]) for r in rows] == list(range(1, 5))
    assert best_epoch <= 4


def test_resume_errors_are_one_line(cache, tmp_path):
    missing = cli(f"resume={tmp_path / 'nope'}", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"error: resume={tmp_path / 'nope'}: no such run directory"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    res = cli(f"resume={foreign}", cwd=tmp_path)
    assert res.returncode == 2 and "not a scaffold run directory" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    a_file = tmp_path / "result.json"
    a_file.write_text("{}")
    res = cli(f"resume={a_file}", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: resume={a_file}: a file, not a run directory "
                                               "(resume= takes the run's directory)"]



def test_resume_before_the_first_checkpoint_starts_over_bitwise(baseline, cache, tmp_path):
    """Checkpoints reach the disk in the background: a run stopped before its first one did has only
    run.json (and maybe CSV rows). Its resume starts over and gives the uninterrupted bits."""
    run_dir, _ = baseline
    early = tmp_path / "early"
    early.mkdir()
    (early / "run.json").write_text(json.dumps({"config": worker.config_dict(tiny_cfg(cache)), "overrides": []}))
    (early / "train_stats.csv").write_text((run_dir / "train_stats.csv").read_text().splitlines()[0] + "\n")
    res = cli(f"resume={early}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "no checkpoint to resume from (neither last.pt nor best.pt): the run starts over from epoch 1" \
        in res.stdout + res.stderr
    assert stable_rows(early / "train_stats.csv") == stable_rows(run_dir / "train_stats.csv")
    assert same_params(params(early), params(run_dir))


@pytest.mark.parametrize("override, expected", [
    ("sclae=5", "sclae: unknown key (did you mean `scale`?)"),
    ("epoch=3", "epoch: unknown key (did you mean `epochs`?)"),
    ("=7", "=7: an override needs a key (KEY=VALUE, e.g. scale=7)"),
    ("scale=abc", "scale='abc'"),
    ("scale=3", "scale=3: expected greater than model.bottleneck (3)"),
    ("batch_size=1000", "batch_size=1000: expected at most the"),
    ("more_determinism=true", "more_determinism is retired"),
    ("data.n_categories=0", "data.n_categories=0: expected a positive integer"),
    ("ladder.conv=fast", "ladder.conv='fast': expected auto | gluon | routed | triton | vendor"),
    ("cuda_graph=yes", "cuda_graph='yes': expected auto | on | off"),
    ("progress=2", "progress=2: expected true or false"),  # OmegaConf alone reads 2 as true
    ("cuda_graph=on device=cpu", "cuda_graph='on': expected a CUDA device and volumes not split over ranks, got device cpu"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, override, expected):
    res = cli(*override.split(), "epochs=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], res.stderr
    assert not (tmp_path / "run" / "train_stats.csv").exists()


def test_an_empty_run_dir_is_one_line_and_writes_nothing(tmp_path):
    """`hydra.run.dir=` (empty) would have Hydra write the run into the working directory."""
    res = cli("hydra.run.dir=", "epochs=1", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "hydra.run.dir='': expected a folder path" in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = cli("progress=false", f"hydra.run.dir={blocker / 'run'}", "epochs=1",
              cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot create the run directory" in lines[0], res.stderr
    assert blocker.read_text() == "not a folder"  # nothing overwritten


def test_multirun_writes_summary(cache, tmp_path):
    sweep = tmp_path / "sweep"
    res = cli("-m", "seed=0,1", "epochs=1", *tiny_args(cache),
              f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = (sweep / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("job,overrides,epochs")
    assert len(summary) == 3 and "seed=0" in summary[1] and "seed=1" in summary[2]
    table, _, seeds = (sweep / "summary.md").read_text().partition("\nOver seeds")
    assert table.count("\n") == 4  # header, rule, two jobs
    assert "| 2 of 2 " in seeds  # the sweep's axis is the seed: both runs summarized over it
    for job in ("0", "1"):
        assert len(read_rows(sweep / job / "train_stats.csv")) == 1


def tiny_args(cache):
    from helpers import TINY

    return [*TINY, f"data.cache_dir={cache}"]


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(cache, tmp_path, monkeypatch):
    import torch

    from scaffold.trainer import Diverged, Trainer

    real = Trainer.step
    calls = {"n": 0}

    def step(self, *args, **kwargs):
        calls["n"] += 1
        loss, dice = real(self, *args, **kwargs)
        if calls["n"] > 3:  # after epoch 1's three steps (the warm-up steps a copy of the model)
            loss = loss * float("nan")
        return loss, dice

    monkeypatch.setattr(Trainer, "step", step)
    with pytest.raises(Diverged, match="non-finite loss at epoch 2"):
        worker.run(tiny_cfg(cache), tmp_path)
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert state["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_profile_writes_a_trace(cache, tmp_path):
    worker.run(tiny_cfg(cache, "profile=true", "epochs=1"), tmp_path)
    trace = json.loads((tmp_path / "profile_trace.json").read_text())
    assert trace["traceEvents"]


def test_torchrun_two_cpu_ranks_share_one_run_directory(cache, tmp_path):
    import shutil

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    res = subprocess.run(
        # --standalone: a rendezvous on a free local port, so nothing else on the machine can collide.
        [torchrun, "--standalone", "--nproc-per-node=2", "-m", "scaffold.train", *tiny_args(cache), "data.n_instances=12",
         "epochs=2", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_rows(tmp_path / "run" / "train_stats.csv")
    # 8 volumes: 6 train split over 2 ranks = 3 optimizer steps per epoch, losses reduced over ranks.
    assert [int(r["optimizer_steps"]) for r in rows] == [3, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # rank 1 created nothing of its own
