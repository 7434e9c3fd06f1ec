"""The loss head: weighted cross-entropy + soft Dice, deterministic and free of host syncs.

Why it is written this way: `reduction="sum"`/`"mean"` in CUDA nll_loss / cross_entropy accumulate with
floating-point atomics, so the same inputs give different losses from call to call (5 distinct values
per 100 calls at 128³ on an H200). Here the per-voxel terms are those of `reduction="none"` and are
summed by torch's ordinary reductions, which combine in a fixed order. The CE normaliser Σ weight[target] is a
gather and a sum on the device: no bincount, no `.item()`, no host-built tensors, no boolean-mask
indexing, so nothing in the loss waits for the device.

  logp  = log_softmax(fp32(logits))                  (once; softmax = exp(logp))
  CE    = Σ_v w[y_v] · (−logp[y_v, v]) / Σ_v w[y_v]
  dice  = (2 Σ p·g + eps) / (Σ p + Σ g + eps)         per sample and foreground class (1..C−1), eps 1e-6
          and exactly 1 when the class is absent from the target (Σ g = 0): an absent class counts as
          perfect, whatever small mass the prediction puts on it (the CE term still pushes that down)
  loss  = CE + (1 − mean dice)

Class weights follow upstream ScaFFold: background total/background, every foreground class
total/foreground (one weight shared by all foreground classes), from the dataset's stored per-class
voxel counts, computed on the host once.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from scaffold.model.ladder import LadderSite
from scaffold.model.policy import VENDOR, LossCall

EPS = 1e-6


def class_weights(counts: Sequence[int] | np.ndarray) -> torch.Tensor:
    """CE weights (float32, one per class, index 0 background) from per-class voxel counts; all 1 when
    the background or the foreground count is 0 (a weight would be infinite)."""
    c = np.asarray(counts)
    if c.ndim != 1 or c.size < 2 or not np.issubdtype(c.dtype, np.integer) or (c < 0).any():
        raise ValueError(f"class counts: expected a 1-D array of >= 2 non-negative integers (index 0 "
                         f"background), got {c.dtype} array of shape {c.shape}")
    c = c.astype(np.int64)
    total, background, foreground = int(c.sum()), int(c[0]), int(c[1:].sum())
    if background == 0 or foreground == 0:
        return torch.ones(c.size, dtype=torch.float32)
    w = np.full(c.size, total / foreground, dtype=np.float64)
    w[0] = total / background
    return torch.from_numpy(w).to(torch.float32)


def sampled_counts(masks: np.ndarray, fraction: float, n_classes: int) -> np.ndarray:
    """Voxel counts per label over an evenly spaced `fraction` of the training masks, picked as
    upstream ScaFFold's code picks them (it estimates its CE weights from 10%): ceil(fraction * n)
    masks (at least one), at the positions of a float32 torch.linspace(0, n - 1) truncated to
    integers; every mask when that is all of them. fraction = 1 counts every mask."""
    n = masks.shape[0]
    k = min(max(math.ceil(n * float(fraction)), 1), n)
    picks = np.arange(n) if k == n else torch.linspace(0, n - 1, steps=k).long().numpy()
    return np.bincount(masks[picks].reshape(-1), minlength=n_classes).astype(np.int64)


def check_shapes(logits: torch.Tensor, labels: torch.Tensor, n_classes: int) -> None:
    """Logits (N, C, D, H, W) against labels (N, D, H, W); reads shapes only."""
    ok = (logits.dim() == 5 and labels.dim() == 4 and logits.shape[1] == n_classes
          and logits.shape[0] == labels.shape[0] and logits.shape[2:] == labels.shape[1:])
    if not ok:
        raise ValueError(f"loss: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}: "
                         f"expected (N, {n_classes}, D, H, W) and (N, D, H, W)")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"loss: labels must be an integer tensor (uint8 or int64), got {labels.dtype}")


def check_labels(labels: torch.Tensor, n_classes: int) -> None:
    """One-time range check of a whole dataset's labels (reads the device: never call it in a step)."""
    labels = torch.as_tensor(labels)
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels: expected an integer dtype, got {labels.dtype}")
    if labels.numel() == 0:
        return
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= n_classes:
        raise ValueError(f"labels: expected values in [0, {n_classes - 1}] ({n_classes} classes), "
                         f"found [{lo}, {hi}]")


