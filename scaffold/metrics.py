"""Validation metrics as device tensors (no host reads: the trainer reads them once per epoch)."""
from __future__ import annotations

import math

import torch

from scaffold.loss import SegmentationLoss, check_shapes


def hard_dice(logits: torch.Tensor, labels: torch.Tensor, n_classes: int, shards=None) -> torch.Tensor:
    """Per-sample (N,) mean over the foreground classes of the Dice of argmax(logits) against the
    labels; a class absent from both prediction and target scores 1. Counts are exact integers;
    with `shards` (a scaffold.spatial.ShardGroup) they are summed over the volume's slabs first."""
    return hard_dice_classes(logits, labels, n_classes, shards).mean(1).float()


def hard_dice_classes(logits: torch.Tensor, labels: torch.Tensor, n_classes: int, shards=None) -> torch.Tensor:
    """(N, n_classes - 1) float64: each foreground class's Dice of argmax(logits) against the labels
    (1 where the class is absent from both); `hard_dice` is its mean over the classes. A sample whose
    logits hold a NaN or an infinity scores NaN: argmax picks a class of its own accord there, and a
    diverged model scored a made-up Dice (0.5 or 0.0, by the classes present)."""
    check_shapes(logits, labels, n_classes)
    bad = (~torch.isfinite(logits)).flatten(1).sum(1)  # (N,) the sample's non-finite logits
    classes = torch.arange(1, n_classes, device=labels.device).view(1, -1, 1, 1, 1)
    pred = logits.argmax(1).unsqueeze(1) == classes
    target = labels.long().unsqueeze(1) == classes
    dims = (2, 3, 4)
    inter = (pred & target).sum(dims)
    total = pred.sum(dims) + target.sum(dims)
    if shards is not None:
        from scaffold.spatial import all_sum

        both = all_sum(torch.stack([inter, total, bad.unsqueeze(1).expand_as(inter)]), shards)
        inter, total, bad = both[0], both[1], both[2][:, 0]
    dice = (2 * inter).double() / total.clamp(min=1).double()
    dice = torch.where(total > 0, dice, torch.ones_like(dice))
    return torch.where(bad.unsqueeze(1) > 0, torch.full_like(dice, math.nan), dice)


def per_sample_loss(loss: "SegmentationLoss", logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N,) the loss of each sample on its own (its own CE normaliser and Dice)."""
    return loss.per_sample(logits, labels)
