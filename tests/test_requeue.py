"""Preemption under a scheduler: the warning signal (SIGUSR1, Slurm's --signal=B:USR1@120 forwarded by
scripts/slurm-multinode.sbatch) saves the position like SIGTERM, and the requeued job's command line,
unchanged (resume=auto with its fixed run directory), continues the run bit for bit; its first start
begins the run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from helpers import REPO, TINY, cli, params, same_params, stable_rows, tiny_cfg
from scaffold import checkpoint, worker
from scaffold.stats import read_rows


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("baseline")
    worker.run(tiny_cfg(cache), run_dir)
    return run_dir


def test_usr1_then_the_same_command_continues_bitwise(baseline, cache, tmp_path):
    run = tmp_path / "slurm-123"
    command = [*TINY, "epochs=3", f"data.cache_dir={cache}", "resume=auto", f"hydra.run.dir={run}"]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}
    # The job's first start: a new run in the fixed directory; the warning lands at step 5 (epoch 2).
    res = subprocess.run([sys.executable, str(REPO / "tests" / "faults.py"), "usr1=0@5", *command], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 128 + signal.SIGUSR1, res.stderr[-3000:]
    assert "interrupted by SIGUSR1: epoch 2 stopped after 2 steps, position saved" in res.stderr
    assert checkpoint.load_one(run / "checkpoints" / "last.pt")["position"]["steps"] == 2
    assert [r["epoch"] for r in read_rows(run / "train_stats.csv")] == ["1"]
    # The requeued job: the same command line.
    res = cli(*command, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from" in res.stdout + res.stderr
    assert stable_rows(run / "train_stats.csv") == stable_rows(baseline / "train_stats.csv")
    assert same_params(params(run), params(baseline))


def test_resume_auto_needs_a_fixed_run_directory(tmp_path):
    res = cli("resume=auto", "epochs=1", cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "resume=auto: needs one fixed hydra.run.dir=" in lines[0], res.stderr
    assert not (tmp_path / "outputs").exists()
