"""Sweeps that stop before their end: a signal ends a sweep with the summary of the jobs so far, and a
job of a submitit sweep that is requeued (preempted, or past its time limit) continues its own run."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import REPO, TINY, cli, params, same_params, stable_rows, tiny_cfg
from scaffold import worker

LAUNCH_TIMEOUT = 300

# Installed as sitecustomize in a submitit job's process: submitit's warning signal (SIGUSR2, sent
# before a time limit or a preemption) at the job's N-th step, once per job (a marker file per job id
# keeps the requeued process from being signalled again).
USR2_IN_SUBMITIT_JOBS = """
import os
if os.environ.get("SUBMITIT_LOCAL_JOB_ID") and os.environ.get("SCAFFOLD_TEST_USR2_AT"):
    import signal
    from pathlib import Path
    from scaffold.trainer import Trainer

    at, real, calls = int(os.environ["SCAFFOLD_TEST_USR2_AT"]), Trainer.step, {"n": 0}
    marker = Path(os.environ["SCAFFOLD_TEST_MARKERS"]) / os.environ["SUBMITIT_LOCAL_JOB_ID"]

    def step(self, masks):
        calls["n"] += 1
        if calls["n"] == at and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("sent")
            os.kill(os.getpid(), signal.SIGUSR2)
        return real(self, masks)

    Trainer.step = step
"""


def _summary(sweep) -> list[dict[str, str]]:
    with open(sweep / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def _sweep(cache, sweep):
    return ["-m", "seed=0,1,2", *TINY, "epochs=1", f"data.cache_dir={cache}", f"hydra.sweep.dir={sweep}"]


def _stopped_sweep(cache, tmp_path):
    """A sweep of three jobs stopped by SIGTERM in the second (its second step; the first has finished);
    one epoch of three steps per job: the signal lands at the process's fifth step."""
    sweep = tmp_path / "sweep"
    res = subprocess.run([sys.executable, str(REPO / "tests" / "faults.py"), "term=0@5", *_sweep(cache, sweep)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                         env={**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})
    return sweep, res


def test_sigterm_ends_a_sweep_with_the_summary_of_its_jobs_so_far(cache, tmp_path):
    """The stopped job saves its position, the sweep ends there, and summary.csv lists the finished job
    and the stopped one as `interrupted (resume=...)`; the third job never starts."""
    sweep, res = _stopped_sweep(cache, tmp_path)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-3000:]
    assert f"(resume={sweep / '1'} continues it)" in res.stderr, res.stderr[-3000:]
    rows = _summary(sweep)
    assert [r["job"] for r in rows] == ["0", "1"]
    assert rows[0]["status"] in ("epoch cap", "reached target") and rows[0]["epochs"] == "1"
    assert rows[0]["overrides"].startswith("seed=0")
    assert rows[1]["status"] == f"interrupted (resume={sweep / '1'})"
    assert rows[1]["overrides"].startswith("seed=1")
    assert "interrupted (resume=" in (sweep / "summary.md").read_text()
    assert "sweep summary (2 jobs)" in res.stdout
    assert not (sweep / "2").exists()
    assert f"resume=auto hydra.sweep.dir={sweep} continues the sweep" in res.stderr


