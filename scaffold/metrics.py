"""Validation metrics as device tensors (no host reads: the trainer reads them once per epoch)."""
from __future__ import annotations

import torch

from scaffold.loss import SegmentationLoss, check_shapes


def hard_dice(logits: torch.Tensor, labels: torch.Tensor, n_classes: int, shards=None) -> torch.Tensor:
    """Per-sample (N,) mean over the foreground classes of the Dice of argmax(logits) against the
    labels; a class absent from both prediction and target scores 1. Counts are exact integers;
    with `shards` (a scaffold.spatial.ShardGroup) they are summed over the volume's slabs first."""
    return hard_dice_classes(logits, labels, n_classes, shards).mean(1).float()


def hard_dice_classes(logits: torch.Tensor, labels: torch.Tensor, n_classes: int, shards=None) -> torch.Tensor:
    """(N, n_classes - 1) float64: each foreground class's Dice of argmax(logits) against the labels
    (1 where the class is absent from both); `hard_dice` is its mean over the classes."""
    check_shapes(logits, labels, n_classes)
    classes = torch.arange(1, n_classes, device=labels.device).view(1, -1, 1, 1, 1)
    pred = logits.argmax(1).unsqueeze(1) == classes
    target = labels.long().unsqueeze(1) == classes
    dims = (2, 3, 4)
    inter = (pred & target).sum(dims)
    total = pred.sum(dims) + target.sum(dims)
    if shards is not None:
        from scaffold.spatial import all_sum

        both = all_sum(torch.stack([inter, total]), shards)
        inter, total = both[0], both[1]
    dice = (2 * inter).double() / total.clamp(min=1).double()
    return torch.where(total > 0, dice, torch.ones_like(dice))


def per_sample_loss(loss: "SegmentationLoss", logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N,) the loss of each sample on its own (its own CE normaliser and Dice)."""
    return loss.per_sample(logits, labels)
