"""Sweeps that stop before their end: a signal ends a sweep with the summary of the jobs so far, and a
job of a submitit sweep that is requeued (preempted, or past its time limit) continues its own run."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys

from helpers import REPO, TINY

LAUNCH_TIMEOUT = 300


def _summary(sweep) -> list[dict[str, str]]:
    with open(sweep / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_sigterm_ends_a_sweep_with_the_summary_of_its_jobs_so_far(cache, tmp_path):
    """SIGTERM in the second of three jobs (its second step; the first job has finished): the job saves
    its position, the sweep ends there, and summary.csv lists the finished job and the stopped one as
    `interrupted (resume=...)`; the third job never starts."""
    sweep = tmp_path / "sweep"
    # One epoch of three steps per job: the signal lands at the process's fifth step, job 1's second.
    args = ["term=0@5", "-m", "seed=0,1,2", *TINY, "epochs=1", f"data.cache_dir={cache}",
            f"hydra.sweep.dir={sweep}"]
    res = subprocess.run([sys.executable, str(REPO / "tests" / "faults.py"), *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                         env={**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})
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
