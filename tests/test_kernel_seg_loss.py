"""The fused CE + soft Dice Triton kernels against the float64 loss head and the eager SegmentationLoss.

CPU: the Triton interpreter at tiny, odd shapes (several splits, ragged last tiles). GPU (`gpu` marker):
128³ bf16 channels-last logits against the eager head, bitwise-stable over 100 calls, no host syncs.
"""
import pytest
import torch

from scaffold.kernels import reference as ref
from scaffold.kernels import seg_loss as sl
from scaffold.loss import EPS, SegmentationLoss

CL = torch.channels_last_3d


def rel_err(out, expect):
    """‖out − ref‖ / ‖ref‖ in float64."""
    return ((ref.f64(out) - expect).norm() / expect.norm()).item()


def make(N=2, C=6, spatial=(5, 3, 7), dtype=torch.float32, layout="cl", label_dtype=torch.int64,
         absent=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn((N, C) + spatial, generator=g)).to(dtype)
    z = z.contiguous(memory_format=CL) if layout == "cl" else z.contiguous()
    y = torch.randint(0, C, (N,) + spatial, generator=g)
    for k in absent:
        y[y == k] = 0
    w = 0.5 + 2 * torch.rand(C, generator=g)  # non-uniform class weights
    return z, y.to(label_dtype), w


def run(z, y, w, grads=None, block_v=None, tile=None):
    """(loss, ce, dice, dlogits) from the kernels; grads = (g_loss, g_ce, g_dice) seeds the backward."""
    x = z.clone().requires_grad_()
    loss, ce, dice = sl.seg_loss_terms(x, y, w, EPS, block_v=block_v, tile=tile)
    # Seeds made on the logits' device: a host-to-device copy would be a sync.
    g_loss, g_ce, g_dice = grads or (z.new_ones((), dtype=torch.float32),
                                     z.new_zeros((), dtype=torch.float32),
                                     z.new_zeros(z.shape[0], dtype=torch.float32))
    (dz,) = torch.autograd.grad([loss, ce, dice], [x], [g_loss, g_ce, g_dice])
    return loss, ce, dice, dz


T = sl.LossTile  # the tile overrides below
CASES = [  # C, dtype, layout, label dtype, absent classes, voxel tile override
    (6, torch.float32, "cl", torch.int64, (), None),
    (6, torch.float32, "ncdhw", torch.uint8, (2,), 4),          # 4-voxel tiles: several splits, ragged
    (3, torch.float32, "cl", torch.uint8, (1,), 8),
    (3, torch.float32, "ncdhw", torch.int64, (1, 2), None),    # background only: every Dice is 1
    (6, torch.bfloat16, "cl", torch.uint8, (4,), 4),
    (6, torch.bfloat16, "ncdhw", torch.int64, (), None),
    (5, torch.float16, "cl", torch.int64, (3,), 16),
]


@pytest.mark.parametrize("form", sl.FORMS)
@pytest.mark.parametrize("C,dtype,layout,label_dtype,absent,block_v", CASES)
def test_matches_float64_head(C, dtype, layout, label_dtype, absent, block_v, form):
    z, y, w = make(C=C, dtype=dtype, layout=layout, label_dtype=label_dtype, absent=absent)
    loss, ce, dice, dz = run(z, y, w, tile=T(block_v or 16, 1, 4, form))
    e_loss, e_ce, e_dice, e_dz = ref.seg_loss_terms(z, y, w, EPS, grads=(1.0, 0.0, torch.zeros(2)))
    # The forward reads the stored values exactly (a bf16 upcast is exact), so it is fp32-accurate for
    # every dtype; the gradient is rounded to the logits' dtype.
    for name, out, e in (("loss", loss, e_loss), ("ce", ce, e_ce), ("dice", dice, e_dice)):
        assert out.dtype == torch.float32 and out.shape == e.shape, name
        assert rel_err(out, e) < 1e-5, (name, out, e)
    if absent == (1, 2):
        assert torch.equal(dice, torch.ones(2))
    assert dz.dtype == dtype and dz.shape == z.shape
    assert dz.is_contiguous(memory_format=CL if layout == "cl" else torch.contiguous_format)
    assert rel_err(dz, e_dz) < (1e-5 if dtype == torch.float32 else 1e-2), rel_err(dz, e_dz)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gradient_is_the_fp32_one_rounded(dtype):
    # Same stored values, so the same fp32 gradient before the store; the store rounds to nearest even.
    z, y, w = make(C=6, dtype=dtype, absent=(2,), seed=6)
    loss, _, _, dz = run(z, y, w, block_v=8)
    loss32, _, _, dz32 = run(z.float(), y, w, block_v=8)
    assert torch.equal(loss, loss32)
    assert torch.equal(dz, dz32.to(dtype))


