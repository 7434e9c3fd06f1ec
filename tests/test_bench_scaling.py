"""scaffold.bench.scaling on the CPU (gloo): one process and 2 ranks, twice each, in one call."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import LAUNCH_TIMEOUT, REPO, TINY


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "scaffold.bench.scaling", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=4 * LAUNCH_TIMEOUT)


def test_it_times_one_process_and_each_rank_count_and_checks_their_bits(tmp_path):
    """Every size's runs finish, each row's figures follow from its runs (median step time, samples per
    second over the ranks, efficiency against one process), and the runs of each size are bitwise
    identical (data parallelism at a fixed world size is)."""
    out = tmp_path / "scaling.json"
    overrides = [o for o in TINY if not o.startswith(("scale=", "progress="))]
    res = _bench(tmp_path, "--ranks", "2", "--scale", "3", "--epochs", "1", "--reps", "2", "--out", str(out),
                 "--workdir", str(tmp_path / "runs"), "--", *overrides, f"data.cache_dir={tmp_path / 'cache'}")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    rows = {r["size"]: r for r in got["rows"]}
    assert list(rows) == ["one process", "2 ranks"]
    base = rows["one process"]
    for row in rows.values():
        assert row["errors"] == [] and row["bitwise"] is True
        assert len(row["step_ms"]) == 2 and all(ms > 0 for ms in row["step_ms"])
        ms = sorted(row["step_ms"])
        assert row["step_ms_median"] == (ms[0] + ms[1]) / 2
        assert row["samples_per_s"] == row["ranks"] * got["batch_per_rank"] * 1000 / row["step_ms_median"]
        assert row["efficiency"] == base["step_ms_median"] / row["step_ms_median"]
    assert rows["2 ranks"]["ranks"] == 2 and base["ranks"] == 1
    assert "2 ranks" in res.stdout and "efficiency" in res.stdout


def test_a_bad_rank_count_is_one_line(tmp_path):
    res = _bench(tmp_path, "--ranks", "0,2")
    assert res.returncode == 2
    assert "--ranks=0,2: expected rank counts >= 1" in res.stderr
    assert not (tmp_path / "bench_results").exists()
