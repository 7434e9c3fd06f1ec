"""The sharded modules: a U-Net's 3×3×3 convolutions and GroupNorms on split levels turned into their
block forms (halo'd convolutions, slab GroupNorms) by `shard_model`, in place, with the same parameters
and state-dict keys; the census lists them (`sharded`)."""
from __future__ import annotations

import warnings
from functools import partial
from typing import Optional

import torch

from scaffold.model.grid import Grid, level_grids
from scaffold.model import policy
from scaffold.model.ladder import VENDOR, FastConv3d, FastGroupNorm, LadderWarning
from scaffold.model.policy import GroupNormCall
from scaffold.spatial.collectives import (_fixed_order_sum, _gather, _layout, gather_depth, halo, halo_rows,
                                          halo_planes_overlapped, redistribute)
from scaffold.spatial.mesh import ShardGroup

class HaloConv3d(FastConv3d):
    """A 3×3×3 FastConv3d (padding 1) over a block, unpadded along the split dims, which gives exactly
    the block's output (the neighbours' planes and rows stand in for the padding: zeros at the
    volume's faces). Where H is split, the rows' halo first. Then, on blocks of at least 3 planes
    (`overlap`), the D halo is in flight while the block's interior output planes are computed from
    the block itself; its first and last output planes follow, each from the 3 planes around it, and
    the three parts are joined (one copy of the output). The backward overlaps the same way, and no
    halo'd copy of the block is made in either direction. Thinner blocks (or `overlap` False): the D
    halo first, then one conv over the halo'd block. Same parameters and state-dict keys."""

    shards: ShardGroup
    grid: Optional[Grid] = None
    overlap = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.grid is not None and self.grid.ph > 1
        padding = (0, 0 if rows else self.padding[1], self.padding[2])
        if not self.overlap or x.shape[2] < 3:
            return self.padded(halo(x, self.shards, self.grid), padding)
        x = halo_rows(x, self.shards, self.grid)
        inner, lo, hi = halo_planes_overlapped(x, self.shards, self.grid, lambda b: self.padded(b, padding))
        y = torch.cat([self.padded(lo, padding), inner, self.padded(hi, padding)], 2)
        return y.contiguous(memory_format=_layout(inner))


class _SlabGroupNorm(torch.autograd.Function):
    """GroupNorm (+ ReLU) of a D-slab with the statistics of the whole volume: per (sample, group), the
    slab's sums added over the shard group in rank order (mean first, then squared deviations: two
    passes, as stable as the one-device norm), fp32 throughout. Saves only its input and the (mean,
    rstd) pairs, like the one-device rungs, and recomputes the normalized values in the backward, whose
    two group sums are added over the shard group the same way."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, eps: float, relu: bool, out_dtype, sg: ShardGroup):
        n, c = x.shape[:2]
        v = x.float().reshape(n, groups, -1)
        count = v.shape[2] * sg.count
        mean = _fixed_order_sum(v.sum(2), sg) / count
        dev = v - mean.unsqueeze(2)
        var = _fixed_order_sum((dev * dev).sum(2), sg) / count
        rstd = torch.rsqrt(var + eps)
        shape = (1, c) + (1,) * (x.dim() - 2)
        y = (dev * rstd.unsqueeze(2)).reshape(x.shape) * weight.float().view(shape) + bias.float().view(shape)
        if relu:
            y = y.clamp_min_(0)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.groups, ctx.relu, ctx.sg, ctx.count = groups, relu, sg, count
        return y.to(out_dtype).contiguous(memory_format=_layout(x))

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        n, c = x.shape[:2]
        g = ctx.groups
        shape = (1, c) + (1,) * (x.dim() - 2)
        xhat = ((x.float().reshape(n, g, -1) - mean.unsqueeze(2)) * rstd.unsqueeze(2)).reshape(x.shape)
        gy = grad.float()
        if ctx.relu:  # the ReLU's mask from the recomputed output
            gy = torch.where(xhat * weight.float().view(shape) + bias.float().view(shape) > 0, gy, 0.0)
        dims = [0] + list(range(2, x.dim()))
        grad_weight = (gy * xhat).sum(dims).to(weight.dtype)
        grad_bias = gy.sum(dims).to(bias.dtype)
        dxhat = (gy * weight.float().view(shape)).reshape(n, g, -1)
        xh = xhat.reshape(n, g, -1)
        sums = _fixed_order_sum(torch.stack([dxhat.sum(2), (dxhat * xh).sum(2)]), ctx.sg)
        dx = (dxhat - sums[0].unsqueeze(2) / ctx.count - xh * (sums[1].unsqueeze(2) / ctx.count)) * rstd.unsqueeze(2)
        return (dx.reshape(x.shape).to(x.dtype).contiguous(memory_format=_layout(x)), grad_weight, grad_bias,
                None, None, None, None, None)


class _TritonSlabGroupNorm(torch.autograd.Function):
    """GroupNorm (+ ReLU) of a block on the Triton rung's kernels (scaffold.kernels.groupnorm) with the
    whole volume's statistics: each rank's per-split partials (mean and M2 forward; the sums of g and
    g·x̂ backward) are gathered in rank order and merged in one fixed order, the same on every rank;
    the weight and bias gradients are the block's own part, as on the other rung."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, eps: float, relu: bool, out_dtype, sg: ShardGroup):
        from scaffold.kernels import groupnorm

        gather = partial(_join_partials, sg=sg)
        y, mean, rstd = groupnorm.forward(x, groups, weight, bias, eps, relu, out_dtype, gather=gather)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.groups, ctx.relu, ctx.gather = groups, relu, gather
        return y

    @staticmethod
    def backward(ctx, grad):
        from scaffold.kernels import groupnorm

        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = groupnorm.backward(grad, x, weight, bias, mean, rstd, ctx.groups, ctx.relu,
                                        gather=ctx.gather)
        return dx, dw, db, None, None, None, None, None


