"""The loss head against an independent float64 implementation; weights; edge cases; no host syncs."""
import inspect
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scaffold import loss as loss_module
from scaffold import metrics
from scaffold.loss import SegmentationLoss, check_labels, class_weights
from scaffold.model import census


def reference_loss(logits, labels, weight, eps=1e-6):
    """CE + (1 − soft Dice) in float64, written out from the formula."""
    z = logits.double()
    n, c = z.shape[:2]
    logp = z - z.exp().sum(1, keepdim=True).log()
    p = logp.exp()
    g = torch.stack([(labels == k).double() for k in range(c)], 1)
    wv = weight.double()[labels.long()]
    ce = -(wv * (g * logp).sum(1)).sum() / wv.sum()
    dices = []
    for i in range(n):
        for k in range(1, c):
            inter, ps, gs = (p[i, k] * g[i, k]).sum(), p[i, k].sum(), g[i, k].sum()
            dices.append((2 * inter + eps) / (ps + gs + eps) if gs > 0 else torch.ones((), dtype=z.dtype))
    return ce + 1 - torch.stack(dices).mean()


def _inputs(seed, n=2, c=6, edge=8, absent=()):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, c, edge, edge, edge, generator=g)
    labels = torch.randint(0, c, (n, edge, edge, edge), generator=g)
    for k in absent:
        labels[labels == k] = 0
    return logits, labels


@pytest.mark.parametrize("seed, absent, label_dtype", [(0, (), torch.int64), (1, (2, 4), torch.uint8),
                                                       (2, (1,), torch.int64)])
def test_loss_and_gradient_match_float64_reference(seed, absent, label_dtype):
    logits, labels = _inputs(seed, absent=absent)
    counts = np.bincount(labels.flatten().numpy(), minlength=6)
    w = class_weights(counts)
    head = SegmentationLoss(w)
    x = logits.clone().requires_grad_()
    value = head(x, labels.to(label_dtype))
    assert value.dtype == torch.float32 and value.dim() == 0
    value.backward()
    xr = logits.double().requires_grad_()
    ref = reference_loss(xr, labels, w)
    ref.backward()
    assert abs(value.double() - ref).item() <= 1e-6 * abs(ref.item())
    rel = (x.grad.double() - xr.grad).norm() / xr.grad.norm()
    assert rel.item() <= 1e-6


def test_terms_split_and_bf16_logits_upcast():
    logits, labels = _inputs(3)
    head = SegmentationLoss(torch.ones(6))
    loss, ce, dice = head.terms(logits.bfloat16(), labels)
    assert loss.dtype == ce.dtype == dice.dtype == torch.float32 and dice.shape == (2,)
    torch.testing.assert_close(loss, ce + 1 - dice.mean())
    ref = reference_loss(logits.bfloat16().float(), labels, torch.ones(6))
    assert abs(loss.double() - ref).item() <= 1e-6 * abs(ref.item())
    torch.testing.assert_close(ce, F.cross_entropy(logits.bfloat16().float(), labels))


def test_dice_edge_cases():
    labels = torch.zeros(1, 4, 4, 4, dtype=torch.long)
    labels[0, :2] = 1
    labels[0, 2:, :2] = 3  # class 2 absent from the target
    perfect = F.one_hot(labels, 4).permute(0, 4, 1, 2, 3).float() * 60.0  # softmax ~ exactly one-hot
    head = SegmentationLoss(torch.ones(4))
    _, ce, dice = head.terms(perfect, labels)
    assert dice.item() == pytest.approx(1.0, abs=1e-6)
    assert ce.item() < 1e-6
    # an absent class counts exactly 1 even when the prediction puts mass on it
    wrong = torch.zeros(1, 4, 4, 4, 4)
    wrong[:, 2] = 5.0
    _, _, d = head.terms(wrong, torch.zeros(1, 4, 4, 4, dtype=torch.long))
    assert d.item() == 1.0


def test_class_weights_follow_upstream():
    w = class_weights(np.array([900, 50, 30, 20, 0, 0], dtype=np.int64))
    assert w.dtype == torch.float32 and w.shape == (6,)
    assert w[0].item() == pytest.approx(1000 / 900)
    assert torch.equal(w[1:], torch.full((5,), 1000 / 100, dtype=torch.float32))
    assert torch.equal(class_weights([0, 5, 5]), torch.ones(3))
    assert torch.equal(class_weights([7, 0, 0]), torch.ones(3))
    with pytest.raises(ValueError, match="class counts"):
        class_weights([1.5, 2.0])
    with pytest.raises(ValueError, match="class counts"):
        class_weights([3, -1])


