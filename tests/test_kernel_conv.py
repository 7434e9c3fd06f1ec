"""Triton conv kernels against float64 references (CPU interpreter at tiny shapes; CUDA if present).

Small-integer operands make every product and every fp32 partial sum exact, so each direction must
equal the float64 reference rounded once to the output dtype, bit for bit. Random operands must land
within a stated relative error: fp32 (IEEE dots) 1e-5, bf16 outputs 1e-2 (one bf16 rounding).
Every launcher writes into a NaN-poisoned buffer, so an unwritten element fails the comparison.
"""
import pytest
import torch
import torch.nn.functional as F

from scaffold.kernels import conv as K
from scaffold.kernels.conv.bias_grad import bias_grad
from scaffold.kernels.lib.device import triton_usable
from scaffold.kernels.reference import conv3d_ref, conv_transpose3d_ref

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not triton_usable(torch.empty(0, device=DEV)):
    pytest.skip("Triton cannot run here", allow_module_level=True)

CL = torch.channels_last_3d
# (N, Cin, Cout, spatial, kernel, stride, padding, dilation, bias, channels_last, dtype)
CONV_CASES = [
    pytest.param(2, 4, 7, (5, 3, 7), 3, 1, 1, 1, False, True, torch.float32, id="flat-prime-fp32"),
    pytest.param(1, 3, 6, (5, 3, 7), 3, 2, 1, 1, True, False, torch.bfloat16, id="stem-stride2-bf16"),
    pytest.param(1, 4, 6, (5, 4, 5), 3, 1, 2, 2, False, True, torch.float32, id="dilation2-fp32"),
    pytest.param(1, 20, 17, (3, 5, 3), 3, 1, 1, 1, True, True, torch.bfloat16, id="blocks-bf16"),
    pytest.param(1, 18, 16, (5, 3, 4), 3, 2, 1, 1, False, False, torch.float32, id="blocks-stride2"),
    pytest.param(2, 16, 6, (3, 3, 5), 1, 1, 0, 1, True, False, torch.float32, id="head-1x1x1-bias"),
]


def ints(gen, *shape, lo=-3, hi=4):
    return torch.randint(lo, hi, shape, generator=gen).to(torch.float64)


def poisoned(shape, dtype, channels_last=True):
    t = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    return t.contiguous(memory_format=CL) if channels_last and len(shape) == 5 else t


def on_dev(t, dtype, channels_last):
    t = t.to(device=DEV, dtype=dtype)
    return t.contiguous(memory_format=CL) if channels_last and t.dim() == 5 else t


def rel_err(got, ref):
    return ((got.double().cpu() - ref).norm() / ref.norm()).item()


def run_conv_directions(x, w, b, dy, geom, dtype):
    """Every conv launcher once, each into a NaN-poisoned buffer: (y, dx, dw, db)."""
    stride, padding, dilation = geom
    y = K.conv3d_forward(x, w, b, stride, padding, dilation, out=poisoned(dy.shape, dtype))
    dx = K.conv3d_backward_data(dy, w, x.shape, stride, padding, dilation,
                                out=poisoned(x.shape, dtype, channels_last=False))
    dw = K.conv3d_backward_weight(dy, x, w.shape, dtype, stride, padding, dilation,
                                  out=poisoned(w.shape, dtype))
    db = bias_grad(dy, dtype, out=poisoned((dy.shape[1],), dtype)) if b is not None else None
    return y, dx, dw, db


def make_conv(gen, n, cin, cout, size, k, s, p, d, has_bias, integer):
    x = ints(gen, n, cin, *size) if integer else torch.randn(n, cin, *size, generator=gen, dtype=torch.float64)
    w = ints(gen, cout, cin, k, k, k) if integer else torch.randn(cout, cin, k, k, k, generator=gen, dtype=torch.float64)
    b = (ints(gen, cout) if integer else torch.randn(cout, generator=gen, dtype=torch.float64)) if has_bias else None
    y_shape = F.conv3d(x, w, None, s, p, d).shape
    dy = ints(gen, *y_shape) if integer else torch.randn(*y_shape, generator=gen, dtype=torch.float64)
    return x, w, b, dy


