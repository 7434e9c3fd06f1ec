"""The Gluon 3×3×3 conv (scaffold.kernels.conv.gluon): imports and declines cleanly where it cannot run;
on an sm_90 GPU, forward and backward-data against cuDNN in fp32 on the same bf16 operands, every
output element written (NaN-poisoned output), bitwise equal across calls, for each kind of tile."""
import pytest
import torch

from scaffold.kernels.conv import gluon as G


def test_declines_cleanly_where_it_cannot_run():
    x = torch.zeros(1, 64, 4, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    w = torch.zeros(64, 64, 3, 3, 3, dtype=torch.bfloat16)
    if not torch.cuda.is_available():
        assert not G.available()
        assert G.unavailable_reason()  # says why, in words
    assert not G.supported(x, w)  # CPU tensors never go to the Gluon kernel


def test_tile_rules():
    with pytest.raises(ValueError, match="bd=2"):
        G.GluonTile(4, 8, 8, 64, halo=True)
    with pytest.raises(ValueError, match="warps"):
        G.GluonTile(1, 4, 4, 64, halo=False, warps=8)  # 16 rows cannot feed 8 warps
    assert G.GluonTile(2, 8, 8, 64, halo=True, warps=4).a_rows == 256  # (2 + 2) planes of 64
    # 256 x 128 tiles, 4 stages: 192 KiB of ring; the epilogue's scratch (64 KiB) only when not direct
    assert G.GluonTile(4, 8, 8, 128, stages=4, halo=False, direct=True).smem_bytes() == 4 * 48 * 1024
    assert G.GluonTile(4, 8, 8, 128, stages=4, halo=False).smem_bytes() == (4 * 48 + 64) * 1024


def test_weight_matrix_rows_are_tap_major():
    w = torch.randn(5, 3, 3, 3, 3)
    m = G.weight_matrix(w)
    assert m.shape == (27 * 3, 5)
    for kd, kh, kw, ci, co in [(0, 0, 0, 0, 0), (2, 1, 0, 2, 4), (1, 2, 2, 1, 3)]:
        assert m[((kd * 3 + kh) * 3 + kw) * 3 + ci, co] == w[co, ci, kd, kh, kw]
    mb = G.weight_matrix(w, mirror=True)  # backward-data: flipped taps, Cin and Cout swapped
    assert mb.shape == (27 * 5, 3)
    assert mb[((0 * 3 + 1) * 3 + 2) * 5 + 4, 2] == w[4, 2, 2, 1, 0]


TILES = [
    G.GluonTile(4, 8, 8, 64, stages=4, halo=False, warps=8, persistent=True),
    G.GluonTile(4, 8, 8, 64, stages=4, halo=False, warps=8, persistent=True, ws=True),
    G.GluonTile(2, 8, 8, 64, stages=4, halo=False, warps=4, persistent=False),
    G.GluonTile(2, 8, 8, 64, stages=2, halo=True, warps=4),
    G.GluonTile(2, 8, 8, 128, stages=4, halo=False, warps=8, persistent=True),
    G.GluonTile(4, 8, 8, 128, stages=4, halo=False, warps=8, ws=True, direct=True),
    G.GluonTile(2, 8, 8, 256, stages=4, halo=False, warps=8, ws=True, direct=True),
]
SHAPES = [(2, 64, 64, (5, 6, 7)), (1, 128, 64, (9, 12, 10)), (1, 64, 128, (20, 24, 40))]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.bd}x{t.bh}x{t.bw}x{t.bn}{'h' if t.halo else 'w' if t.ws else 'p'}{'d' if t.direct else ''}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, (s[1], s[2], *s[3]))))
def test_matches_cudnn_fp32(tile, shape):
    if not G.available():
        pytest.skip(G.unavailable_reason())
    from scaffold.bench.gluon_conv import check

    row = check(*shape, [tile], with_triton=False)
    for key, v in row.items():
        assert not key.endswith("_error"), f"{key}: {v}"
        if key.endswith("_rel_err"):
            assert v < 5e-3, f"{key} = {v:.2e}"
        if key.endswith("_nan"):
            assert not v, f"{key}: an output element was left unwritten"
        if key.endswith("_repeat_equal"):
            assert v, f"{key}: two calls differ"
    assert any(k.endswith("_rel_err") for k in row)
