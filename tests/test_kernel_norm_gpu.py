"""The GroupNorm(+ReLU) and skip-concat kernels at the model's own sites (GPU only): every output element
written, GroupNorm within bounds of F.group_norm in fp32 and bitwise equal across repeated calls, the
concat bitwise equal to torch.cat then the cast and its gradient split exactly."""
import pytest
import torch
import torch.nn.functional as F

from scaffold.bench.sites import distinct, model_sites

pytestmark = pytest.mark.gpu
CL = torch.channels_last_3d
NORMS = distinct(model_sites(7, ("group_norm",)))
CONCATS = distinct(model_sites(7, ("concat",)))


def _rel(out, expect) -> float:
    return ((out.double() - expect.double()).norm() / expect.double().norm()).item()


def _check_norm(C, edge, groups, dtype=torch.bfloat16, layout=CL):
    from scaffold.kernels import groupnorm as gn

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((1, C, edge, edge, edge), generator=g, device="cuda").to(dtype)
    x = x.contiguous(memory_format=layout)
    w = 1 + 0.1 * torch.randn(C, generator=g, device="cuda")
    b = 0.1 * torch.randn(C, generator=g, device="cuda")
    dy = torch.randn(x.shape, generator=g, device="cuda").contiguous(memory_format=CL)
    poisoned = torch.full(x.shape, float("nan"), device="cuda").contiguous(memory_format=layout)
    # fp32 out, as F.group_norm gives under CUDA autocast
    y, mean, rstd = gn.forward(x, groups, w, b, 1e-5, True, torch.float32, out=poisoned)
    got = (y,) + gn.backward(dy, x, w, b, mean, rstd, groups, True,
                             out=torch.full_like(x, float("nan")))
    assert not any(t.isnan().any().item() for t in got), "an output element was not written"
    xf, wf, bf = (t.float().requires_grad_() for t in (x, w, b))
    y_ref = F.relu(F.group_norm(xf, groups, wf, bf, 1e-5))
    expect = (y_ref,) + torch.autograd.grad(y_ref, (xf, wf, bf), dy)
    # dw, db: sums over every voxel, in another order than ATen's fp32 reference
    for name, out, e, bound in zip(("y", "dx", "dw", "db"), got, expect, (1e-5, 1e-2, 1e-4, 1e-4)):
        assert _rel(out, e) < bound, (name, _rel(out, e))
    y2, mean2, rstd2 = gn.forward(x, groups, w, b, 1e-5, True, torch.float32)
    again = (y2,) + gn.backward(dy, x, w, b, mean2, rstd2, groups, True)
    assert all(torch.equal(p, q) for p, q in zip(got, again)), "two calls differ"


@pytest.mark.parametrize("site", NORMS, ids=[f"{s.cin}@{s.edge}" for s in NORMS])
def test_group_norm_at_the_models_sites(site):
    _check_norm(site.cin, site.edge, site.groups)


@pytest.mark.parametrize("dtype,layout",
                         [(torch.bfloat16, torch.contiguous_format), (torch.float32, CL)],
                         ids=["ncdhw", "fp32"])
def test_group_norm_other_layout_and_dtype(dtype, layout):
    _check_norm(128, 64, 8, dtype, layout)


@pytest.mark.parametrize("site", CONCATS, ids=[f"{s.cin}@{s.edge}" for s in CONCATS])
def test_concat_at_the_models_sites(site):
    from scaffold.kernels import concat as cc

    g = torch.Generator(device="cuda").manual_seed(1)
    skip = torch.randn(site.inputs[0], generator=g, device="cuda").contiguous(memory_format=CL)
    up = torch.randn(site.inputs[1], generator=g, device="cuda").to(torch.bfloat16)
    up = up.contiguous(memory_format=CL)
    out = cc.concat_channels(skip, up, torch.bfloat16)
    assert torch.equal(out, torch.cat([skip, up], 1).to(torch.bfloat16))
    g_skip, g_up = cc.split_backward(out, site.cin, torch.float32, torch.bfloat16)
    assert torch.equal(g_skip, out[:, :site.cin].float()) and torch.equal(g_up, out[:, site.cin:])