def test_bad_inputs_are_named():
    head = SegmentationLoss.from_counts([10, 5, 5])
    with pytest.raises(ValueError, match=r"logits \(1, 3, 4, 4, 4\) do not match labels \(1, 4, 4, 2\)"):
        head(torch.zeros(1, 3, 4, 4, 4), torch.zeros(1, 4, 4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits \(1, 4, 4, 4, 4\)"):
        head(torch.zeros(1, 4, 4, 4, 4), torch.zeros(1, 4, 4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        head(torch.zeros(1, 3, 4, 4, 4), torch.zeros(1, 4, 4, 4))
    with pytest.raises(ValueError, match="loss weights"):
        SegmentationLoss([1.0, -1.0])
    check_labels(torch.tensor([0, 2, 1], dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match=r"labels: expected values in \[0, 2\].*found \[0, 3\]"):
        check_labels(torch.tensor([0, 3]), 3)


def test_weights_move_with_the_module():
    head = SegmentationLoss.from_counts([10, 5, 5])
    assert "weight" in dict(head.named_buffers())
    assert head.to(torch.float64).weight.dtype == torch.float64  # buffers follow .to()


STEP_PATH = [loss_module.check_shapes, loss_module.SegmentationLoss._voxel_terms,
             loss_module.SegmentationLoss._dice, loss_module.SegmentationLoss.terms,
             loss_module.SegmentationLoss.forward, loss_module.SegmentationLoss.per_sample,
             metrics.hard_dice, metrics.per_sample_loss]
# Host reads: methods that copy to the host, ops that sync, and Python conversions of a tensor.
HOST_READS = re.compile(r"\.(item|tolist|cpu|numpy)\(|bincount|nonzero|unique|new_tensor|torch\.tensor\("
                        r"|(?<![\w.])(bool|float|int)\(")


@pytest.mark.parametrize("fn", STEP_PATH, ids=lambda f: f.__qualname__)
def test_step_path_has_no_host_reads(fn):
    source = inspect.getsource(fn)
    assert HOST_READS.findall(source) == []


def test_host_read_pattern_catches_what_it_should():
    assert HOST_READS.search("x = loss.item()") and HOST_READS.search("if bool(t > 0):")
    assert HOST_READS.search("n = int(t.sum())") and not HOST_READS.search("y = t.float()")


# --- on the GPU ---------------------------------------------------------------------------------

def _distinct(values):
    return torch.stack(values).unique().numel()


@pytest.mark.gpu
def test_loss_is_bitwise_repeatable_where_reduction_sum_is_not():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(1, 6, 128, 128, 128, device="cuda", generator=g).bfloat16()
    labels = torch.randint(0, 6, (1, 128, 128, 128), device="cuda", generator=g)
    counts = np.bincount(labels.flatten().cpu().numpy(), minlength=6)
    head = SegmentationLoss.from_counts(counts).cuda()
    ours = [head(logits, labels) for _ in range(100)]
    logp = torch.log_softmax(logits.float(), 1)
    control = [F.nll_loss(logp, labels, weight=head.weight, reduction="sum") for _ in range(100)]
    assert _distinct(ours) == 1
    assert _distinct(control) > 1


def _small_step():
    from scaffold.model import UNet3d

    torch.manual_seed(0)
    model = UNet3d(6, base_width=8, groups=4).to_device("cuda")
    x = torch.randn(1, 3, 64, 64, 64, device="cuda")
    labels = torch.randint(0, 6, (1, 64, 64, 64), device="cuda")
    head = SegmentationLoss.from_counts([1000, 100, 100, 100, 100, 100]).cuda()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = head(logits, labels)
        loss.backward()
        return loss

    return step


@pytest.mark.gpu
def test_unet_step_does_not_sync_the_host():
    step = _small_step()
    step()  # first call: lazy imports and kernel compilation happen outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_unet_step_runs_under_strict_determinism(monkeypatch):
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    step = _small_step()
    torch.use_deterministic_algorithms(True)
    try:
        a = step()
        b = step()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.isfinite(a).item() and torch.isfinite(b).item()


def test_triton_rung_of_the_loss_matches_the_eager_form():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 6, 3, 5, 4, generator=g, requires_grad=True)
    labels = torch.randint(0, 6, (2, 3, 5, 4), generator=g)
    weights = torch.tensor([0.5, 2.0, 2.0, 2.0, 2.0, 2.0])
    fused, eager = SegmentationLoss(weights, rung="triton"), SegmentationLoss(weights, rung="vendor")
    out_f = fused.terms(logits, labels)
    (gf,) = torch.autograd.grad(out_f[0], logits)
    out_e = eager.terms(logits, labels)
    (ge,) = torch.autograd.grad(out_e[0], logits)
    for a, b in zip(out_f, out_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gf, ge, rtol=1e-5, atol=1e-7)
    auto = SegmentationLoss(weights)
    auto.terms(logits, labels)
    # The loss head is a ladder site in the census: auto on the CPU runs the eager form.
    assert census(fused)["loss"] == {"triton": 1} and census(eager)["loss"] == {"vendor": 1}
    assert census(auto)["loss"] == {"vendor": 1} and census(auto)["modules"] == {"loss": "vendor"}
