"""The norm benchmark's site lists and table, without a GPU (the timing itself needs one)."""
import pytest

from scaffold.bench import norm as nb


def test_sites_follow_the_model():
    s7 = nb.norm_sites(7)
    assert sum(s["count"] for s in s7) == 18  # two GroupNorms per DoubleConv, 9 DoubleConvs
    assert [(s["channels"], s["edge"]) for s in s7] == [(64, 128), (128, 64), (256, 32), (512, 16), (1024, 8)]
    s8 = nb.norm_sites(8)
    assert sum(s["count"] for s in s8) == 22 and s8[-1] == dict(channels=2048, edge=8, groups=8, count=2)
    assert [(s["channels"], s["edge"]) for s in nb.concat_sites(7)] == [(64, 128), (128, 64), (256, 32),
                                                                       (512, 16)]


def test_table_totals_weight_sites_by_count():
    rows = [dict(channels=8, edge=4, count=4, aten=dict(fwd_ms=1.0, bwd_ms=2.0, total_ms=3.0, floor_ms=0.5,
                                                        tb_per_s=1.0)),
            dict(channels=16, edge=2, count=2, skipped=True)]
    assert nb.totals(rows)["aten"] == dict(fwd_ms=4.0, bwd_ms=8.0, total_ms=12.0, floor_ms=2.0)
    table = nb.format_table("t", rows, ["aten", "triton"])
    assert "8@4^3" in table and table.splitlines()[-1].split()[:3] == ["total", "4.000/", "8.000"]


def test_cli_rejects_bad_scale():
    with pytest.raises(SystemExit, match=r"--scales \[2\]: expected integers in 4..9"):
        nb.main(["--scales", "2"])


def test_stream_reference_row_adds_into_the_totals(monkeypatch):
    # The reference runs its passes (here on the CPU, each timed as 1 ms) and reports what totals() sums.
    import torch

    from scaffold.bench.timing import Timing

    calls = []
    monkeypatch.setattr(nb, "measure",
                        lambda fn, timer: (calls.append((timer, fn())), Timing((1.0,)))[1])
    x = torch.randn(1, 8, 4, 4, 4).to(torch.bfloat16)
    r = nb.stream_reference(x)
    assert [c[0] for c in calls] == ["device", "device"] and r["total_ms"] == 2.0
    assert r["floor_ms"] == x.numel() * 2 * 5 / nb.PEAK_BYTES_PER_S * 1e3
    assert nb.totals([dict(channels=8, edge=4, count=3, stream=r)])["stream"]["total_ms"] == 6.0
