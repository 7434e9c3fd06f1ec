"""The last GroupNorm + ReLU fused with the 1×1×1 head (scaffold.kernels.norm_head, FastGroupNorm.with_head):
the separate ops' values and gradients up to the order of two sums, the same error against fp32 as the
separate ops in bf16, bitwise run to run, used by the U-Net only where its rungs allow, and the separate
ops when the fused kernels fail. On CUDA these run on the GPU, elsewhere in Triton's interpreter."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from scaffold.kernels import norm_head as NH

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CL = torch.channels_last_3d


def _inputs(N=2, C=6, K=3, seed=0, affine=True, head_bias=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, 4, 6, 4, generator=g).to(DEV, dtype).contiguous(memory_format=CL)
    w = (torch.rand(C, generator=g) + 0.5).to(DEV) if affine else None
    b = (torch.randn(C, generator=g) * 0.3).to(DEV) if affine else None
    hw = torch.randn(K, C, 1, 1, 1, generator=g).to(DEV, dtype)
    hb = torch.randn(K, generator=g).to(DEV, dtype) if head_bias else None
    leaves = [t.requires_grad_() for t in (x, w, b, hw, hb) if t is not None]
    return (x, w, b, hw, hb), leaves


def _reference(x, w, b, hw, hb, groups):
    return F.conv3d(F.relu(F.group_norm(x, groups, w, b, 1e-5)), hw, hb)


@pytest.mark.parametrize("affine,head_bias", [(True, True), (False, False), (True, False)])
def test_fp32_values_and_gradients_match_the_separate_ops(affine, head_bias):
    (x, w, b, hw, hb), leaves = _inputs(affine=affine, head_bias=head_bias)
    out = NH.norm_head(x, 3, w, b, 1e-5, hw, hb, torch.float32)
    ref = _reference(x, w, b, hw, hb, 3)
    assert out.shape == ref.shape and out.is_contiguous(memory_format=CL)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9)).to(DEV)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, leaves, g)
    for a, r in zip(got, want):
        assert a.shape == r.shape and a.dtype == r.dtype
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


def test_head_weight_gradient_keeps_the_weight_strides():
    """A channels-last 1×1×1 head weight (strides (C, 1, C, C, C), as Module.to(channels_last_3d) makes
    it) gets its gradient in those strides, size-1 dims included: DDP compares them with its bucket's
    and warns on any difference. A contiguous weight keeps contiguous strides."""
    for layout in (CL, torch.contiguous_format):
        (x, w, b, hw, hb), _ = _inputs()
        hw = torch.nn.Conv3d(6, 3, 1).to(DEV).to(memory_format=layout).weight
        with torch.no_grad():
            hw.copy_(torch.randn(hw.shape, generator=torch.Generator().manual_seed(5)))
        out = NH.norm_head(x, 3, w, b, 1e-5, hw, hb, torch.float32)
        (g,) = torch.autograd.grad(out.sum(), hw)
        assert g.stride() == hw.stride(), (layout, g.stride(), hw.stride())
        ref = _reference(x, w, b, hw, hb, 3)
        torch.testing.assert_close(g, torch.autograd.grad(ref.sum(), hw)[0], rtol=1e-4, atol=1e-4)


def test_every_gradient_of_a_channels_last_unet_keeps_its_parameter_strides():
    """The U-Net in channels-last (as on CUDA) with its fused head: after a backward every parameter's
    gradient has exactly the parameter's strides, which DDP needs to copy it into its bucket as is."""
    model = _unet().to(memory_format=CL)
    x = torch.randn(1, 3, 8, 8, 8, generator=torch.Generator().manual_seed(6)).to(DEV)
    _step(model, x)
    wrong = [(n, p.stride(), p.grad.stride()) for n, p in model.named_parameters()
             if p.grad.stride() != p.stride()]
    assert not wrong


def test_bf16_is_as_close_to_fp32_as_the_separate_ops_and_bitwise_run_to_run():
    (x, w, b, hw, hb), _ = _inputs(C=8, K=6, seed=3)
    x16, hw16, hb16 = (t.detach().bfloat16().requires_grad_() for t in (x, hw, hb))
    g = torch.randn(2, 6, 4, 6, 4, generator=torch.Generator().manual_seed(4)).to(DEV)
    truth = _reference(x, w, b, hw, hb, 2)
    (dx_true,) = torch.autograd.grad(truth, x, g)

    def fused():
        out = NH.norm_head(x16, 2, w, b, 1e-5, hw16, hb16, torch.bfloat16)
        return (out, *torch.autograd.grad(out, (x16, w, b, hw16, hb16), g.bfloat16()))

    one, two = fused(), fused()
    assert all(torch.equal(a, c) for a, c in zip(one, two))
    # the separate ops in bf16, as autocast runs them: y stored in bf16, the conv in bf16
    y = F.relu(F.group_norm(x16.float(), 2, w, b, 1e-5)).bfloat16()
    sep = F.conv3d(y.float(), hw16.float(), hb16.float()).bfloat16()
    (dx_sep,) = torch.autograd.grad(sep, x16, g.bfloat16())
    err = lambda a, r: ((a.float() - r).norm() / r.norm()).item()  # noqa: E731
    assert err(one[0], truth) <= 1.5 * err(sep, truth) + 1e-3
    assert err(one[1], dx_true) <= 1.5 * err(dx_sep, dx_true) + 1e-3


def test_unsupported_calls_are_refused_in_one_line():
    (x, w, b, hw, hb), _ = _inputs()
    assert not NH.norm_head_supported(x, 3, w, b, torch.randn(3, 6, 3, 3, 3, device=DEV), hb)  # not 1x1x1
    assert not NH.norm_head_supported(x, 3, w, b, torch.randn(17, 6, 1, 1, 1, device=DEV), None)  # classes
    with pytest.raises(ValueError, match="norm_head: unsupported call"):
        NH.norm_head(x, 3, w, b, 1e-5, torch.randn(3, 6, 3, 3, 3, device=DEV), hb, torch.float32)