def _join_partials(a: torch.Tensor, b: torch.Tensor, sg: ShardGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's [N, splits, C] partials a and b, joined along the splits in rank order."""
    parts = _gather(torch.stack([a, b]), sg)
    both = torch.cat(parts, dim=2)
    return both[0].contiguous(), both[1].contiguous()


class ShardedGroupNorm(FastGroupNorm):
    """GroupNorm (+ ReLU) over a block with the whole volume's statistics, on the site's rung: Triton
    (_TritonSlabGroupNorm) where the ladder picks it for this call, else torch's fp32 ops
    (_SlabGroupNorm); a Triton failure sends the site to torch's ops for good, as on one device. The
    output dtype follows FastGroupNorm's rule under autocast. Same parameters and state-dict keys."""

    shards: ShardGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        out_dtype = x.dtype
        if torch.is_autocast_enabled(kind):
            out_dtype = torch.get_autocast_dtype(kind) if self.autocast_output else torch.float32
        args = (x, self.weight, self.bias, self.num_groups, self.eps, self.relu, out_dtype, self.shards)
        call = GroupNormCall(x, self.num_groups, self.weight, self.bias, self.eps, self.relu, out_dtype, 0)
        if not self.vendor_only and policy.select_rung(self.op, self.ladder_setting, call) == policy.TRITON:
            try:
                out = _TritonSlabGroupNorm.apply(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - every rank fails alike (same shapes, same kernels)
                self.vendor_only = True
                self.fallback_error = f"triton: {type(exc).__name__}: {exc}".splitlines()[0]
                warnings.warn(f"{self.ladder_name} (group_norm, sharded): rung 'triton' failed, using torch's "
                              f"ops from now on: {self.fallback_error}", LadderWarning, stacklevel=2)
            else:
                self.rungs_ran.add(policy.TRITON)
                return out
        self.rungs_ran.add(VENDOR)  # torch's ops, for the census
        return _SlabGroupNorm.apply(*args)


def shard_model(model: torch.nn.Module, sg: Optional[ShardGroup]) -> torch.nn.Module:
    """Turns the U-Net's 3×3×3 convolutions and GroupNorms at split levels into their block forms, in
    place (same parameters and state-dict keys). Where a level is split differently from the one above
    (D slabs, then D x H blocks), the Down block's input and the Up block's transposed convolution output move to
    the other split (`redistribute`); where the split ends, the Down block's input is gathered whole
    (then everything below runs whole on every rank) and the Up block's transposed convolution output
    is cut back to the block."""
    if sg is None or sg.count == 1:
        return model
    grids = level_grids(model.scale, model.levels, sg.count)

    def convert(block: torch.nn.Module, grid: Grid) -> None:
        for m in block.modules():
            if type(m) is FastConv3d and m.kernel_size == (3, 3, 3):
                m.__class__, m.shards, m.grid = HaloConv3d, sg, grid
            elif type(m) is FastGroupNorm:
                m.__class__, m.shards = ShardedGroupNorm, sg

    convert(model.inc, grids[0])
    for i, down in enumerate(model.downs):  # down i produces level i + 1 from level i
        above, below = grids[i], grids[i + 1]
        if below is not None:
            convert(down, below)
            if below != above:
                down.register_forward_pre_hook(
                    lambda module, args, a=above, b=below: (redistribute(args[0], sg, a, b),))
        elif above is not None:
            down.register_forward_pre_hook(lambda module, args, a=above: (gather_depth(args[0], sg, a),))
    for j, up in enumerate(model.ups):  # up j produces level L - 1 - j from level L - j
        level = model.levels - 1 - j
        here, below = grids[level], grids[level + 1]
        if here is not None:
            convert(up.conv, here)
            if below is None:
                up.up.register_forward_hook(lambda module, args, y, g=here: _own_block(y, sg, g))
            elif below != here:
                up.up.register_forward_hook(
                    lambda module, args, y, a=below, b=here: redistribute(y, sg, a, b))
    model.shards = sg
    return model


def _own_block(y: torch.Tensor, sg: ShardGroup, grid: Grid) -> torch.Tensor:
    d0, d1, h0, h1 = grid.box(sg.index, y.shape[2])
    return y[:, :, d0:d1, h0:h1].contiguous(memory_format=_layout(y))
