"""The loss benchmark runs end to end on the CPU at a tiny size and writes its JSON."""
import json

from scaffold.bench import loss as bench


def test_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "sub" / "loss.json"
    payload = bench.main(["--device", "cpu", "--size", "8", "--reps", "3", "--repeats", "2",
                          "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(payload))
    row = saved["results"][0]
    assert row["edge"] == 8 and row["ours"]["median_ms"] > 0 and row["naive"]["median_ms"] > 0
    assert row["ours"]["distinct_values_per_100"] == 1  # CPU reductions repeat bit for bit
    assert not list(out.parent.glob(".loss-*"))  # no temp file left behind