@pytest.mark.parametrize("n,cin,cout,size,k,s,p,d,has_bias,cl,dtype", CONV_CASES)
def test_conv_small_integers_bitwise(n, cin, cout, size, k, s, p, d, has_bias, cl, dtype):
    gen = torch.Generator().manual_seed(1000 + cin * 31 + cout)
    x, w, b, dy = make_conv(gen, n, cin, cout, size, k, s, p, d, has_bias, integer=True)
    geom = ((s,) * 3, (p,) * 3, (d,) * 3)
    refs = conv3d_ref(x, w, b, *geom, grad_out=dy)
    args = [on_dev(x, dtype, cl), on_dev(w, dtype, False), None if b is None else on_dev(b, dtype, cl),
            on_dev(dy, dtype, not cl)]  # dy in the other layout: the kernels read any strides
    got = run_conv_directions(*args, geom, dtype)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, refs):
        if r is None:
            continue
        expect = r.to(dtype).double()  # exact fp32 accumulation, one rounding to the output dtype
        assert torch.equal(g.double().cpu(), expect), f"{name} differs from the float64 reference"


@pytest.mark.parametrize("n,cin,cout,size,k,s,p,d,has_bias,cl,dtype", CONV_CASES[::2])
def test_conv_random_error_bound_and_determinism(n, cin, cout, size, k, s, p, d, has_bias, cl, dtype):
    gen = torch.Generator().manual_seed(7 + cin)
    x, w, b, dy = make_conv(gen, n, cin, cout, size, k, s, p, d, has_bias, integer=False)
    geom = ((s,) * 3, (p,) * 3, (d,) * 3)
    args = [on_dev(x, dtype, cl), on_dev(w, dtype, False), None if b is None else on_dev(b, dtype, cl),
            on_dev(dy, dtype, cl)]
    # The reference sees the same rounded operands the kernel sees.
    refs = conv3d_ref(*[None if a is None else a.double().cpu() for a in args[:3]], *geom,
                      grad_out=args[3].double().cpu())
    first = run_conv_directions(*args, geom, dtype)
    second = run_conv_directions(*args, geom, dtype)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    for name, g1, g2, r in zip(("y", "dx", "dw", "db"), first, second, refs):
        if r is None:
            continue
        assert torch.equal(g1, g2), f"{name}: two calls differ"
        assert rel_err(g1, r) < bound, f"{name}: relative error {rel_err(g1, r):.2e} >= {bound}"


@pytest.mark.parametrize("dtype,bias,cl", [(torch.float32, True, True), (torch.bfloat16, False, False)])
def test_conv_transpose_small_integers_bitwise(dtype, bias, cl):
    gen = torch.Generator().manual_seed(5)
    x = ints(gen, 2, 5, 3, 2, 5)
    w = ints(gen, 5, 7, 2, 2, 2)
    b = ints(gen, 7) if bias else None
    dy = ints(gen, 2, 7, 6, 4, 10)
    refs = conv_transpose3d_ref(x, w, b, 2, grad_out=dy)
    xd, wd, dyd = on_dev(x, dtype, cl), on_dev(w, dtype, False), on_dev(dy, dtype, not cl)
    bd = None if b is None else on_dev(b, dtype, False)
    y = K.conv_transpose3d_forward(xd, wd, bd, out=poisoned(dy.shape, dtype))
    dx = K.conv_transpose3d_backward_data(dyd, wd, x.shape, out=poisoned(x.shape, dtype))
    dw = K.conv_transpose3d_backward_weight(dyd, xd, w.shape, dtype, out=poisoned(w.shape, dtype))
    db = bias_grad(dyd, dtype, out=poisoned((7,), dtype)) if bias else None
    for name, g, r in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), refs):
        if r is not None:
            assert torch.equal(g.double().cpu(), r.to(dtype).double()), f"transposed {name} differs"