def test_gradient_of_every_output():
    # ce and each sample's dice may carry their own gradients (e.g. when logged terms are reused).
    z, y, w = make(C=4, absent=(2,), seed=3)
    grads = (torch.tensor(0.7), torch.tensor(-1.3), torch.tensor([0.4, -2.0]))
    *_, dz = run(z, y, w, grads=grads, block_v=8)
    *_, e_dz = ref.seg_loss_terms(z, y, w, EPS, grads=grads)
    assert rel_err(dz, e_dz) < 1e-5


def test_unused_outputs_pass_no_gradient():
    # Only ce is differentiated: loss and dice get None (nothing materialised); the result must be the
    # gradient of ce alone.
    z, y, w = make(C=5, absent=(3,), seed=7)
    x = z.clone().requires_grad_()
    _, ce, _ = sl.seg_loss_terms(x, y, w, EPS, block_v=8)
    (dz,) = torch.autograd.grad(ce, x)
    *_, e_dz = ref.seg_loss_terms(z, y, w, EPS, grads=(0.0, 1.0, torch.zeros(2)))
    assert rel_err(dz, e_dz) < 1e-5


@pytest.mark.parametrize("form", sl.FORMS)
def test_many_splits_fixed_tree(form):
    # More split slots than the finalize program's block: its loop over slot blocks runs several times.
    z, y, w = make(N=2, C=6, spatial=(5, 6, 7), absent=(2,), seed=8)
    tile = T(4, 1, 64, form)
    plan = sl.Plan(2, 5 * 6 * 7, 6, z.device, tile=tile)
    assert plan.splits > plan.block_p
    loss, ce, dice, sums = sl.forward(z, y, w, EPS, tile=tile)
    dz = sl.backward(z, y, w, sums, EPS, torch.tensor(1.0), None, None, tile=tile)
    e_loss, e_ce, e_dice, e_dz = ref.seg_loss_terms(z, y, w, EPS, grads=(1.0, 0.0, torch.zeros(2)))
    for out, e in ((loss, e_loss), (ce, e_ce), (dice, e_dice), (dz, e_dz)):
        assert rel_err(out, e) < 1e-5


def test_forms_agree_and_ignore_out_of_range_labels():
    # The two forms compute the same sums in a different order; a label outside [0, C) adds nothing
    # to either (the datasets are checked once, so this only guards memory safety).
    z, y, w = make(C=6, dtype=torch.bfloat16, seed=9)
    y_bad = y.clone()
    y_bad.view(-1)[::7] = 200
    out = {form: run(z, y_bad, w, tile=T(8, 1, 4, form)) for form in sl.FORMS}
    for form in sl.FORMS[1:]:
        for a, b in zip(out["tile"], out[form]):
            assert rel_err(a.float(), ref.f64(b)) < 1e-5, form
    with pytest.raises(ValueError, match="tile form"):
        sl.Plan(1, 8, 6, z.device, tile=T(8, 1, 4, "columns"))


def test_unrolled_form_falls_back_past_eight_classes():
    # The unrolled forward spells out 8 accumulator sets; with more classes the plan takes the rows form.
    z, y, w = make(C=10, absent=(4,), seed=10)
    assert sl.Plan(2, 105, 10, z.device, tile=T(8, 1, 4, "unrolled")).form == "rows"
    assert sl.Plan(2, 105, 8, z.device, tile=T(8, 1, 4, "unrolled")).form == "unrolled"
    loss, ce, dice, dz = run(z, y, w, tile=T(8, 1, 4, "unrolled"))
    e_loss, e_ce, e_dice, e_dz = ref.seg_loss_terms(z, y, w, EPS, grads=(1.0, 0.0, torch.zeros(2)))
    for out, e in ((loss, e_loss), (dice, e_dice), (dz, e_dz)):
        assert rel_err(out, e) < 1e-5


def test_reference_is_the_eager_head():
    # The float64 reference is the function SegmentationLoss computes (there in fp32).
    z, y, w = make(C=6, absent=(5,), seed=1)
    x = z.clone().requires_grad_()
    loss, ce, dice = SegmentationLoss(w).terms(x, y)
    loss.backward()
    e_loss, e_ce, e_dice, e_dz = ref.seg_loss_terms(z, y, w, EPS, grads=(1.0, 0.0, torch.zeros(2)))
    for out, e in ((loss, e_loss), (ce, e_ce), (dice, e_dice), (x.grad, e_dz)):
        assert rel_err(out.detach(), e) < 1e-5


