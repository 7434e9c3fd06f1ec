"""The U-Net's building blocks, made of ladder modules.

DoubleConv = (3×3×3 conv, padding 1, no bias → GroupNorm → ReLU) × 2; the ReLU is fused into the
GroupNorm module (`relu=True`), so the parameters and state-dict keys (`conv1`, `norm1`, `conv2`,
`norm2`) are exactly those of the same block built from nn.Conv3d, nn.GroupNorm and nn.ReLU.
Down = 2×2×2 max pool (deterministic backward) + DoubleConv doubling the width.
With recompute set (UNet3d.set_recompute), a DoubleConv (or a whole Up level) keeps only its inputs for
the backward and runs its forward again there (torch.utils.checkpoint, non-reentrant): the same kernels
on the same inputs under the same autocast state, so the same bits, for a fraction of the memory.
Up = 2×2×2 transposed conv halving the width + concat [skip, up] + DoubleConv halving the width.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from scaffold.model.ladder import (FastConcat, FastConv3d, FastConvTranspose3d, FastGroupNorm,
                                   FastMaxPool2)


def recomputed(fn, *args: torch.Tensor) -> torch.Tensor:
    """fn(*args) whose saved tensors are recomputed in the backward instead of kept.

    No random op runs in these blocks, so no RNG state is stashed (stashing reads the CUDA generator,
    which a CUDA-graph capture forbids). The recompute runs the whole segment rather than stopping
    once the tensors it needs exist: the early stop raises from inside the last op that saves a
    tensor, which trips an assertion in the captured step (and a ladder site would take it for a
    failed kernel); every segment here ends with a GroupNorm, which saves, so it would save nothing."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


# DoubleConv.recompute values: keep everything, recompute the block as one, or each conv + norm alone
# (the full-resolution decoder block: recomputed whole it would hold its four full-size inner tensors at
# once at the top of the backward, the step's peak; see scaffold.model.memory).
KEEP, BLOCK, CONVS = "", "block", "convs"


class DoubleConv(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int):
        super().__init__()
        self.recompute = KEEP  # a plain attribute: outside the state dict
        self.conv1 = FastConv3d(in_channels, out_channels, 3, padding=1, bias=False)
        # Every consumer of these norms computes in the autocast dtype: see FastGroupNorm.autocast_output.
        self.norm1 = FastGroupNorm(groups, out_channels, relu=True, autocast_output=True)
        self.conv2 = FastConv3d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = FastGroupNorm(groups, out_channels, relu=True, autocast_output=True)

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm1(self.conv1(x))

    def _second(self, h: torch.Tensor, room: int = 0, head=None) -> torch.Tensor:
        h = self.conv2(h)
        if head is not None:
            return self.norm2.with_head(h, head)
        # (only a FastGroupNorm takes `room`: scaffold.spatial swaps in norms that do not)
        return self.norm2(h, room=room) if room else self.norm2(h)

    def _both(self, x: torch.Tensor, room: int = 0, head=None) -> torch.Tensor:
        return self._second(self._first(x), room, head)

    def forward(self, x: torch.Tensor, room: int = 0, head=None) -> torch.Tensor:
        """`room`: channels of room the output leaves after it for the concat that reads it as a skip
        (FastGroupNorm); `head`: a 1×1×1 conv site applied to the output, fused with the last norm where
        it can be (FastGroupNorm.with_head): the block then returns head(output), recomputed or not."""
        if self.recompute == KEEP or not torch.is_grad_enabled():  # evaluation saves nothing anyway
            return self._both(x, room, head)
        # (a recomputed block leaves no room: its segment owns its tensors)
        if self.recompute == BLOCK:
            return recomputed(functools.partial(self._both, head=head), x)
        return recomputed(functools.partial(self._second, head=head), recomputed(self._first, x))


class Down(nn.Module):
    def __init__(self, in_channels: int, groups: int):
        super().__init__()
        self.pool = FastMaxPool2()
        self.conv = DoubleConv(in_channels, 2 * in_channels, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(x))

    def with_skip(self, x: torch.Tensor, room: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x as the skip connection reads it, the block's output): the same values and gradients as
        (x, self(x)), with x's two gradients summed in the pool's backward (FastMaxPool2, skip=True).
        `room`: as DoubleConv's, for the output."""
        y, skip = self.pool(x, skip=True)
        return skip, self.conv(y, room)


class Up(nn.Module):
    def __init__(self, in_channels: int, groups: int):
        super().__init__()
        half = in_channels // 2
        self.up = FastConvTranspose3d(in_channels, half, kernel_size=2, stride=2, bias=True)
        self.concat = FastConcat()
        self.conv = DoubleConv(in_channels, half, groups)
        # Recompute the whole level (transposed conv, concat, DoubleConv): it then keeps its two inputs
        # instead of the concat, which is as large as both.
        self.recompute = False

    def _level(self, x: torch.Tensor, skip: torch.Tensor, into_room: bool = False, head=None) -> torch.Tensor:
        # With the skip made with room for the upsampled half, the transposed conv may write into it
        # (a Triton forward does), and the concat then copies nothing.
        if not into_room:
            cat = self.concat(skip, self.up(x))
        else:
            cat = self.concat(skip, self.up(x, out=self._room(x, skip)), into_room=True)
        return self.conv(cat) if head is None else self.conv(cat, head=head)

    def _room(self, x: torch.Tensor, skip: torch.Tensor):
        """The room after the skip's channels, when it has exactly the transposed conv's output: its
        channels, its dtype (the autocast dtype, else x's), and the skip's voxels."""
        from scaffold.kernels.lib.layout import room_base  # torch only: no Triton needed

        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        base = room_base(skip, self.up.out_channels, dtype)
        return None if base is None else base[:, skip.shape[1]:]

    def forward(self, x: torch.Tensor, skip: torch.Tensor, into_room: bool = False, head=None) -> torch.Tensor:
        """`into_room`: the skip was made with room for this level's upsampled half (FastConcat);
        `head`: as DoubleConv's (the level then returns head(output))."""
        if self.recompute and torch.is_grad_enabled():
            return recomputed(functools.partial(self._level, head=head), x, skip)
        return self._level(x, skip, into_room, head)
