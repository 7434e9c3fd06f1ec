"""UNet3d: the 3D U-Net of the benchmark, sized by `scale`, built from ladder modules.

Levels L = scale − bottleneck: a stem DoubleConv (in → w), L Down blocks doubling the width, L Up blocks
halving it again, and a 1×1×1 head (w → classes). At scale 7 with the defaults that is 19 Conv3d,
4 ConvTranspose3d, 18 GroupNorms and 90,302,342 parameters. On CUDA the model runs channels-last
(NDHWC): `to_device` converts it, and forward gives the input the layout of the stem's weight.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from scaffold.model.grid import check_model
from scaffold.model.blocks import BLOCK, CONVS, KEEP, DoubleConv, Down, Up
from scaffold.model.ladder import FastConv3d, set_ladder


RECOMPUTE = ("off", "blocks")


class UNet3d(nn.Module):
    def __init__(self, scale: int, bottleneck: int = 3, base_width: int = 64, groups: int = 8,
                 in_channels: int = 3, n_classes: int = 6, ladder: Optional[Any] = None,
                 skip_rooms: bool = True, fuse_head: bool = True):
        super().__init__()
        widths = check_model(scale, bottleneck, base_width, groups)
        if in_channels < 1 or n_classes < 2:
            raise ValueError(f"UNet3d: expected in_channels >= 1 and n_classes >= 2 (background + one "
                             f"class), got {in_channels} and {n_classes}")
        self.scale, self.levels, self.n_classes = scale, len(widths) - 1, n_classes
        self.inc = DoubleConv(in_channels, base_width, groups)
        self.downs = nn.ModuleList(Down(w, groups) for w in widths[:-1])
        self.ups = nn.ModuleList(Up(w, groups) for w in reversed(widths[1:]))
        self.outc = FastConv3d(base_width, n_classes, 1, bias=True)
        set_ladder(self, ladder)
        self.recompute = "off"
        # Skips written with room for the decoder's half of their concat (_skip_rooms): the same values,
        # half the concat's copying. A plain attribute, outside the state dict (the run's plan decides it).
        self.skip_rooms = skip_rooms
        # The last GroupNorm + ReLU and the head fused (_fuse_head; the order of two sums differs from the
        # separate ops'): on the H200 its kernels take ~0.7 ms of the scale-7 step where the separate ops
        # take ~1.2, and the tail keeps no normalized tensor (0.25 GiB less at scale 7). A plain
        # attribute, outside the state dict (the run's plan decides it; bench.minibatch's +separatehead
        # turns it off).
        self.fuse_head = fuse_head
        # Activations in channels-last (NDHWC): set by to_device on CUDA. Read by forward, not from the
        # weights' layout alone: sharded parameters (scaffold.fsdp) keep torch's default layout.
        self.channels_last = False

    def set_recompute(self, mode) -> "UNet3d":
        """`off` or `blocks` (True/False too); the same bits either way. `blocks`: the stem's and each
        Down's DoubleConv recomputed as one; each Up below full resolution as a whole level (it then keeps
        its input and skip rather than their concat); the full-resolution Up's DoubleConv one conv + norm
        at a time (its transposed conv and concat kept). That layout has the lowest peak of those
        scaffold.model.memory compares (at scale 9: 130 GiB, against 152 with every DoubleConv whole
        and 237 without recompute)."""
        mode = {True: "blocks", False: "off"}.get(mode, mode)
        if mode not in RECOMPUTE:
            raise ValueError(f"recompute={mode!r}: expected one of {', '.join(RECOMPUTE)}")
        on = mode == "blocks"
        self.inc.recompute = BLOCK if on else KEEP
        for down in self.downs:
            down.conv.recompute = BLOCK if on else KEEP
        for up in self.ups[:-1]:
            up.recompute = on
        self.ups[-1].conv.recompute = CONVS if on else KEEP
        self.recompute = mode
        return self

    @classmethod
    def from_config(cls, cfg: Any, n_classes: int, plan: Any = None) -> "UNet3d":
        """From a scaffold.config.Config (or any object with the same attributes): its shape and ladder
        keys, and the run's decisions from `plan` (a scaffold.plan.RunPlan: recompute, skip rooms, the
        fused head). Without a plan, `model.recompute` as set (`auto` counts as off: deciding it is the
        plan's job, from the device's memory)."""
        m = cfg.model
        if plan is None:
            recompute, rooms, fuse = {"auto": "off"}.get(m.recompute, m.recompute), True, True
        else:
            recompute, rooms, fuse = plan.recompute, plan.skip_rooms, plan.fuse_head
        model = cls(cfg.scale, m.bottleneck, m.base_width, m.groups, 3, n_classes, cfg.ladder,
                    skip_rooms=rooms, fuse_head=fuse)
        return model.set_recompute(recompute)

    def to_device(self, device: torch.device | str) -> "UNet3d":
        """Moves the model; on CUDA also to channels-last (NDHWC), the layout our kernels want."""
        device = torch.device(device)
        self.to(device)
        if device.type == "cuda":
            self.to(memory_format=torch.channels_last_3d)
            self.channels_last = True
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        edge = 2**self.levels
        shards = getattr(self, "shards", None)  # a D-slab of a spatially split volume (scaffold.spatial)
        whole = x.shape[2:] if shards is None else (x.shape[2] * shards.count, *x.shape[3:])
        if x.dim() != 5 or any(s % edge for s in whole):
            raise ValueError(f"UNet3d input: expected (N, C, D, H, W) with D, H, W multiples of {edge}, "
                             f"got {tuple(x.shape)}")
        if self.channels_last or self.inc.conv1.weight.is_contiguous(memory_format=torch.channels_last_3d):
            x = x.contiguous(memory_format=torch.channels_last_3d)
        rooms = self._skip_rooms(shards)
        skips = []
        x = self.inc(x, rooms[0])
        for level, down in enumerate(self.downs, 1):
            if shards is None:  # x's two gradients (skip and pool) summed in the pool's backward
                skip, x = down.with_skip(x, rooms[level])
            else:  # a sharded Down block moves its input first (scaffold.spatial): the skip keeps x
                skip, x = x, down(x)
            skips.append(skip)
        head = self.outc if self._fuse_head(shards) else None
        for level, up in zip(reversed(range(self.levels)), self.ups):
            if level == 0 and head is not None:  # the last norm and the 1x1x1 head, fused where they can be
                return up(x, skips.pop(), into_room=rooms[level] > 0, head=head)
            x = up(x, skips.pop(), into_room=rooms[level] > 0)
        return self.outc(x)

    def _fuse_head(self, shards) -> bool:
        """Whether the last GroupNorm + ReLU and the 1×1×1 head may run as one (FastGroupNorm.with_head,
        which still runs them apart where a rung says so): not under spatial shards, under torch.compile,
        or when `fuse_head` is off. A recomputed last level recomputes the fused op (the same bits as
        kept)."""
        return self.fuse_head and shards is None and not torch.compiler.is_compiling()

    def _skip_rooms(self, shards) -> list[int]:
        """Per level (0 = the stem), the channels of room its skip leaves for the decoder's upsampled
        half, so that the skip concat copies only that half (scaffold.kernels.concat, into_room): a
        skip's width at every level but the bottom, which is no skip. None where a block recomputes
        (its segments own their tensors; without autograd nothing recomputes), under spatial shards (the
        skip is moved), under torch.compile (the registered ops leave no room) or when `skip_rooms` is
        off."""
        off = (not self.skip_rooms or (self.recompute != "off" and torch.is_grad_enabled())
               or shards is not None or torch.compiler.is_compiling())
        widths = [self.inc.conv2.out_channels] + [d.conv.conv2.out_channels for d in self.downs]
        return [0 if off or level == self.levels else w for level, w in enumerate(widths)]