def _unet(head_setting="triton"):
    from scaffold import determinism
    from scaffold.config import LadderConfig
    from scaffold.model.ladder import set_ladder
    from scaffold.model.unet import UNet3d

    determinism.configure("default")
    torch.manual_seed(0)
    model = UNet3d(3, bottleneck=1, base_width=4, groups=2, n_classes=3).to_device(DEV)
    set_ladder(model, LadderConfig(pool="triton", group_norm="triton", concat="triton"))
    model.outc.ladder_setting = head_setting
    assert model.fuse_head  # on by default
    return model


def _step(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.float().square().sum().backward()
    return y.detach().clone(), [p.grad.clone() for p in model.parameters()]


def test_the_unet_fuses_its_head_with_the_same_values_as_apart(monkeypatch):
    model = _unet()
    x = torch.randn(2, 3, 8, 8, 8, generator=torch.Generator().manual_seed(5)).to(DEV)
    calls, head_calls = [], []
    real = NH.norm_head
    monkeypatch.setattr(NH, "norm_head", lambda *a: calls.append(1) or real(*a))
    model.outc.register_forward_hook(lambda *_: head_calls.append(1))
    fused = _step(model, x)
    again = _step(model, x)
    assert len(calls) == 2 and head_calls == []  # fused both times; the head's own forward never ran
    assert torch.equal(fused[0], again[0]) and all(torch.equal(a, b) for a, b in zip(fused[1], again[1]))
    assert "triton" in model.outc.rungs_ran and "triton" in model.ups[-1].conv.norm2.rungs_ran
    model.fuse_head = False
    apart = _step(model, x)
    assert len(calls) == 2 and head_calls == [1]
    torch.testing.assert_close(fused[0], apart[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(fused[1], apart[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_no_fusion_when_turned_off_or_where_a_rung_says_vendor(monkeypatch):
    calls = []
    real = NH.norm_head
    monkeypatch.setattr(NH, "norm_head", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 3, 8, 8, 8, generator=torch.Generator().manual_seed(5)).to(DEV)
    model = _unet()
    model.fuse_head = False
    _step(model, x)
    model = _unet(head_setting="vendor")  # the head forced to vendor
    _step(model, x)
    model = _unet()
    model.ups[-1].conv.norm2.ladder_setting = "vendor"  # the norm forced to vendor
    _step(model, x)
    assert calls == []


@pytest.mark.parametrize("level_whole", [False, True], ids=["convs", "whole-level"])
def test_a_recomputed_last_level_recomputes_the_fused_op_with_the_same_bits(monkeypatch, level_whole):
    """model.recompute=blocks gives the bits of the kept model (its guarantee), the head fused in both:
    the full-resolution block recomputes one conv + norm at a time (the fused op in the second
    segment), or, forced here, the whole level as one segment."""
    calls = []
    real = NH.norm_head
    monkeypatch.setattr(NH, "norm_head", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 3, 8, 8, 8, generator=torch.Generator().manual_seed(5)).to(DEV)
    kept = _step(_unet(), x)
    model = _unet()
    model.set_recompute("blocks")
    if level_whole:
        model.ups[-1].recompute = True
        model.ups[-1].conv.recompute = ""
    assert model.ups[-1].conv.recompute == ("" if level_whole else "convs")
    again = _step(model, x)
    assert len(calls) == 3  # kept once; recomputed: its forward and the backward's recompute
    assert torch.equal(kept[0], again[0])
    assert all(torch.equal(a, b) for a, b in zip(kept[1], again[1]))
    with torch.no_grad():  # evaluation fuses too
        model(x)
    assert len(calls) == 4


def test_a_failing_fused_kernel_falls_back_to_the_separate_ops_for_good(monkeypatch):
    model = _unet()
    x = torch.randn(1, 3, 8, 8, 8, generator=torch.Generator().manual_seed(5)).to(DEV)
    model.fuse_head = False
    apart = _step(model, x)
    model.fuse_head = True

    def broken(*a):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(NH, "norm_head", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _step(model, x)
        again = _step(model, x)
    assert sum("fused kernels failed" in str(w.message) for w in caught) == 1
    assert model.ups[-1].conv.norm2.head_fallback.startswith("RuntimeError: compile failed")
    assert torch.equal(out[0], apart[0]) and torch.equal(again[0], apart[0])
    assert all(torch.equal(a, b) for a, b in zip(out[1], apart[1]))


def test_the_census_shows_the_fused_head_and_its_fallback(monkeypatch):
    """The fused GroupNorm + head is an implementation choice like a rung: the census lists the site
    that ran it, and a fused pair that failed and fell back is a named fallback, not invisible."""
    from scaffold.model.ladder import census, format_census

    model = _unet()
    x = torch.randn(1, 3, 8, 8, 8, generator=torch.Generator().manual_seed(5)).to(DEV)
    _step(model, x)
    c = census(model)
    assert c["fused_head"] == ["ups.1.conv.norm2"] and c["fallbacks"] == []
    assert "fused head      ups.1.conv.norm2" in format_census(c)

    def broken(*a):
        raise RuntimeError("compile failed")

    model = _unet()
    monkeypatch.setattr(NH, "norm_head", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(model, x)
    c = census(model)
    assert c["fused_head"] == [] and c["fallbacks"] == ["ups.1.conv.norm2 (group_norm + head)"]
    assert c["fallback_errors"]["ups.1.conv.norm2 (group_norm + head)"].startswith("RuntimeError: compile failed")