def test_conv_transpose_wide_channels_random():
    """Cin 24 (two K blocks), Cout 6 (a column tile straddling taps), random fp32."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 24, 3, 2, 3, generator=gen, dtype=torch.float64)
    w = torch.randn(24, 6, 2, 2, 2, generator=gen, dtype=torch.float64)
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    dy = torch.randn(1, 6, 6, 4, 6, generator=gen, dtype=torch.float64)
    refs = conv_transpose3d_ref(x, w, b, 2, grad_out=dy)
    f = lambda t: t.to(device=DEV, dtype=torch.float32)  # noqa: E731
    y = K.conv_transpose3d_forward(f(x), f(w), f(b), out=poisoned(dy.shape, torch.float32))
    dx = K.conv_transpose3d_backward_data(f(dy), f(w), x.shape)
    dw = K.conv_transpose3d_backward_weight(f(dy), f(x), w.shape, torch.float32)
    db = bias_grad(f(dy), torch.float32)
    for name, g, r in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), refs):
        assert rel_err(g, r) < 1e-5, f"transposed {name}: relative error {rel_err(g, r):.2e}"


def test_bias_grad_many_splits_fixed_order():
    """A long reduction cut into several splits: exact on integers, identical across calls."""
    gen = torch.Generator().manual_seed(3)
    dy = ints(gen, 2, 5, 9, 8, 7)
    got = bias_grad(dy.float().to(DEV), torch.float32, out=poisoned((5,), torch.float32))
    assert torch.equal(got.double().cpu(), dy.sum(dim=(0, 2, 3, 4)))
    r = torch.randn(2, 5, 9, 8, 7, generator=gen).to(DEV)
    assert torch.equal(bias_grad(r, torch.float32), bias_grad(r, torch.float32))


# --- box kernels (tensor-descriptor loads): stride 1, channels-last operands, Cout % 8 == 0 ---------

# (N, Cin, Cout, spatial, kernel, padding, dilation, bias, dtype)
BOX_CASES = [
    pytest.param(2, 8, 16, (5, 3, 7), 3, 1, 1, True, torch.float32, id="box-prime-fp32"),
    pytest.param(1, 16, 8, (4, 6, 5), 3, 2, 2, False, torch.float32, id="box-dilation2-fp32"),
    pytest.param(1, 8, 24, (3, 5, 4), 1, 0, 1, True, torch.bfloat16, id="box-1x1x1-bf16"),
    pytest.param(1, 24, 16, (6, 5, 3), 3, 0, 1, False, torch.bfloat16, id="box-valid-bf16"),
    # Cin not a multiple of 8: (kh, kw, ci) folded into channels (the stem), or Cin zero-padded
    pytest.param(1, 3, 16, (5, 4, 6), 3, 1, 1, True, torch.float32, id="box-stem-fold-fp32"),
    pytest.param(2, 3, 8, (4, 5, 3), 3, 2, 2, False, torch.bfloat16, id="box-stem-fold-dil2-bf16"),
    pytest.param(1, 3, 8, (4, 5, 6), 3, 0, 1, False, torch.float32, id="box-stem-fold-valid"),
    pytest.param(1, 12, 8, (4, 4, 5), 3, 1, 1, True, torch.float32, id="box-odd-cin-padded"),
]


def cl_all(dtype, *ts):
    return [None if t is None else on_dev(t, dtype, True) for t in ts]


@pytest.mark.parametrize("n,cin,cout,size,k,p,d,has_bias,dtype", BOX_CASES)
def test_box_conv_small_integers_bitwise(n, cin, cout, size, k, p, d, has_bias, dtype):
    """Forward, backward-data (into an NCDHW buffer: any output strides) and backward-weight on
    the box path equal the float64 reference exactly; padding is the zero fill of out-of-volume
    (negative included) box coordinates."""
    from scaffold.kernels.conv.box import box_supported

    gen = torch.Generator().manual_seed(2000 + cin * 31 + cout)
    x, w, b, dy = make_conv(gen, n, cin, cout, size, k, 1, p, d, has_bias, integer=True)
    geom = ((1,) * 3, (p,) * 3, (d,) * 3)
    refs = conv3d_ref(x, w, b, *geom, grad_out=dy)
    xd, wd, dyd = cl_all(dtype, x, w, dy)
    bd = None if b is None else on_dev(b, dtype, False)
    if DEV.type == "cpu" or dtype != torch.float32:  # the GPU keeps fp32 on the gather kernels
        assert box_supported((xd, wd), wd.shape, (1, 1, 1)) and box_supported((dyd, xd), wd.shape, (1, 1, 1))
    got = run_conv_directions(xd, wd, bd, dyd, geom, dtype)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, refs):
        if r is not None:
            assert torch.equal(g.double().cpu(), r.to(dtype).double()), f"box {name} differs"


@pytest.mark.parametrize("taps", [1, 3])
def test_box_weight_grad_taps_per_program(taps, monkeypatch):
    """One program owning 1 or 3 kw taps (dy box loaded once for all three): same exact result;
    a reduction cut into several splits summed in fixed order, identical across calls."""
    from scaffold.kernels.conv import tiles
    from scaffold.kernels.conv.tiles import Tile

    gen = torch.Generator().manual_seed(11)
    x, w, _, dy = make_conv(gen, 2, 8, 16, (7, 5, 6), 3, 1, 1, 1, False, integer=True)
    geom = ((1,) * 3, (1,) * 3, (1,) * 3)
    refs = conv3d_ref(x, w, None, *geom, grad_out=dy)
    xd, wd, dyd = cl_all(torch.float32, x, w, dy)
    monkeypatch.setitem(tiles.FORCED, "boxw", Tile(16, 8, 16, num_warps=4, num_stages=1, taps=taps))
    dw = K.conv3d_backward_weight(dyd, xd, w.shape, torch.float32, *geom,
                                  out=poisoned(w.shape, torch.float32))
    assert torch.equal(dw.double().cpu(), refs[2])
    r = torch.randn(2, 8, 7, 5, 6, generator=gen).to(DEV).contiguous(memory_format=CL)
    g = torch.randn(2, 16, 7, 5, 6, generator=gen).to(DEV).contiguous(memory_format=CL)
    one = K.conv3d_backward_weight(g, r, w.shape, torch.float32, *geom)
    assert torch.equal(one, K.conv3d_backward_weight(g, r, w.shape, torch.float32, *geom))
    ref = conv3d_ref(r.double().cpu(), torch.zeros(w.shape, dtype=torch.float64), None, *geom,
                     grad_out=g.double().cpu())[2]
    assert rel_err(one, ref) < 1e-5


@pytest.mark.parametrize("k,p,dtype", [(1, 0, torch.float32), (3, 1, torch.bfloat16)])
def test_box_weight_grad_cout_not_multiple_of_8(k, p, dtype, monkeypatch):
    """Cout = 6 (the head): dy zero-padded to 16 channels for the box backward-weight kernel (a spy
    checks that it ran); dW exact, only its 6 real rows written."""
    from scaffold.kernels.conv import box as conv_box

    gen = torch.Generator().manual_seed(19)
    x, w, _, dy = make_conv(gen, 2, 16, 6, (3, 4, 5), k, 1, p, 1, False, integer=True)
    geom = ((1,) * 3, (p,) * 3, (1,) * 3)
    refs = conv3d_ref(x, w, None, *geom, grad_out=dy)
    xd, wd, dyd = cl_all(dtype, x, w, dy)
    ran = []
    real = conv_box._conv_box_wgrad_kernel

    class Spy:
        def __getitem__(self, grid):
            ran.append(grid)
            return real[grid]
    monkeypatch.setattr(conv_box, "_conv_box_wgrad_kernel", Spy())
    dw = K.conv3d_backward_weight(dyd, xd, w.shape, dtype, *geom, out=poisoned(w.shape, dtype))
    assert ran or (DEV.type == "cuda" and dtype == torch.float32)
    assert torch.equal(dw.double().cpu(), refs[2].to(dtype).double())


def test_box_random_bf16_error_bound_and_repeat():
    """Random bf16 operands on the box path: within one bf16 rounding, two calls bitwise equal."""
    gen = torch.Generator().manual_seed(12)
    x, w, b, dy = make_conv(gen, 1, 16, 24, (6, 4, 5), 3, 1, 1, 1, True, integer=False)
    geom = ((1,) * 3, (1,) * 3, (1,) * 3)
    xd, wd, dyd = cl_all(torch.bfloat16, x, w, dy)
    bd = on_dev(b, torch.bfloat16, False)
    refs = conv3d_ref(*[a.double().cpu() for a in (xd, wd, bd)], *geom, grad_out=dyd.double().cpu())
    first = run_conv_directions(xd, wd, bd, dyd, geom, torch.bfloat16)
    second = run_conv_directions(xd, wd, bd, dyd, geom, torch.bfloat16)
    for name, g1, g2, r in zip(("y", "dx", "dw", "db"), first, second, refs):
        assert torch.equal(g1, g2), f"box {name}: two calls differ"
        assert rel_err(g1, r) < 1e-2, f"box {name}: relative error {rel_err(g1, r):.2e}"


@pytest.mark.parametrize("n,cin,cout,size,dtype", [
    pytest.param(1, 8, 16, (3, 4, 5), torch.float32, id="T-prime-fp32"),
    pytest.param(2, 16, 32, (2, 3, 4), torch.bfloat16, id="T-batch2-bf16"),
    pytest.param(1, 24, 16, (5, 2, 8), torch.float32, id="T-flat-plane"),
])
def test_conv_transpose_box_backward_small_integers_bitwise(n, cin, cout, size, dtype, monkeypatch):
    """Transposed conv (kernel = stride = 2) backward passes on the box kernels, each tap a box of
    dy's subsampled view: dx (into an NCDHW buffer) and dW equal the float64 reference exactly;
    dy's taps meet their weight rows, not a neighbouring tap's channels. (The kernels take inputs
    of 64³ voxels and more; the threshold is lowered here to run them at tiny shapes.)"""
    from scaffold.kernels.conv import box as conv_box
    from scaffold.kernels.conv.box import transposed_box_supported

    monkeypatch.setattr(conv_box, "TRANSPOSED_BOX_MIN_VOXELS", 1)

    gen = torch.Generator().manual_seed(17 + cin)
    x, w = ints(gen, n, cin, *size), ints(gen, cin, cout, 2, 2, 2)
    dy = ints(gen, n, cout, *(2 * e for e in size))
    refs = conv_transpose3d_ref(x, w, None, 2, grad_out=dy)
    xd, wd, dyd = cl_all(dtype, x, w, dy)
    if DEV.type == "cpu" or dtype != torch.float32:
        assert transposed_box_supported((dyd, wd), wd.shape)
    dx = K.conv_transpose3d_backward_data(dyd, wd, x.shape,
                                          out=poisoned(x.shape, dtype, channels_last=False))
    dw = K.conv_transpose3d_backward_weight(dyd, xd, w.shape, dtype, out=poisoned(w.shape, dtype))
    assert torch.equal(dx.double().cpu(), refs[1].to(dtype).double())
    assert torch.equal(dw.double().cpu(), refs[2].to(dtype).double())


def test_box_routing(monkeypatch):
    """What takes the box kernels: stride 1, channels-last operands of one dtype, Cout % 8; which
    odd input channel counts are folded into channels and which zero-padded; which transposed convs'
    backward passes."""
    from scaffold.kernels.conv import box as conv_box
    from scaffold.kernels.conv.box import box_supported, transposed_box_supported
    from scaffold.kernels.conv.fold import folds

    x = torch.zeros(1, 16, 4, 4, 4, device=DEV).contiguous(memory_format=CL)
    w = torch.zeros(8, 16, 3, 3, 3, device=DEV).contiguous(memory_format=CL)
    cpu = DEV.type == "cpu"
    assert box_supported((x, w), w.shape, (1, 1, 1)) == cpu  # fp32 stays on gather on the GPU
    xb, wb = x.bfloat16(), w.bfloat16()
    assert box_supported((xb, wb), w.shape, (1, 1, 1))
    assert not box_supported((xb, wb), w.shape, (2, 2, 2))  # strided: gather
    assert not box_supported((xb.contiguous(), wb), w.shape, (1, 1, 1))  # NCDHW input
    assert not box_supported((xb, wb.contiguous()), w.shape, (1, 1, 1))  # weight not channels-last
    assert not box_supported((xb, wb), (6, 16, 3, 3, 3), (1, 1, 1))  # Cout 6: rows not 16-byte
    assert not box_supported((xb, w), w.shape, (1, 1, 1))  # mixed dtypes
    x3 = torch.zeros(1, 3, 4, 4, 4, device=DEV, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w3 = torch.zeros(8, 3, 3, 3, 3, device=DEV, dtype=torch.bfloat16).contiguous(memory_format=CL)
    assert box_supported((x3, w3), w3.shape, (1, 1, 1))  # the RGB stem: folded
    assert folds(3, (3, 3, 3)) and folds(1, (5, 5, 5))  # KH·KW·Cin 27, 25: folded
    assert not folds(12, (3, 3, 3)) and not folds(16, (3, 3, 3))  # 108: padded; 16: as is
    dy = torch.zeros(1, 32, 8, 8, 8, device=DEV, dtype=torch.bfloat16).contiguous(memory_format=CL)
    wt = torch.zeros(16, 32, 2, 2, 2, device=DEV, dtype=torch.bfloat16).contiguous(memory_format=CL)
    assert not transposed_box_supported((dy, wt), wt.shape)  # 4³ input voxels: gather kernels
    monkeypatch.setattr(conv_box, "TRANSPOSED_BOX_MIN_VOXELS", 64)
    assert transposed_box_supported((dy, wt), wt.shape)  # from 64 input voxels: box kernels
    assert not transposed_box_supported((dy, wt), (16, 8, 2, 2, 2))  # Cout 8: not a multiple of 16
    assert not transposed_box_supported((dy, wt), (12, 32, 2, 2, 2))  # Cin 12
    dy2 = torch.zeros(1, 32, 8, 2, 2, device=DEV, dtype=torch.bfloat16).contiguous(memory_format=CL)
    assert not transposed_box_supported((dy2, wt), wt.shape)  # 1×1 input planes: boxes under 16


def test_box_split_loop_for_few_tiles():
    """A launch of fewer tiles than multiprocessors splits its (tap, channel) loop: fp32 partials
    summed in fixed order, bias added once; exact on integers, into a channels-last and an NCDHW
    output; identical across calls."""
    from scaffold.kernels.conv import box as conv_box

    gen = torch.Generator().manual_seed(13)
    x, w, b, dy = make_conv(gen, 1, 16, 16, (4, 4, 4), 3, 1, 1, 1, True, integer=True)
    geom = ((1,) * 3, (1,) * 3, (1,) * 3)
    refs = conv3d_ref(x, w, b, *geom, grad_out=dy)
    xd, wd, dyd = cl_all(torch.float32, x, w, dy)
    bd = on_dev(b, torch.float32, False)
    launches = []
    real = conv_box._conv_box_kernel
    monkey = pytest.MonkeyPatch()

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkey.setattr(conv_box, "_conv_box_kernel", Spy())
    try:
        y = K.conv3d_forward(xd, wd, bd, *geom, out=poisoned(dy.shape, torch.float32))
        y2 = K.conv3d_forward(xd, wd, bd, *geom, out=poisoned(dy.shape, torch.float32, False))
        dx = K.conv3d_backward_data(dyd, wd, x.shape, *geom, out=poisoned(x.shape, torch.float32))
    finally:
        monkey.undo()
    if DEV.type == "cpu":
        assert all(g[1] > 1 for g in launches), launches  # the split path ran
    assert torch.equal(y.double().cpu(), refs[0]) and torch.equal(y2, y)
    assert torch.equal(dx.double().cpu(), refs[1])


def test_wave_split_plan_fills_whole_waves(monkeypatch):
    """The backward-weight split count: whole waves where the reduction is long (the fill-twice rule
    gave 270 programs on 132 multiprocessors: a third, nearly empty wave), no split where the tiles
    alone make many waves or where the fp32 partials would cost more than the waves save."""
    from scaffold.kernels.lib import splits

    monkeypatch.setattr(splits, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    flops = 2 * 128 * 64 * 64 * 3  # one 128-voxel box, 64 × 64 channels, 3 taps
    old, _ = splits.split_plan(cpu, 9, 16384, 64 * 64 * 27)
    assert 9 * old == 270  # 2.05 waves
    for per_sm in (1, 2, 3):
        s, per = splits.wave_split_plan(cpu, 9, 16384, 64 * 64 * 27, flops, per_sm)
        slots = 132 * per_sm
        assert 9 * s / (-(-9 * s // slots) * slots) >= 0.95, (per_sm, s)  # waves ≥ 95% full
        assert s * per >= 16384 > (s - 1) * per  # every split has work
    assert splits.wave_split_plan(cpu, 1152, 8, 1024 * 1024 * 27, flops, 1) == (1, 8)
    assert splits.wave_split_plan(cpu, 288, 64, 512 * 512 * 27, flops, 1) == (1, 64)


@pytest.mark.parametrize("padding", [(0, 1, 1), (0, 0, 1)], ids=["halo-D", "halo-DH"])
@pytest.mark.parametrize("cin,cout,dtype", [(16, 8, torch.bfloat16), (4, 6, torch.float32), (3, 8, torch.float32)],
                         ids=["box-bf16", "gather-fp32", "stem-fp32"])
def test_halo_block_paddings_small_integers_bitwise(padding, cin, cout, dtype):
    """The geometry of a halo'd block (scaffold.spatial.HaloConv3d): a 3x3x3 conv unpadded along D, or
    along D and H, padded by one elsewhere; every direction equals the float64 reference exactly."""
    gen = torch.Generator().manual_seed(3000 + cin * 31 + cout + sum(padding))
    x, w, b, dy = make_conv(gen, 1, cin, cout, (5, 6, 4), 3, 1, padding, 1, True, integer=True)
    geom = ((1,) * 3, padding, (1,) * 3)
    refs = conv3d_ref(x, w, b, *geom, grad_out=dy)
    xd, wd, dyd = cl_all(dtype, x, w, dy)
    got = run_conv_directions(xd, wd, on_dev(b, dtype, False), dyd, geom, dtype)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, refs):
        assert torch.equal(g.double().cpu(), r.to(dtype).double()), f"{name} differs from the float64 reference"
