"""The pool benchmark's sites and table, without a GPU (the timing itself needs one)."""
import pytest
import torch

from scaffold.bench import pool as pb
from scaffold.model import UNet3d


@pytest.mark.parametrize("scale", [7, 8])
def test_sites_are_the_models_pool_inputs(scale):
    with torch.device("meta"):
        model = UNet3d(scale)
    widths = [down.conv.conv1.in_channels for down in model.downs]
    assert [(s["channels"], s["edge"]) for s in pb.pool_sites(scale)] == [
        (w, 2 ** (scale - i)) for i, w in enumerate(widths)]


def test_table_has_a_row_per_site_and_the_sums():
    row = dict(site="64@128", fwd_bytes=2 * 10**9, bwd_bytes=10**9)
    for m in pb.methods():
        row.update({f"{m}_fwd_ms": 1.0, f"{m}_bwd_ms": 0.5})
    totals = {f"{m}_{d}_ms": 2.0 for m in pb.methods() for d in ("fwd", "bwd")}
    lines = pb.format_table(7, [row], totals).splitlines()
    assert len(lines) == 3 and lines[1].split()[-1] == "2.00/2.00"  # TB/s of triton, fwd / bwd
    assert lines[2].split()[0] == "sum"


def test_cli_rejects_bad_scale():
    with pytest.raises(SystemExit, match=r"--scales \[3\]: expected integers in 4..9"):
        pb.main(["--scales", "3"])
