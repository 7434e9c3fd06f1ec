"""GroupNorm (+ fused ReLU) Triton kernels against float64 references.

CPU: the Triton interpreter at tiny, odd shapes. GPU (`gpu` marker): real U-Net shapes under bf16 autocast
against F.group_norm in fp32, and bitwise reproducibility within and across processes.
"""
import hashlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from scaffold.kernels import groupnorm as gn
from scaffold.kernels.lib import layout as nsc
from scaffold.kernels import reference as ref

CL = torch.channels_last_3d
NAN = float("nan")


def rel_err(out, expect):
    """‖out − ref‖ / ‖ref‖ in float64."""
    return ((ref.f64(out) - expect).norm() / expect.norm()).item()


def make(N, C, spatial, dtype=torch.float32, layout="cl", seed=0, offset=0.0, affine=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((N, C) + spatial, generator=g) * 2.0 + offset
    x = x.to(dtype)
    x = x.contiguous(memory_format=CL) if layout == "cl" else x.contiguous()
    w = torch.randn(C, generator=g) if affine else None
    b = torch.randn(C, generator=g) if affine else None
    dy = torch.randn((N, C) + spatial, generator=g)
    return x, w, b, dy


def run_both(x, G, w, b, dy, relu, out_dtype=None, eps=1e-5, tile=None):
    """(y, dx, dw, db) from the launchers, and the same from the float64 reference."""
    out_dtype = out_dtype or x.dtype
    y, mean, rstd = gn.forward(x, G, w, b, eps, relu, out_dtype, tile=tile)
    dx, dw, db = gn.backward(dy.to(out_dtype), x, w, b, mean, rstd, G, relu, tile=tile)
    y_ref = ref.group_norm_relu(x, G, w, b, eps, relu)
    grads_ref = ref.group_norm_relu_grads(x, G, w, b, eps, relu, dy.to(out_dtype))
    return (y, dx, dw, db), (y_ref,) + grads_ref


T = gn.NormTile  # the tile overrides below
CASES = [  # N, C, G, spatial, layout, relu, affine, tile override
    (2, 8, 2, (3, 5, 7), "cl", True, True, None),
    (2, 16, 4, (3, 5, 7), "cl", False, True, None),
    (2, 24, 8, (5, 3, 2), "cl", True, True, T(32, 1, 4, 32, 1)),  # 3 channels per group, 1 row per tile
    (1, 24, 2, (7, 1, 11), "ncdhw", True, True, None),      # 12 channels per group, contiguous input
    (2, 16, 8, (3, 5, 7), "ncdhw", False, False, T(128, 1, 2, 128, 1)),  # affine=False
    (3, 12, 4, (2, 2, 13), "cl", True, True, T(16, 1, 64, 16, 1)),  # one tile per split, many splits
    (2, 16, 4, (3, 5, 7), "cl", True, True, T(64, 1, 4, 16, 1)),  # elementwise tiles ≠ split tiles
    (2, 16, 4, (3, 5, 7), "cl", True, True, T(64, 1, 4, 16, 1, 3, 2, 3, 2)),  # split loops pipelined
    (2, 16, 4, (3, 5, 7), "cl", True, True, T(64, 1, 4, 16, 1, bwd_stages=3)),  # fwd, bwd loops apart
]


@pytest.mark.parametrize("N,C,G,spatial,layout,relu,affine,tile", CASES)
def test_fp32_matches_float64(N, C, G, spatial, layout, relu, affine, tile):
    x, w, b, dy = make(N, C, spatial, layout=layout, affine=affine)
    got, expect = run_both(x, G, w, b, dy, relu, tile=tile)
    for name, out, e in zip(("y", "dx", "dw", "db"), got, expect):
        if e is None:
            continue
        assert out.dtype == torch.float32, name
        assert rel_err(out, e) < 1e-5, (name, rel_err(out, e))
    assert got[0].shape == x.shape and got[1].shape == x.shape
    # The output keeps the input's layout (channels-last in, channels-last out; NCDHW likewise).
    assert got[0].is_contiguous(memory_format=CL if layout == "cl" else torch.contiguous_format)


def test_large_mean_keeps_variance_accurate():
    # |mean| / std = 500: Σx² − (Σx)²/n in fp32 would lose ~all digits; the (mean, M2) merge does not.
    x, w, b, dy = make(2, 8, (5, 6, 7), offset=1000.0)
    got, expect = run_both(x, 2, w, b, dy, relu=True)
    assert rel_err(got[0], expect[0]) < 1e-4
    assert rel_err(got[1], expect[1]) < 1e-3  # dx: fp32 x̂ itself carries ~|mean|/std ulps


def test_bf16_input_fp32_output_and_bf16_output():
    x, w, b, dy = make(2, 16, (3, 5, 7), dtype=torch.bfloat16)
    got, expect = run_both(x, 4, w, b, dy, relu=True, out_dtype=torch.float32)  # autocast's contract
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    assert rel_err(got[0], expect[0]) < 1e-5
    assert rel_err(got[2], expect[2]) < 1e-5 and rel_err(got[3], expect[3]) < 1e-5
    assert rel_err(got[1], expect[1]) < 1e-2  # dx is rounded to bf16
    got, expect = run_both(x, 4, w, b, dy, relu=False, out_dtype=torch.bfloat16)
    assert got[0].dtype == torch.bfloat16
    assert rel_err(got[0], expect[0]) < 1e-2 and rel_err(got[1], expect[1]) < 1e-2
    # bf16 output = fp32 output rounded to nearest even: what a consumer's own cast would give.
    y32 = gn.forward(x, 4, w, b, 1e-5, False, torch.float32)[0]
    assert torch.equal(got[0], y32.to(torch.bfloat16))


def test_fp16_input():
    x, w, b, dy = make(2, 8, (3, 4, 5), dtype=torch.float16)
    got, expect = run_both(x, 4, w, b, dy, relu=True)
    assert got[0].dtype == torch.float16
    assert all(rel_err(o, e) < 2e-3 for o, e in zip(got, expect))


def test_public_entry_autograd_and_dtype_policy():
    x, w, b, dy = make(2, 16, (3, 5, 7))
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    y = gn.group_norm(xs, 4, ws, bs, 1e-5, True)
    grads = torch.autograd.grad(y, (xs, ws, bs), dy)
    expect = ref.group_norm_relu_grads(x, 4, w, b, 1e-5, True, dy)
    assert rel_err(y, ref.group_norm_relu(x, 4, w, b, 1e-5, True)) < 1e-5
    assert all(rel_err(g, e) < 1e-5 for g, e in zip(grads, expect))
    # Outside CUDA autocast the output has the input's dtype, as F.group_norm's does (on the CPU
    # autocast does not list group_norm, so it keeps bf16 there too).
    xb = x.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gn.group_norm(xb, 4, w, b, 1e-5, False).dtype == F.group_norm(xb, 4, w, b).dtype
    assert gn.group_norm(xb, 4, None, None, 1e-5, False, out_dtype=torch.float32).dtype == torch.float32


def test_nan_propagates_like_torch():
    x, w, b, dy = make(2, 8, (3, 3, 5))
    x[1, 5, 1, 2, 3] = NAN  # sample 1, group 2 of 4 (channels 4-5)
    for relu in (False, True):
        y, mean, rstd = gn.forward(x, 4, w, b, 1e-5, relu, torch.float32)
        y_ref = ref.group_norm_relu(x, 4, w, b, 1e-5, relu)
        assert torch.equal(y.isnan(), y_ref.isnan())
        assert y[1, 4:6].isnan().all() and y.isnan().sum() == 2 * 45
        finite = ~y_ref.isnan()
        assert rel_err(y[finite], y_ref[finite]) < 1e-5
        dx = gn.backward(dy, x, w, b, mean, rstd, 4, relu)[0]
        dx_ref = ref.group_norm_relu_grads(x, 4, w, b, 1e-5, relu, dy)[0]
        assert torch.equal(dx.isnan(), dx_ref.isnan())
    # ReLU of a NaN input stays NaN (not 0), as F.relu.
    assert torch.isnan(gn.group_norm(torch.full((1, 2, 1, 1, 3), NAN), 1, None, None, 1e-5, True)).all()


def test_every_output_element_written():
    x, w, b, dy = make(2, 24, (3, 5, 7), layout="cl")
    y = torch.full(x.shape, NAN).contiguous(memory_format=CL)
    y, mean, rstd = gn.forward(x, 8, w, b, 1e-5, True, torch.float32, out=y)
    assert not y.isnan().any()
    dx = torch.full(x.shape, NAN).contiguous(memory_format=CL)
    dx, dw, db = gn.backward(dy, x, w, b, mean, rstd, 8, True, out=dx)
    assert not dx.isnan().any() and not dw.isnan().any() and not db.isnan().any()


def test_split_loop_options_keep_the_bits():
    """Pipelining or unrolling the split passes' loops reorders no arithmetic: same bits."""
    x, w, b, dy = make(2, 16, (5, 5, 5))
    outs = [run_both(x, 4, w, b, dy, True, tile=T(64, 1, 4, 16, 1, *loop))[0]
            for loop in ((0, 0, 0, 0), (2, 2, 3, 0), (0, 4, 4, 2))]
    assert all(torch.equal(p, q) for o in outs[1:] for p, q in zip(outs[0], o))


def test_deterministic_bits():
    x, w, b, dy = make(2, 16, (5, 5, 5))
    runs = []
    for _ in range(2):
        y, mean, rstd = gn.forward(x, 4, w, b, 1e-5, True, torch.float32)
        runs.append((y,) + gn.backward(dy, x, w, b, mean, rstd, 4, True))
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_non_collapsible_layout_is_converted():
    x, w, b, dy = make(1, 8, (4, 6, 5))
    xs = x.transpose(3, 4)  # D, H, W no longer collapse into one stride
    assert nsc.nsc_strides(xs) is None
    y = gn.forward(xs, 2, w, b, 1e-5, True, torch.float32)[0]
    assert rel_err(y, ref.group_norm_relu(xs, 2, w, b, 1e-5, True)) < 1e-5


def test_supported_and_one_line_errors():
    x = torch.randn(1, 12, 2, 2, 2)
    assert gn.group_norm_supported(x, 4, None, None)
    assert not gn.group_norm_supported(x, 5, None, None)
    assert not gn.group_norm_supported(x[:, :, 0], 4, None, None)
    assert not gn.group_norm_supported(x.double(), 4, None, None)
    assert not gn.group_norm_supported(x, 4, torch.ones(11), None)
    with pytest.raises(ValueError, match="num_groups=5 must be positive and divide C=12"):
        gn.group_norm(x, 5, None, None, 1e-5, False)
    with pytest.raises(ValueError, match=r"weight must have shape \(12,\)"):
        gn.group_norm(x, 4, torch.ones(3), None, 1e-5, False)


def test_custom_ops_pass_opcheck():
    x, w, b, dy = make(1, 8, (2, 3, 3))
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    torch.library.opcheck(torch.ops.scaffold.group_norm_fwd.default,
                          (x, w, b, 4, 1e-5, True, torch.float32),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    y, mean, rstd = gn.forward(x.detach(), 4, w, b, 1e-5, True, torch.float32)
    torch.library.opcheck(torch.ops.scaffold.group_norm_bwd.default,
                          (dy, x.detach(), w.detach(), b.detach(), mean, rstd, 4, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_eager_path_gives_the_registered_ops_bits():
    """group_norm runs eagerly as a plain autograd Function (no custom-op dispatch on the host) and
    the registered op when torch.compile traces: both must give the same output and gradients."""
    x, w, b, dy = make(2, 16, (3, 5, 7))
    outs = []
    for eager in (True, False):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        if eager:
            y = gn.group_norm(xs, 4, ws, bs, 1e-5, True)
            assert type(y.grad_fn).__name__ == "_GroupNormFnBackward"
        else:
            y = torch.ops.scaffold.group_norm_fwd(xs, ws, bs, 4, 1e-5, True, torch.float32)[0]
        outs.append((y, *torch.autograd.grad(y, (xs, ws, bs), dy)))
    for e, r in zip(*outs):
        assert torch.equal(e, r)


def test_second_derivative_is_refused():
    """First-order gradients only, on the eager path as on the registered op: differentiating the
    gradient raises instead of silently returning a wrong (missing) second derivative."""
    x, w, b, dy = make(1, 8, (2, 3, 3))
    xs, dys = x.clone().requires_grad_(), dy.clone().requires_grad_()
    (dx,) = torch.autograd.grad(gn.group_norm(xs, 2, w, b, 1e-5, True), xs, dys, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()


@pytest.mark.slow
def test_torch_compile_fullgraph_traces_through():
    x, w, b, dy = make(1, 8, (2, 3, 3))
    fn = torch.compile(lambda t: gn.group_norm(t, 2, w, b, 1e-5, True) * 2.0, fullgraph=True,
                       backend="aot_eager")
    xs = x.clone().requires_grad_()
    y = fn(xs)
    (dx,) = torch.autograd.grad(y, xs, dy)
    assert rel_err(y, 2.0 * ref.group_norm_relu(x, 2, w, b, 1e-5, True)) < 1e-5
    assert rel_err(dx, 2.0 * ref.group_norm_relu_grads(x, 2, w, b, 1e-5, True, dy)[0]) < 1e-5


# --- GPU: real shapes ------------------------------------------------------------------------------

def _site(C, edge, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((1, C, edge, edge, edge), generator=g, device="cuda").to(torch.bfloat16)
    x = x.contiguous(memory_format=CL)
    w = (1.0 + 0.1 * torch.randn(C, generator=g, device="cuda")).requires_grad_()
    b = (0.1 * torch.randn(C, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn(x.shape, generator=g, device="cuda").contiguous(memory_format=CL)
    return x, w, b, dy


def _run_triton(x, w, b, dy):
    xs = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = gn.group_norm(xs, 8, w, b, 1e-5, True)
    grads = torch.autograd.grad(y, (xs, w, b), dy)
    return (y,) + grads


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.gpu
@pytest.mark.parametrize("C,edge", [(64, 128), (512, 16), (1024, 8)])
def test_gpu_real_shapes_match_fp32_and_repeat_bitwise(C, edge):
    x, w, b, dy = _site(C, edge)
    got = _run_triton(x, w, b, dy)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    xf = x.float().requires_grad_()
    y_ref = F.relu(F.group_norm(xf, 8, w, b, 1e-5))
    expect = (y_ref,) + torch.autograd.grad(y_ref, (xf, w, b), dy)
    for name, out, e, bound in zip(("y", "dx", "dw", "db"), got, expect, (1e-5, 1e-2, 1e-4, 1e-5)):
        err = ((out.double() - e.double()).norm() / e.double().norm()).item()
        assert err < bound, (name, err)
    again = _run_triton(x, w, b, dy)
    assert all(torch.equal(p, q) for p, q in zip(got, again))


_CHILD = """
import torch, sys
sys.path.insert(0, {root!r})
from tests.test_kernel_groupnorm import _site, _run_triton, _digest
print(_digest(_run_triton(*_site(128, 64, seed=3))))
"""


@pytest.mark.gpu
def test_gpu_bitwise_across_processes():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = _digest(_run_triton(*_site(128, 64, seed=3)))
    out = subprocess.run([sys.executable, "-c", _CHILD.format(root=root)], capture_output=True,
                         text=True, check=True, cwd=root)
    assert out.stdout.strip().splitlines()[-1] == here