@pytest.mark.parametrize("form", sl.FORMS)
def test_deterministic_bitwise(form):
    z, y, w = make(C=6, dtype=torch.bfloat16, seed=2)
    first = run(z, y, w, tile=T(4, 1, 4, form))
    second = run(z, y, w, tile=T(4, 1, 4, form))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", sl.FORMS)
@pytest.mark.parametrize("layout", ["cl", "ncdhw"])
def test_poisoned_gradient_buffer_fully_written(layout, form):
    z, y, w = make(C=6, layout=layout, absent=(3,), seed=4)
    tile = T(4, 1, 4, form)
    *_, dz = run(z, y, w, tile=tile)
    sums = sl.forward(z, y, w, EPS, tile=tile)[3]
    poisoned = torch.full_like(z, float("nan"))
    out = sl.backward(z, y, w, sums, EPS, torch.tensor(1.0), torch.tensor(0.0), torch.zeros(2),
                      out=poisoned, tile=tile)
    assert out.data_ptr() == poisoned.data_ptr()
    assert torch.isfinite(out).all()
    assert torch.equal(out, dz)


def test_odd_layouts_are_copied_not_misread():
    # Spatial dims that do not collapse into one stride (a transposed view), and non-contiguous labels.
    z, y, w = make(C=4, spatial=(3, 4, 5), seed=5)
    zt, yt = z.transpose(3, 4), y.transpose(2, 3)
    loss, ce, dice, dz = run(zt, yt, w, block_v=4)
    e_loss, e_ce, e_dice, e_dz = ref.seg_loss_terms(zt, yt, w, EPS, grads=(1.0, 0.0, torch.zeros(2)))
    assert rel_err(loss, e_loss) < 1e-5 and rel_err(dice, e_dice) < 1e-5
    assert dz.shape == zt.shape and rel_err(dz, e_dz) < 1e-5


def test_supported_and_errors():
    z, y, w = make(C=3)
    assert sl.seg_loss_supported(z, y, w)
    assert not sl.seg_loss_supported(z.double(), y, w)
    assert not sl.seg_loss_supported(z, y.float(), w)
    assert not sl.seg_loss_supported(torch.zeros(1, 17, 2, 2, 2), torch.zeros(1, 2, 2, 2).long(),
                                     torch.ones(17))
    with pytest.raises(ValueError, match="do not match labels"):
        sl.seg_loss_terms(z, y[:, :-1], w, EPS)
    with pytest.raises(ValueError, match="weight must have shape"):
        sl.seg_loss_terms(z, y, w[:2], EPS)
    with pytest.raises(ValueError, match="labels must be an integer"):
        sl.seg_loss_terms(z, y.float(), w, EPS)
    with pytest.raises(ValueError, match="unsupported call"):
        sl.seg_loss_terms(z.double(), y, w, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, T(128, 4, 4, "rows"), T(512, 8, 16, "rows"),
                                  T(128, 4, 16, "unrolled"), T(32, 2, 16, "tile")])
def test_gpu_128_cubed_matches_eager_and_is_stable(tile):
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 6, 128, 128, 128)
    z = (3 * torch.randn(shape, generator=g, device="cuda")).to(torch.bfloat16)
    z = z.contiguous(memory_format=CL)
    y = torch.randint(0, 6, (1, 128, 128, 128), generator=g, device="cuda").to(torch.uint8)
    w = (0.5 + 2 * torch.rand(6, generator=g, device="cuda"))
    x = z.clone().requires_grad_()
    eager = SegmentationLoss(w.cpu()).cuda()
    e_loss, e_ce, e_dice = eager.terms(x, y)
    (e_dz,) = torch.autograd.grad(e_loss, x)
    torch.cuda.set_sync_debug_mode("error")  # the fused head never waits for the device
    try:
        loss, ce, dice, dz = run(z, y, w, tile=tile)
        values = torch.stack([sl.seg_loss_terms(z, y, w, EPS, tile=tile)[0] for _ in range(100)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out, e in ((loss, e_loss), (ce, e_ce), (dice, e_dice)):
        assert ((out.double() - e.double()).norm() / e.double().norm()).item() < 1e-3
    assert ((dz.double() - e_dz.double()).norm() / e_dz.double().norm()).item() < 1e-2
    assert dz.is_contiguous(memory_format=CL)
    assert torch.unique(values).numel() == 1 and torch.equal(values[0], loss.detach())
    assert torch.equal(run(z, y, w, tile=tile)[3], dz)
