"""The optimizer benchmark runs on the CPU (Triton's interpreter), times its three variants side by side
and records them."""
import json

import pytest

pytest.importorskip("triton")


def test_the_optimizer_benchmark_times_ours_against_torch_and_the_casts(tmp_path, capsys):
    from scaffold.bench.optimizer import main
    from scaffold.model.unet import UNet3d

    out = tmp_path / "optimizer.json"
    assert main(["--reps", "1", "--scale", "4", "--width", "4", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["ms"]) == {"ours", "torch", "casts"} and all(len(v) == 1 for v in record["ms"].values())
    assert record["params"] == sum(p.numel() for p in UNet3d(4, base_width=4, groups=4).parameters())
    table = capsys.readouterr().out
    assert "torch + casts" in table and table.count("x\n") >= 4
