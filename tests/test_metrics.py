"""Validation metrics: hard Dice from argmax and the per-sample loss."""
import pytest
import torch
import torch.nn.functional as F

from scaffold.loss import SegmentationLoss
from scaffold.metrics import hard_dice, per_sample_loss


def _one_hot_logits(pred, c):
    return F.one_hot(pred, c).permute(0, 4, 1, 2, 3).float()


def test_hard_dice_counts():
    labels = torch.zeros(2, 2, 2, 2, dtype=torch.long)
    labels[0, 0] = 1           # sample 0: 4 voxels of class 1
    pred = labels.clone()
    pred[0, 0, 0, 0] = 0       # one of them missed
    pred[0, 1, 1, 1] = 2       # class 2 predicted once, absent from the target
    labels[1, 1] = 2           # sample 1: class 2 predicted perfectly
    pred[1] = labels[1]
    d = hard_dice(_one_hot_logits(pred, 4), labels.to(torch.uint8), 4)
    assert d.dtype == torch.float32 and d.shape == (2,)
    # sample 0: class 1 = 2·3/(3+4), class 2 = 0 (predicted, absent), class 3 = 1 (absent in both)
    assert d[0].item() == pytest.approx((6 / 7 + 0 + 1) / 3)
    assert d[1].item() == 1.0


def test_hard_dice_uses_argmax_first_on_ties():
    logits = torch.zeros(1, 3, 2, 2, 2)  # all tied: argmax is class 0 (background) everywhere
    labels = torch.zeros(1, 2, 2, 2, dtype=torch.long)
    assert hard_dice(logits, labels, 3).item() == 1.0
    labels[0, 0, 0, 0] = 2
    assert hard_dice(logits, labels, 3).item() == pytest.approx(0.5)  # class 2 missed, class 1 absent


def test_per_sample_loss_is_each_sample_on_its_own():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 4, 4, 4, generator=g)
    labels = torch.randint(0, 4, (3, 4, 4, 4), generator=g)
    head = SegmentationLoss.from_counts([50, 10, 20, 30])
    per = per_sample_loss(head, logits, labels)
    assert per.shape == (3,)
    for i in range(3):
        alone = head(logits[i:i + 1], labels[i:i + 1])
        torch.testing.assert_close(per[i], alone, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(per[0], per[1])  # the samples really differ
