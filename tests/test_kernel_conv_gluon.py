"""The Gluon 3×3×3 conv (scaffold.kernels.conv.gluon, .gluon_wgrad): imports and declines cleanly where it
cannot run; on an sm_90 GPU, its three directions against cuDNN in fp32 on the same bf16 operands, every
output element written (NaN-poisoned output), bitwise equal across calls, for each kind of tile."""
import pytest
import torch

from scaffold.kernels.conv import gluon as G
from scaffold.kernels.conv import gluon_wgrad as GW


def test_declines_cleanly_where_it_cannot_run():
    x = torch.zeros(1, 64, 4, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    w = torch.zeros(64, 64, 3, 3, 3, dtype=torch.bfloat16)
    if not torch.cuda.is_available():
        assert not G.available()
        assert G.unavailable_reason()  # says why, in words
    assert not G.supported(x, w)  # CPU tensors never go to the Gluon kernel
    assert not GW.supported(x, x, w.shape)


def test_tile_rules():
    with pytest.raises(ValueError, match="bd=2"):
        G.GluonTile(4, 8, 8, 64, halo=True)
    with pytest.raises(ValueError, match="warps"):
        G.GluonTile(1, 4, 4, 64, halo=False, warps=8)  # 16 rows cannot feed 8 warps
    with pytest.raises(ValueError, match="bd=4"):
        G.GluonTile(2, 8, 8, 64, halo=True, ws=True, warps=4)  # two warpgroups of two planes each
    # BD + 2 = 6 planes in two allocations (4, then 2): nothing rounded up; three weight tiles
    t = G.GluonTile(4, 8, 8, 64, stages=3, halo=True, ws=True, warps=4, direct=True)
    assert t.a_rows == 6 * 64 and t.smem_bytes() == 3 * (6 * 64 * 64 * 2 + 3 * 64 * 64 * 2)
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
    G.GluonTile(4, 8, 8, 64, stages=3, halo=True, warps=4, ws=True, direct=True),
    G.GluonTile(4, 8, 8, 128, stages=2, halo=True, warps=4, ws=True, direct=True),
    G.GluonTile(4, 8, 8, 128, bk=32, stages=4, halo=True, warps=4, ws=True, direct=True),
]
SHAPES = [(2, 64, 64, (5, 6, 7)), (1, 128, 64, (9, 12, 10)), (1, 64, 128, (20, 24, 40))]


def _tile_id(t: G.GluonTile) -> str:
    """e.g. 4x8x8x128xdk32: the box and width, the kind (x d-halo warp-specialized, h d-halo, w
    warp-specialized, p persistent), d for direct stores, kN for N-channel steps other than 64."""
    kind = ("x" if t.ws else "h") if t.halo else ("w" if t.ws else "p")
    steps = "" if t.bk == 64 else f"k{t.bk}"
    return f"{t.bd}x{t.bh}x{t.bw}x{t.bn}{kind}{'d' if t.direct else ''}{steps}"


def assert_check_row(row: dict) -> None:
    """A row of scaffold.bench.gluon_conv.check: no call failed, each error within 5e-3 of fp32
    cuDNN, no element left unwritten (NaN-poisoned output), two calls bitwise equal; at least one
    tile checked."""
    for key, v in row.items():
        assert not key.endswith("_error"), f"{key}: {v}"
        if key.endswith("_rel_err"):
            assert v < 5e-3, f"{key} = {v:.2e}"
        if key.endswith("_nan"):
            assert not v, f"{key}: an output element was left unwritten"
        if key.endswith("_repeat_equal"):
            assert v, f"{key}: two calls differ"
    assert any(k.endswith("_rel_err") for k in row), row