def test_resume_auto_continues_a_stopped_sweep_job_by_job(cache, tmp_path):
    """The same sweep again with resume=auto: each job continues the run its directory holds (the stopped
    one bit for bit, as if never stopped) or starts its own; the summary lists all three finished."""
    sweep, res = _stopped_sweep(cache, tmp_path)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-3000:]
    res = cli(*_sweep(cache, sweep), "resume=auto", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _summary(sweep)
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert all(r["status"] in ("epoch cap", "reached target") and r["epochs"] == "1" for r in rows), rows
    assert rows[1]["resumes"].startswith("@0 seed=1") and rows[2]["resumes"] == ""
    whole = tmp_path / "whole"
    worker.run(tiny_cfg(cache, "seed=1", "epochs=1"), whole)
    assert stable_rows(sweep / "1" / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(sweep / "1"), params(whole))


def test_resume_auto_in_a_sweep_needs_a_fixed_sweep_directory(tmp_path):
    res = cli("-m", "seed=0,1", "epochs=1", "resume=auto", cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "resume=auto in a sweep (-m): needs one fixed hydra.sweep.dir=" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_requeued_submitit_job_continues_its_run(cache, tmp_path):
    """hydra-submitit-launcher's local executor, as under Slurm: submitit's warning signal (SIGUSR2) at
    the job's second step. The job stops at a step boundary with its position saved, the signal goes on
    to submitit's handler, which calls the launcher's checkpoint() (the same job again) and requeues it;
    the requeued job finds its run in its directory and continues it, bit for bit, to the end."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="the slurm extra (pip install 'scaffold-unet[slurm]') is part of the test install")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(USR2_IN_SUBMITIT_JOBS)
    sweep, markers = tmp_path / "sweep", tmp_path / "markers"
    args = ["-m", "hydra/launcher=submitit_local", "seed=1", *TINY, "epochs=2", f"data.cache_dir={cache}",
            f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=5"]
    res = subprocess.run([sys.executable, "-m", "scaffold.train", *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=LAUNCH_TIMEOUT,
                         env={**os.environ, "PYTHONPATH": f"{site}:{REPO}", "SCAFFOLD_TEST_USR2_AT": "2",
                              "SCAFFOLD_TEST_MARKERS": str(markers)})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert len(list(markers.iterdir())) == 1  # the signal was sent, once
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.*"))
    assert "interrupted by SIGUSR2: epoch 1 stopped after 2 steps, position saved" in logs, logs[-3000:]
    assert "resume=auto: " in logs and "holds a run: continuing it" in logs
    record = json.loads((sweep / "0" / "run.json").read_text())
    assert [r["at_epoch"] for r in record["resumes"]] == [0]  # continued inside epoch 1
    rows = _summary(sweep)
    assert len(rows) == 1 and rows[0]["status"] in ("epoch cap", "reached target") and rows[0]["epochs"] == "2"
    whole = tmp_path / "whole"
    worker.run(tiny_cfg(cache, "seed=1", "epochs=2"), whole)
    assert stable_rows(sweep / "0" / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(sweep / "0"), params(whole))


def test_the_slurm_launcher_config_asks_for_the_warning_signal_and_requeues(tmp_path, monkeypatch):
    """conf/hydra/launcher/slurm.yaml as submitit reads it (no Slurm here: a stand-in srun, nothing is
    submitted): the batch script asks for SIGUSR2 120 s before the end and lets Slurm requeue the job,
    a time limit is requeued up to 20 times, and the launcher's checkpoint() resubmits the same job
    (sweep point and number, so the same directory)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="the slurm extra (pip install 'scaffold-unet[slurm]') is part of the test install")
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from scaffold import cli as scaffold_cli

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    scaffold_cli.register()
    with initialize_config_dir(config_dir=scaffold_cli.conf_dir(), version_base=None):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    seen = {}

    class Submitted(Exception):
        pass

    def map_array(self, fn, *args):  # what would be submitted
        seen.update(script=self._executor._make_submission_file_text("python -m job", "uid"),
                    max_num_timeout=self._executor.max_num_timeout, fn=fn, args=[a[0] for a in args])
        raise Submitted

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", map_array)
    with pytest.raises(Submitted):
        launcher.launch([["seed=3"]], initial_job_idx=0)
    lines = seen["script"].splitlines()
    assert "#SBATCH --signal=USR2@120" in lines and "#SBATCH --requeue" in lines
    assert seen["max_num_timeout"] == 20
    again = seen["fn"].checkpoint(*seen["args"])
    assert isinstance(again, submitit.helpers.DelayedSubmission)
    assert again.function is launcher and list(again.args[:3]) == [["seed=3"], "hydra.sweep.dir", 0]
