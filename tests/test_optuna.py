"""Hyperparameter search: the task returns the configured objective, the pre-flight checks sweeps it cannot
list (intervals) by sampling them, and the Optuna preset (conf/hparams_search/optuna_lr.yaml) runs."""
from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from scaffold import cli, train
from scaffold.cli import register
from scaffold.config import OBJECTIVES, ConfigError
from helpers import TINY
from helpers import cli as run_cli


def run_task(tmp_path, *overrides: str, mode: str = "RUN"):
    """The Hydra task in this process, on a composed config; returns its value and the run directory."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    register()
    run_dir = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base=None):
        cfg = compose("config", overrides=[*TINY, "epochs=1", f"data.cache_dir={tmp_path / 'cache'}",
                                           *overrides, f"hydra.runtime.output_dir={run_dir}",
                                           f"hydra.mode={mode}"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # what a job receives
        return train._task(job_cfg), run_dir
    finally:
        HydraConfig.instance().cfg = None


@pytest.mark.slow
def test_task_returns_the_configured_objective(tmp_path):
    value, run_dir = run_task(tmp_path)  # the default objective
    result = json.loads((run_dir / "result.json").read_text())
    assert value == result["best_val_loss"]
    for objective in ("best_val_dice", "final_val_dice"):
        value, run_dir = run_task(tmp_path, f"objective={objective}")
        assert value == json.loads((run_dir / "result.json").read_text())[objective] > 0
    # A missed target ranks last; so does a failed job of a sweep (which must not end the sweep).
    assert run_task(tmp_path, "objective=time_to_target")[0] == math.inf
    assert run_task(tmp_path, "lr=-1", mode="MULTIRUN")[0] == math.inf
    assert run_task(tmp_path, "lr=-1", "objective=final_val_dice", mode="MULTIRUN")[0] == -math.inf


def test_objective_directions_follow_the_objective():
    register()
    node = OmegaConf.create({"objective": "best_val_loss", "direction": "${scaffold.direction:${objective}}"})
    for objective, direction in OBJECTIVES.items():
        node.objective = objective
        assert node.direction == direction
    assert train.worst("best_val_dice") == -math.inf and train.worst("time_to_target") == math.inf
    with pytest.raises(ConfigError, match="^objective='accuracy': expected best_val_loss"):
        cli.preflight(["objective=accuracy"])


def test_preflight_samples_intervals():
    assert cli.preflight(["-m", "lr=interval(0.0005,0.002)"]) == ["-m", "lr=interval(0.0005,0.002)"]
    cli.preflight(["-m", "lr=tag(log, interval(0.0005,0.002))", "data.val_fraction=interval(0.2,1.0)"])
    cli.preflight(["-m", "hparams_search=optuna_lr"])
    bad = {
        "lr=interval(-1,0)": r"^lr=-1.0: expected a number in \(0, 10\] \(a value of lr=interval\(-1,0\)\)$",
        "lr=interval(0.002,0.0005)": r"^lr=interval\(0.002,0.0005\): the interval's start is above its end$",
        "lr=tag(log,interval(0,1))": r"^lr=tag\(log,interval\(0,1\)\): a log interval needs a start > 0$",
        "epochs=interval(1,5)": r"^epochs=1.0: .*Integer \(a value of epochs=interval\(1,5\)\)$",  # floats
        "hparams_search=nope": r"^hparams_search=nope: no such preset \(choose from: .*optuna_lr",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            cli.preflight(["-m", override])


def test_preflight_checks_a_presets_search_space(tmp_path, monkeypatch):
    """A preset's sweeper params are sampled like the command line's sweeps, unless the command line
    replaces them; a preset whose sweeper is not installed fails in one line."""
    (tmp_path / "hparams_search").mkdir(parents=True)
    (tmp_path / "hparams_search" / "bad.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n"
        "      lr: tag(log, interval(0.0002, 0.005))\n      optim.weight_decay: choice(0.0, -1.0)\n")
    monkeypatch.setattr(cli, "_conf_root", lambda: tmp_path)
    with pytest.raises(ConfigError, match=r"^optim.weight_decay=-1.0: .*\(a value of optim.weight_decay=ch"):
        cli.preflight(["-m", "hparams_search=bad"])
    cli.preflight(["-m", "hparams_search=bad", "optim.weight_decay=0.0,0.0001"])  # replaced: passes
    monkeypatch.undo()
    monkeypatch.setattr(cli, "_has_optuna", lambda: False)
    with pytest.raises(ConfigError, match=r"^hparams_search=optuna_lr: needs Hydra's Optuna sweeper \(pip"):
        cli.preflight(["-m", "hparams_search=optuna_lr"])
    cli.preflight(["-m", "seed=0,1"])  # the basic sweeper needs nothing more


def test_preflight_error_is_one_line_without_traceback(tmp_path):
    res = run_cli("-m", "lr=interval(-1,0)", *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: lr=-1.0: expected a number in (0, 10] (a value of lr=interval(-1,0))"]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_optuna_sweep_of_two_trials_reports_the_objective(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper",
                        reason="the optuna extra (pip install 'scaffold-unet[optuna]') is part of the test "
                               "install")
    sweep = tmp_path / "sweep"
    res = run_cli("-m", "hparams_search=optuna_lr", "hydra.sweeper.n_trials=2", "lr=interval(0.0005,0.002)",
                  *TINY, "epochs=1", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={sweep}",
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    objectives = []
    for job in ("0", "1"):
        assert (sweep / job / "train_stats.csv").is_file()
        result = json.loads((sweep / job / "result.json").read_text())
        lr = float(next(o for o in result["overrides"] if o.startswith("lr=")).split("=", 1)[1])
        assert 0.0005 <= lr < 0.002  # the command line's interval replaced the preset's
        objectives.append(result["best_val_loss"])  # the default objective
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert best.best_value == min(objectives)  # minimized, as the objective's direction says
    assert set(best.best_params) == {"lr", "optim.weight_decay"}
    assert (sweep / "summary.md").is_file()  # the sweep summary callback ran too