def test_wgrad_tile_rules_and_its_chunks_cover_every_box_once():
    # alternate boxes: a warpgroup frees a stage two boxes later (two stages deadlock), and an odd
    # ring makes it wait on a stage two phases ahead
    for stages in (2, 3, 5):
        with pytest.raises(ValueError, match="even ring"):
            GW.WgradTile(stages=stages)
    GW.WgradTile(stages=2, split_planes=True)  # each warpgroup reads every box: any ring
    assert GW.WgradTile(bco=128, stages=3).mode == "cout"  # so does each with its 64 output channels
    with pytest.raises(ValueError, match="even bd"):
        GW.WgradTile(3, 4, 8, split_planes=True)
    with pytest.raises(ValueError, match="bco 64"):
        GW.WgradTile(bco=128, split_planes=True)
    with pytest.raises(ValueError, match="64 MMA rows"):
        GW.WgradTile(bco=192)
    with pytest.raises(ValueError, match="multiple of 16"):
        GW.WgradTile(4, 2, 4)
    t = GW.WgradTile(4, 4, 8, stages=4)  # x: 6 planes of 32 voxels x 64 channels, dy: 4 planes
    assert t.smem_bytes() == 4 * 32 * (6 * 64 + 4 * 64) * 2 and t.per_sm == 1
    assert GW.WgradTile(8, 4, 4, stages=3, split_planes=True).per_sm == 2
    wide = GW.WgradTile(4, 4, 8, bco=128, stages=4)  # one x box for two 64-channel dy boxes
    assert wide.smem_bytes() == 4 * 32 * (6 * 64 + 4 * 128) * 2 and wide.slots_per_chunk == 1
    for shape, cout in [((1, 128, 128, 128, 64), 64), ((2, 5, 6, 7, 128), 64), ((1, 8, 8, 8, 1024), 1024)]:
        for tile in (t, GW.WgradTile(8, 4, 4, stages=3, split_planes=True), wide):
            programs, s, per, boxes = GW.plan(shape, cout, tile, 132)
            n, d, h, w, cin = shape
            assert boxes == n * -(-d // tile.bd) * -(-h // tile.bh) * -(-w // tile.bw)
            assert programs == 9 * (cin // 64) * -(-cout // tile.bco) * s
            assert (s - 1) * per < boxes <= s * per  # every box in one chunk, no chunk empty


WGRAD_TILES = [GW.WgradTile(4, 4, 8, stages=4), GW.WgradTile(2, 8, 8, stages=4),
               GW.WgradTile(4, 4, 8, stages=4, split_planes=True),
               GW.WgradTile(4, 4, 8, stages=3, split_planes=True), GW.WgradTile(4, 4, 8, bco=128, stages=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", WGRAD_TILES,
                         ids=lambda t: f"{t.bd}x{t.bh}x{t.bw}:{t.stages}:{t.mode}")
@pytest.mark.parametrize("shape", SHAPES + [(1, 64, 64, (33, 40, 48))],
                         ids=lambda s: "x".join(map(str, (s[1], s[2], *s[3]))))
def test_wgrad_matches_cudnn_fp32(tile, shape):
    """Backward-weight: against fp32 cuDNN on the same bf16 operands, every element written (NaN
    poisoned), two calls bitwise equal; ragged boxes on every face, several chunks."""
    if not G.available():
        pytest.skip(G.unavailable_reason())
    from scaffold.bench.gluon_conv import check

    assert_check_row(check(*shape, [tile], directions=("bwd_weight",), with_triton=False))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, (s[1], s[2], *s[3]))))
def test_matches_cudnn_fp32(tile, shape):
    if not G.available():
        pytest.skip(G.unavailable_reason())
    from scaffold.bench.gluon_conv import check

    assert_check_row(check(*shape, [tile], with_triton=False))