class SegmentationLoss(LadderSite, nn.Module):
    """CE + (1 − soft Dice) with fixed class weights (a buffer, moved with the module).

    A ladder site of kind `loss` (`ladder.loss`): the `triton` rung is the fused kernel
    (scaffold/kernels/seg_loss.py: one pass forward, one backward, fixed-order sums), what `auto` runs
    on CUDA where it supports the call; `vendor` is the eager form below. Both are deterministic; they
    sum in different orders, so their bits differ."""

    op = "loss"

    def __init__(self, weights: torch.Tensor | Sequence[float], eps: float = EPS, rung: str = "auto"):
        super().__init__()
        self._init_site()
        self.ladder_setting = rung
        self.ladder_name = "loss"
        w = torch.as_tensor(weights, dtype=torch.float32).detach().clone()
        if w.dim() != 1 or w.numel() < 2 or not bool(torch.isfinite(w).all() and (w > 0).all()):
            raise ValueError(f"loss weights: expected >= 2 finite positive values, got {w.tolist()}")
        self.register_buffer("weight", w)
        self.eps = eps
        self.reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # see `split`

    @classmethod
    def from_counts(cls, counts: Sequence[int] | np.ndarray, eps: float = EPS) -> "SegmentationLoss":
        return cls(class_weights(counts), eps)

    @property
    def n_classes(self) -> int:
        return self.weight.numel()

    def _voxel_terms(self, logits: torch.Tensor, labels: torch.Tensor):
        """Per-voxel weighted NLL, per-voxel weights, foreground probabilities and one-hot target."""
        check_shapes(logits, labels, self.n_classes)
        y = labels.long()
        logp = torch.log_softmax(logits, dim=1, dtype=torch.float32)
        classes = torch.arange(self.n_classes, device=y.device).view(1, -1, 1, 1, 1)
        target = y.unsqueeze(1) == classes  # (N, C, D, H, W) one-hot, built by comparison on the device
        # The weighted NLL with reduction "none", picked by the one-hot rather than by F.nll_loss: same
        # value, but its backward is elementwise (nll_loss's CUDA backward is flagged nondeterministic
        # under strict mode) and it needs no contiguous copy of channels-last logits.
        wy = self.weight[y]
        nll = -wy * torch.where(target, logp, 0.0).sum(1)
        return nll, wy, logp[:, 1:].exp(), target[:, 1:]

    # The loss in three steps, written once: partial sums over the voxels this process holds, an
    # optional sum of those over the ranks that share a split volume (`reduce`, fixed rank order), then
    # the formulas. One process skips the middle step and sums exactly as the formulas' inputs need.

    def _dice_sums(self, p: torch.Tensor, target: torch.Tensor):
        """Per sample and foreground class: (intersection, prediction sum, target count)."""
        dims = (2, 3, 4)
        return (p * target).sum(dims), p.sum(dims), target.sum(dims)

    def _dice(self, inter: torch.Tensor, psum: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """Soft Dice per sample from its sums, averaged over the foreground classes (a class absent from
        the target scores 1): (N,)."""
        return self._dice_classes(inter, psum, present).mean(1)

    def _dice_classes(self, inter: torch.Tensor, psum: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """Soft Dice per sample and foreground class from its sums: (N, C - 1)."""
        dice = (2 * inter + self.eps) / (psum + present + self.eps)
        return torch.where(present > 0, dice, torch.ones_like(dice))

    def soft_dice_classes(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(N, C - 1) fp32: the soft Dice of each sample and foreground class, as the eager loss defines
        it (an absent class scores 1); its mean over the classes is the loss's Dice term."""
        return self._dice_classes(*self._sums(logits, labels, per_sample=True)[2:])

    def _sums(self, logits: torch.Tensor, labels: torch.Tensor, per_sample: bool):
        """(weighted NLL sum, its normaliser, Dice sums): over the batch, or per sample."""
        nll, wy, p, target = self._voxel_terms(logits, labels)
        if per_sample:
            nll, wy = nll.sum((1, 2, 3)), wy.sum((1, 2, 3))
        else:
            nll, wy = nll.sum(), wy.sum()
        sums = (nll, wy, *self._dice_sums(p, target))
        if self.reduce is None:
            return sums
        # A split volume: each rank's sums, added over its shard group in rank order in one collective.
        parts = [t.reshape(-1).to(torch.float32) for t in sums]
        total = torch.split(self.reduce(torch.cat(parts)), [t.numel() for t in parts])
        return tuple(t.view(s.shape) for t, s in zip(total, sums))

    def split(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> "SegmentationLoss":
        """This loss over a volume split across ranks: `reduce` sums a tensor of partial sums over the
        ranks that share the volume (scaffold.spatial.all_sum over the shard group). Runs the eager
        formulas (the fused kernel sees one rank's voxels only); shares the class weights and the
        census record with this loss."""
        other = copy.copy(self)
        other.reduce = reduce
        return other

    def terms(self, logits: torch.Tensor, labels: torch.Tensor):
        """(loss, ce, soft Dice per sample (N,)), all fp32 device tensors, on the rung the policy picks."""
        check_shapes(logits, labels, self.n_classes)
        if self.reduce is not None:
            self.rungs_ran.add(VENDOR)  # the eager formulas, for the census
            return self._eager(logits, labels)
        return self._run(LossCall(logits, labels, self.weight, self.eps), lambda: self._eager(logits, labels))

    def _eager(self, logits: torch.Tensor, labels: torch.Tensor):
        nll, wy, inter, psum, present = self._sums(logits, labels, per_sample=False)
        ce = (nll / wy).reshape(())
        dice = self._dice(inter, psum, present)
        return ce + (1 - dice.mean()), ce, dice

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.terms(logits, labels)[0]

    def per_sample(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of each sample on its own: (N,)."""
        nll, wy, inter, psum, present = self._sums(logits, labels, per_sample=True)
        return nll / wy + (1 - self._dice(inter, psum, present))
