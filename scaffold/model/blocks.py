"""The U-Net's building blocks, made of ladder modules.

DoubleConv = (3×3×3 conv, padding 1, no bias → GroupNorm → ReLU) × 2; the ReLU is fused into the
GroupNorm module (`relu=True`), so the parameters and state-dict keys (`conv1`, `norm1`, `conv2`,
`norm2`) are exactly those of the same block built from nn.Conv3d, nn.GroupNorm and nn.ReLU.
Down = 2×2×2 max pool (deterministic backward) + DoubleConv doubling the width.
With `recompute` set, a DoubleConv keeps only its input for the backward and runs its forward again
there (torch.utils.checkpoint, non-reentrant): the same kernels on the same input, so the same bits,
for a fraction of the activation memory.
Up = 2×2×2 transposed conv halving the width + concat [skip, up] + DoubleConv halving the width.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from scaffold.model.ladder import (FastConcat, FastConv3d, FastConvTranspose3d, FastGroupNorm,
                                   FastMaxPool2)


class DoubleConv(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int):
        super().__init__()
        self.recompute = False
        self.conv1 = FastConv3d(in_channels, out_channels, 3, padding=1, bias=False)
        # Every consumer of these norms computes in the autocast dtype: see FastGroupNorm.autocast_output.
        self.norm1 = FastGroupNorm(groups, out_channels, relu=True, autocast_output=True)
        self.conv2 = FastConv3d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = FastGroupNorm(groups, out_channels, relu=True, autocast_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

            # No random op in the block, so no RNG state to stash (stashing reads the CUDA generator,
            # which a CUDA-graph capture forbids). The recompute runs the whole block rather than
            # stopping once the tensors it needs exist: the early stop trips an internal assertion in
            # the captured step.
            with set_checkpoint_early_stop(False):
                return checkpoint(self._forward, x, use_reentrant=False, preserve_rng_state=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.conv2(self.norm1(self.conv1(x))))


class Down(nn.Module):
    def __init__(self, in_channels: int, groups: int):
        super().__init__()
        self.pool = FastMaxPool2()
        self.conv = DoubleConv(in_channels, 2 * in_channels, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(x))


class Up(nn.Module):
    def __init__(self, in_channels: int, groups: int):
        super().__init__()
        half = in_channels // 2
        self.up = FastConvTranspose3d(in_channels, half, kernel_size=2, stride=2, bias=True)
        self.concat = FastConcat()
        self.conv = DoubleConv(in_channels, half, groups)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(self.concat(skip, self.up(x)))