def test_the_gluon_rung_is_a_setting_and_declines_cpu_calls():
    from scaffold.model import policy

    assert "gluon" in policy.settings("conv")
    x = torch.zeros(1, 64, 4, 4, 4)
    w = torch.zeros(64, 64, 3, 3, 3)
    call = policy.ConvCall(x, w, None, (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    assert policy.select_rung("conv", "gluon", call) == policy.VENDOR


@pytest.mark.gpu
def test_the_gluon_route_runs_gluon_with_the_bias_and_its_gradients_are_right(monkeypatch):
    """Forward (with the bias), backward-data and backward-weight on the Gluon kernels (the bias
    gradient on ours), under bf16 autocast as training runs: each direction against fp32 cuDNN on
    the same bf16 operands, and the Gluon kernels did run (their calls counted)."""
    if not G.available():
        pytest.skip(G.unavailable_reason())
    from scaffold.model import conv as C

    calls = []
    for name in ("conv3d_forward", "conv3d_backward_data"):
        real = getattr(G, name)
        monkeypatch.setattr(G, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    real_w = GW.conv3d_backward_weight
    monkeypatch.setattr(GW, "conv3d_backward_weight",
                        lambda *a, **k: calls.append("conv3d_backward_weight") or real_w(*a, **k))
    g = torch.Generator(device="cuda").manual_seed(3)
    cl = torch.channels_last_3d
    x = torch.randn(1, 64, 12, 16, 20, device="cuda", generator=g).contiguous(memory_format=cl)
    w = (torch.randn(128, 64, 3, 3, 3, device="cuda", generator=g) * 0.05).contiguous(memory_format=cl)
    b = torch.randn(128, device="cuda", generator=g)
    dy = torch.randn(1, 128, 12, 16, 20, device="cuda", generator=g).to(torch.bfloat16).contiguous(
        memory_format=cl)  # as the next layer's backward hands it over: NDHWC
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
    with torch.autocast("cuda", torch.bfloat16):
        y = C.conv3d(xs, ws, bs, (1, 1, 1), (1, 1, 1), (1, 1, 1), (C.GLUON,) * 3)
    y.backward(dy)
    assert sorted(calls) == ["conv3d_backward_data", "conv3d_backward_weight", "conv3d_forward"]
    xr, wr, br = (t.detach().to(torch.bfloat16).float().requires_grad_() for t in (x, w, b))
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):
        yr = torch.nn.functional.conv3d(xr, wr, br, 1, 1)
        yr.backward(dy.float())
    for got, ref in ((y, yr), (xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad)):
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, rel


@pytest.mark.gpu
def test_a_volume_of_two_to_the_31_elements_is_addressed_right_to_its_last_planes():
    """128>64 at 256³, the site scale 8 routes here: its input (and backward-data's output) holds 2³¹
    elements, past 32-bit offsets. The last output planes of the whole volume, forward and
    backward-data, are bitwise those of the same kernel on the last 8 planes alone (the same box
    geometry, so the same sums: any offset that wrapped would differ); backward-weight over the whole
    volume, zero but for those planes, equals the slab's (exact sums of small integers)."""
    if not G.available():
        pytest.skip(G.unavailable_reason())
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs 40 GiB of device memory")
    g = torch.Generator(device="cuda").manual_seed(5)
    cl = torch.channels_last_3d

    def ndhwc(c):  # a channels_last_3d (1, c, 256, 256, 256) bf16 tensor
        return torch.randn(1, 256, 256, 256, c, device="cuda", dtype=torch.bfloat16,
                           generator=g).permute(0, 4, 1, 2, 3)

    x, dy = ndhwc(128), ndhwc(64)
    assert x.numel() == 2**31
    w = (torch.randn(64, 128, 3, 3, 3, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    slab = slice(248, 256)  # the last two 4-plane boxes; output planes 252..255 see only these

    def last_planes(t):
        return t[:, :, -4:].contiguous()

    y = G.conv3d_forward(x, w)
    y_slab = G.conv3d_forward(x[:, :, slab].contiguous(memory_format=cl), w)
    assert torch.equal(last_planes(y), last_planes(y_slab))
    del y, y_slab
    dx = G.conv3d_backward_data(dy, w)
    assert dx.numel() == 2**31
    dx_slab = G.conv3d_backward_data(dy[:, :, slab].contiguous(memory_format=cl), w)
    assert torch.equal(last_planes(dx), last_planes(dx_slab))
    del dx, dx_slab
    # Backward-weight: small integers in the planes that count, zeros elsewhere, so that every fp32 sum
    # (262,144 products of at most 4 in size) is exact in any order or chunking: the whole volume's
    # gradient equals the slab's bit for bit, and a wrapped offset, a lost or doubled plane would not.
    x[:, :, :248].zero_()
    dy[:, :, :252].zero_()
    for t, lo in ((x, 248), (dy, 252)):
        part = t[:, :, lo:]
        part.copy_(torch.randint(-2, 3, part.shape, device="cuda", generator=g).to(torch.bfloat16))
    dw = GW.conv3d_backward_weight(dy, x, dtype=torch.float32)
    dw_slab = GW.conv3d_backward_weight(dy[:, :, slab].contiguous(memory_format=cl),
                                        x[:, :, slab].contiguous(memory_format=cl), dtype=torch.float32)
    assert dw_slab.abs().max() > 0
    assert torch.equal(dw, dw_slab)


@pytest.mark.parametrize("spec", ["4x8x8x64:4:w1:8", "2x8x8x128:4:p1:8", "4x8x8x128:4:w1d:8",
                                  "4x8x8x64:3:xd:4", "4x8x8x128:4:xd:4:32", "w4x4x8:4", "w4x4x8:3:c"])
def test_compiles_for_sm90_with_overlapping_mmas_and_no_spills(spec, tmp_path):
    """Compiled ahead of time for sm_90 (no GPU needed; in a process of its own, away from the Triton
    interpreter the other tests run in): warpgroup MMAs and copy-engine loads in the SASS, no spills,
    shared memory within a block's limit, and no ptxas note that the MMAs were made to wait for
    each other (C7517, C7515): an accumulator reset inside the step loop once made ptxas drain
    every MMA at each step's end."""
    import json
    import os
    import subprocess
    import sys

    from scaffold.bench import gluon_aot

    why = gluon_aot.unavailable_reason()
    if why:
        pytest.skip(f"cannot compile for sm_90 here: {why}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "aot.json"
    res = subprocess.run([sys.executable, "-m", "scaffold.bench.gluon_aot", spec, "--size", "24",
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), res.stderr[-2000:]
    (r,) = json.loads(out.read_text()).values()
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["utmaldg"] > 0
    assert r["spill_bytes"] == 0 and r["fits"], r
    assert not {"C7517", "C7515"} & set(r["notes"]), r["notes"]
