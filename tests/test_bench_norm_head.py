"""The tail benchmark (scaffold.bench.norm_head) runs end to end at a tiny shape (on the CPU in Triton's
interpreter), writes its JSON, and finds the fused tail equal to the separate ops up to the order of
two sums and bitwise run to run; bad arguments stop it with one line."""
import json

import pytest
import torch

pytest.importorskip("triton")

from scaffold.bench import norm_head as bench  # noqa: E402


def test_it_times_both_and_checks_the_numerics(tmp_path, capsys):
    out = tmp_path / "tail.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert bench.main(["--scale", "3", "--width", "16", "--classes", "3", "--reps", "1", "--device", device,
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["ms"]) == {"apart_fwd", "apart_bwd", "fused_fwd", "fused_bwd"}
    assert all(v["median_ms"] > 0 for v in r["ms"].values())
    assert r["fused_backward_same_bits_twice"] is True
    tol = 1e-4 if device == "cpu" else 0.1  # fp32 on the CPU; bf16 roundings on CUDA
    assert r["max_abs_diff_logits"] < tol and r["max_abs_diff_dx"] < tol
    assert "fused / apart" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--scale", "12"], r"--scale 12: expected an integer in 1\.\.9"),
    (["--classes", "40"], r"--classes 40 --width 64: expected at most 16 classes"),
    (["--width", "60"], r"--classes 6 --width 60: expected .* divisible by 8"),
])
def test_bad_arguments_stop_it_with_one_line(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(args)
