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


def test_a_sizes_memory_and_time_to_target_come_from_its_runs_results(tmp_path):
    from scaffold.bench import scaling

    def run(name, result):
        folder = tmp_path / name
        folder.mkdir()
        if result is not None:
            (folder / "result.json").write_text(json.dumps(result))
        return {"step_ms": 10.0, **scaling.run_results(folder)}

    a = run("a", {"time_to_target_s": 90.0, "epochs": 18, "optimizer_steps": 3024, "final_val_dice": 0.95,
                  "memory": {"predicted_gib": 4.0, "peak_gib": [4.1, 4.3], "peak_over_predicted": 1.075}})
    b = run("b", {"time_to_target_s": 120.0, "epochs": 22, "optimizer_steps": 3696,
                  "memory": {"predicted_gib": 4.0, "peak_gib": [4.2, 4.0], "peak_over_predicted": 1.05}})
    c = run("c", {"time_to_target_s": None, "epochs": 50, "optimizer_steps": 8400, "memory": None})
    d = run("d", None)  # no result.json: only its step time
    assert set(a) == {"step_ms", *scaling.RESULT_KEYS} and "final_val_dice" not in a
    assert "memory" not in c and "time_to_target_s" not in c and d == {"step_ms": 10.0}
    assert scaling._memory([a, b, c, d]) == {"peak_gib": 4.3, "predicted_gib": 4.0}
    assert scaling._memory([c, d]) == {}
    target = scaling._target([a, b, c])
    assert target["time_to_target_s"] == 105.0 and target["reached_target"] == "2 of 3"
    assert target["epochs_to_target"] == [18, 22] and target["steps_to_target"] == [3024, 3696]
    assert scaling._target([c, d]) == {}


def test_spatial_sizes_split_one_volume_and_count_its_throughput_once(tmp_path):
    """--spatial: the 2-rank size runs with parallel.spatial_shards=2, its samples per second count one
    volume per step, and its efficiency is one process's step time over twice its own."""
    out = tmp_path / "scaling.json"
    overrides = [o for o in TINY if not o.startswith(("scale=", "progress="))]
    res = _bench(tmp_path, "--ranks", "2", "--scale", "3", "--epochs", "1", "--reps", "1", "--spatial",
                 "--out", str(out), "--workdir", str(tmp_path / "runs"), "--", *overrides,
                 f"data.cache_dir={tmp_path / 'cache'}")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    one, two = got["rows"]
    assert got["spatial"] is True and (one["spatial_shards"], two["spatial_shards"]) == (1, 2)
    plan = json.loads((tmp_path / "runs" / "ranks2-rep0" / "run.json").read_text())["plan"]
    assert plan["spatial_shards"] == 2 and plan["world"] == 2
    assert two["samples_per_s"] == got["batch_per_rank"] * 1000 / two["step_ms_median"]
    assert two["efficiency"] == one["step_ms_median"] / (2 * two["step_ms_median"])
    assert two["speedup"] == one["step_ms_median"] / two["step_ms_median"]
    assert "strong scaling" in res.stdout
