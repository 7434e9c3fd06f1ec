"""Spatial (domain) parallelism: each volume's depth D split over a group of ranks.

With `parallel.spatial_shards = S` the world is a 2-D mesh, data-parallel × spatial (torch's
DeviceMesh; consecutive ranks share a volume). Rank i of a shard group holds planes
[i·D/S, (i+1)·D/S) of every volume of its data-parallel rank: its slab of the masks, of the input and of
every activation; the parameters are whole on every rank. What crosses slab boundaries:

- a 3×3×3 convolution (padding 1) needs one plane of each neighbour: `halo` sends this rank's first
  and last planes to its neighbours and receives theirs (batched isend/irecv of device tensors over
  the shard group: NCCL on GPUs, gloo on the CPU); zeros at the volume's faces, which is the
  convolution's own zero padding. The convolution then runs unchanged, on whatever ladder rung it
  picks (Triton or vendor), over the D + 2 planes, and the two planes it computes beyond the slab are
  dropped. The backward sends the halo planes' gradients back to their owners, which add them to
  their boundary planes;
- GroupNorm's statistics, the loss's sums and the validation counts: each rank sums its slab, and
  `all_sum` adds the ranks' partial sums **in rank order** (an all-gather, then a fixed-order sum), so
  a run at a fixed S is bitwise reproducible; its backward is the same fixed-order sum of the
  gradients, the exact adjoint of a sum over ranks;
- nothing else: the 2×2×2 pool, the transposed convolution (kernel = stride = 2), the skip concat and
  the 1×1×1 head are local while every slab has an even number of planes at the pooled level;
- where the depth runs out (a level with fewer planes than ranks: S > 2^model.bottleneck), the Down
  block gathers its input whole on every rank of the group, the levels below run whole and
  identically on each, and the Up block cuts its transposed convolution's output back to the slab.
  Those levels hold 1/8 of the voxels per level; the gather's backward is a fixed-order ring
  reduce-scatter (one slab in flight). At the largest shard counts the whole levels set a floor on
  a rank's memory (docs/parallel.md gives the numbers); splitting H there is not built.

Gradients: every rank of a shard group computes the same loss (from the reduced sums) and back-
propagates it, so the sum of the group's parameter gradients is S times the loss's gradient; DDP's
average over the whole world (data-parallel × spatial) therefore gives the data-parallel mean of the
per-volume gradients, as without sharding. Parameters, their checkpoints and the optimizer are the
unsharded ones: a run can resume at another shard count (not bitwise: the sums are split differently).

Why a thin layer of our own over torch.distributed rather than DTensor/ShardTensor: the ladder's
convolutions are custom autograd functions over raw tensors, and the only collectives this network
needs are a one-plane exchange and a fixed-order sum of a few statistics; wrapping every activation
in a distributed tensor type would route each ladder kernel through a sharding-propagation layer
that knows nothing of it, for no communication a plain isend/irecv does not already do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from scaffold.model.ladder import VENDOR, FastConv3d, FastGroupNorm


@dataclass(eq=False)
class ShardGroup:
    """This rank's place in its shard group: `ranks` are the group's global ranks in slab order."""

    group: Any  # a torch.distributed ProcessGroup
    ranks: tuple[int, ...]
    index: int

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def prev(self) -> Optional[int]:
        return self.ranks[self.index - 1] if self.index > 0 else None

    @property
    def next(self) -> Optional[int]:
        return self.ranks[self.index + 1] if self.index + 1 < self.count else None

    @property
    def leader(self) -> bool:
        """Whether this rank reports the group's (replicated) values in a world-wide sum."""
        return self.index == 0

    def slab(self, depth: int) -> tuple[int, int]:
        """[start, stop) of this rank's planes of a volume `depth` planes deep."""
        per = depth // self.count
        return self.index * per, (self.index + 1) * per

    def __deepcopy__(self, memo) -> "ShardGroup":  # a model copy (the warm-up's) shares the group
        return self


@dataclass(frozen=True)
class Mesh:
    """The world as data-parallel × spatial ranks."""

    shards: Optional[ShardGroup]  # None when volumes are not split
    data_rank: int
    data_world: int


def make_mesh(rank: int, world: int, spatial: int, device_type: str, timeout_s: Optional[float] = None) -> Mesh:
    """The 2-D mesh of a job of `world` ranks with `spatial` ranks per volume (every rank calls it). Its
    groups wait at most `timeout_s` in a collective, like the job's default group (parallel.timeout_s):
    a halo exchange with a rank that hangs fails within that bound."""
    if spatial <= 1:
        return Mesh(None, rank, world)
    if world % spatial:
        from scaffold.config import ConfigError

        raise ConfigError(f"parallel.spatial_shards={spatial}: expected a divisor of the world size "
                          f"({world} ranks)")
    import datetime

    from torch.distributed.device_mesh import DeviceMesh

    data = world // spatial
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    # Every rank creates every group, in the same order: one per volume (consecutive ranks), one per
    # slab position (the data-parallel peers).
    spatial_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(d * spatial, (d + 1) * spatial)) for d in range(data)], timeout=timeout)
    data_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, world, spatial)) for i in range(spatial)], timeout=timeout)
    mesh = DeviceMesh.from_group([data_group, spatial_group], device_type,
                                 mesh=torch.arange(world).view(data, spatial), mesh_dim_names=("data", "spatial"))
    group = mesh.get_group("spatial")
    ranks = tuple(dist.get_process_group_ranks(group))
    return Mesh(ShardGroup(group, ranks, ranks.index(rank)), rank // spatial, data)


# --------------------------------------------------------------------------------------- collectives

def _gather(t: torch.Tensor, sg: ShardGroup) -> list[torch.Tensor]:
    """Every rank's `t`, in rank order."""
    parts = [torch.empty_like(t) for _ in range(sg.count)]
    dist.all_gather(parts, t.contiguous(), group=sg.group)
    return parts


def _fixed_order_sum(t: torch.Tensor, sg: ShardGroup) -> torch.Tensor:
    parts = _gather(t, sg)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


class _AllSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, sg: ShardGroup) -> torch.Tensor:
        ctx.sg = sg
        return _fixed_order_sum(t, sg)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _fixed_order_sum(grad, ctx.sg), None


def all_sum(t: torch.Tensor, sg: Optional[ShardGroup]) -> torch.Tensor:
    """Σ over the shard group of `t`, added in rank order (bitwise the same on every rank and run);
    differentiable. The identity without a group."""
    if sg is None or sg.count == 1:
        return t
    return _AllSum.apply(t, sg)


def _exchange(first: torch.Tensor, last: torch.Tensor, sg: ShardGroup
              ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Sends `first` to the previous rank and `last` to the next; returns (what the previous rank sent
    as its `last`, what the next rank sent as its `first`), None at the volume's faces."""
    ops, from_prev, from_next = [], None, None
    if sg.prev is not None:
        from_prev = torch.empty_like(last)
        ops += [dist.P2POp(dist.isend, first, sg.prev, sg.group), dist.P2POp(dist.irecv, from_prev, sg.prev, sg.group)]
    if sg.next is not None:
        from_next = torch.empty_like(first)
        ops += [dist.P2POp(dist.isend, last, sg.next, sg.group), dist.P2POp(dist.irecv, from_next, sg.next, sg.group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return from_prev, from_next


def _layout(x: torch.Tensor) -> torch.memory_format:
    cl = x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
    return torch.channels_last_3d if cl else torch.contiguous_format


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sg: ShardGroup) -> torch.Tensor:
        ctx.sg = sg
        n, c, d, h, w = x.shape
        lo, hi = _exchange(x[:, :, :1].contiguous(), x[:, :, -1:].contiguous(), sg)
        out = torch.empty((n, c, d + 2, h, w), dtype=x.dtype, device=x.device, memory_format=_layout(x))
        out[:, :, 1:-1] = x
        out[:, :, :1] = 0 if lo is None else lo
        out[:, :, -1:] = 0 if hi is None else hi
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sg = ctx.sg
        to_prev, to_next = grad[:, :, :1].contiguous(), grad[:, :, -1:].contiguous()
        from_prev, from_next = _exchange(to_prev, to_next, sg)
        gx = grad[:, :, 1:-1].clone(memory_format=_layout(grad))
        if from_prev is not None:  # the previous rank's upper halo is my first plane
            gx[:, :, :1] += from_prev
        if from_next is not None:
            gx[:, :, -1:] += from_next
        return gx, None


def halo(x: torch.Tensor, sg: ShardGroup) -> torch.Tensor:
    """(N, C, d, H, W) slab -> (N, C, d + 2, H, W): the neighbours' adjacent planes around it (zeros at
    the volume's faces); differentiable."""
    return _Halo.apply(x, sg)


# ------------------------------------------------------------------------------------ sharded modules

class HaloConv3d(FastConv3d):
    """A 3×3×3 FastConv3d (padding 1) over a D-slab: halo, the same convolution on D + 2 planes, the
    slab's planes of its output. Same parameters and state-dict keys."""

    shards: ShardGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(halo(x, self.shards))
        return y[:, :, 1:-1].contiguous(memory_format=_layout(y))


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


class ShardedGroupNorm(FastGroupNorm):
    """GroupNorm (+ ReLU) over a D-slab with the whole volume's statistics (see _SlabGroupNorm); the
    output dtype follows FastGroupNorm's rule under autocast. Same parameters and state-dict keys."""

    shards: ShardGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rungs_ran.add(VENDOR)  # torch's ops, for the census
        kind = x.device.type
        out_dtype = x.dtype
        if torch.is_autocast_enabled(kind):
            out_dtype = torch.get_autocast_dtype(kind) if self.autocast_output else torch.float32
        return _SlabGroupNorm.apply(x, self.weight, self.bias, self.num_groups, self.eps, self.relu, out_dtype,
                                    self.shards)


def _ring_sum_slab(t: torch.Tensor, sg: ShardGroup, depth: int) -> torch.Tensor:
    """This rank's D-slab (`depth` planes) of Σ over the shard group of `t` (a whole volume, the same
    shape on every rank): a ring of S − 1 steps in which each rank passes one slab's partial sum to the
    next and adds its own planes to the one it receives (a reduce-scatter). Slab j is summed in the
    fixed order of ranks j+1, j+2, …, j (mod S), so the result is bitwise the same on every run at a
    fixed S; one slab is in flight per rank, where gathering every rank's whole would hold S of them."""
    n, r = sg.count, sg.index
    nxt, prv = sg.ranks[(r + 1) % n], sg.ranks[(r - 1) % n]
    fmt = _layout(t)

    def piece(j: int) -> torch.Tensor:
        return t[:, :, j * depth:(j + 1) * depth]

    acc = piece((r - 1) % n).contiguous()  # slab r − 1's sum starts here (sent in the default layout)
    for step in range(n - 1):
        got = torch.empty_like(acc)
        ops = [dist.P2POp(dist.isend, acc, nxt, sg.group), dist.P2POp(dist.irecv, got, prv, sg.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        acc = (got + piece((r - 2 - step) % n)).contiguous()  # the slab received, summed over ranks j+1 … r
    return acc.contiguous(memory_format=fmt)


class _Gather(torch.autograd.Function):
    """The shard group's slabs joined along D (every rank holds the whole); the backward sums the ranks'
    gradients of the whole and keeps this rank's slab (the adjoint), as a fixed-order ring
    reduce-scatter (`_ring_sum_slab`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sg: ShardGroup) -> torch.Tensor:
        ctx.sg, ctx.depth = sg, x.shape[2]
        return torch.cat(_gather(x, sg), 2).contiguous(memory_format=_layout(x))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ring_sum_slab(grad, ctx.sg, ctx.depth), None


def gather_depth(x: torch.Tensor, sg: ShardGroup) -> torch.Tensor:
    return _Gather.apply(x, sg)


def sharded_levels(scale: int, levels: int, count: int) -> list[bool]:
    """Per U-Net level (0 = full resolution), whether its tensors are split: while every slab keeps at
    least one plane (2^(scale - level) >= count). Deeper levels, which hold 1/8 of the voxels per
    level, run whole on every rank of the group (scaffold.model.memory counts them so)."""
    return [2 ** (scale - level) >= count for level in range(levels + 1)]


def shard_model(model: torch.nn.Module, sg: Optional[ShardGroup]) -> torch.nn.Module:
    """Turns the U-Net's 3×3×3 convolutions and GroupNorms at split levels into their slab forms, in
    place (same parameters and state-dict keys). Where the split ends, the Down block's input is
    gathered whole (then everything below runs whole on every rank) and the Up block's transposed
    convolution output is cut back to the slab."""
    if sg is None or sg.count == 1:
        return model
    split = sharded_levels(model.scale, model.levels, sg.count)

    def convert(block: torch.nn.Module) -> None:
        for m in block.modules():
            if type(m) is FastConv3d and m.kernel_size == (3, 3, 3):
                m.__class__, m.shards = HaloConv3d, sg
            elif type(m) is FastGroupNorm:
                m.__class__, m.shards = ShardedGroupNorm, sg

    convert(model.inc)
    for i, down in enumerate(model.downs):  # down i produces level i + 1
        if split[i + 1]:
            convert(down)
        elif split[i]:
            down.register_forward_pre_hook(lambda module, args: (gather_depth(args[0], sg),))
    for j, up in enumerate(model.ups):  # up j produces level L - 1 - j from level L - j
        level = model.levels - 1 - j
        if split[level]:
            convert(up.conv)
            if not split[level + 1]:
                up.up.register_forward_hook(lambda module, args, y: _own_slab(y, sg))
    model.shards = sg
    return model


def _own_slab(y: torch.Tensor, sg: ShardGroup) -> torch.Tensor:
    lo, hi = sg.slab(y.shape[2])
    return y[:, :, lo:hi].contiguous(memory_format=_layout(y))


# ------------------------------------------------------------------------------------ loss and metrics

class ShardedLoss(torch.nn.Module):
    """SegmentationLoss over D-slabs: each rank's partial sums (weighted NLL, its normaliser, and per
    sample and class the Dice's intersection, prediction and target sums), added over the shard group
    in rank order, then the same formulas as the one-device loss. Same interface as the loss the
    step calls (`terms`, `per_sample`, `n_classes`)."""

    def __init__(self, loss: torch.nn.Module, sg: ShardGroup):
        super().__init__()
        self.loss, self.shards = loss, sg

    @property
    def n_classes(self) -> int:
        return self.loss.n_classes

    @property
    def weight(self) -> torch.Tensor:
        return self.loss.weight

    def _reduced(self, logits: torch.Tensor, labels: torch.Tensor, per_sample: bool):
        self.loss.rungs_ran.add(VENDOR)  # the eager formulas, for the census
        nll, wy, p, target = self.loss._voxel_terms(logits, labels)
        dims = (2, 3, 4)
        ce_dims = (1, 2, 3) if per_sample else (0, 1, 2, 3)
        parts = [nll.sum(ce_dims).reshape(-1), wy.sum(ce_dims).reshape(-1),
                 (p * target).sum(dims).reshape(-1), p.sum(dims).reshape(-1),
                 target.sum(dims).to(torch.float32).reshape(-1)]
        sizes = [t.numel() for t in parts]
        total = all_sum(torch.cat(parts), self.shards)
        nll_s, wy_s, inter, psum, present = torch.split(total, sizes)
        shape = (labels.shape[0], self.n_classes - 1)
        inter, psum, present = inter.view(shape), psum.view(shape), present.view(shape)
        eps = self.loss.eps
        dice = (2 * inter + eps) / (psum + present + eps)
        dice = torch.where(present > 0, dice, torch.ones_like(dice)).mean(1)
        return nll_s / wy_s, dice

    def terms(self, logits: torch.Tensor, labels: torch.Tensor):
        ce, dice = self._reduced(logits, labels, per_sample=False)
        ce = ce.reshape(())
        return ce + (1 - dice.mean()), ce, dice

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.terms(logits, labels)[0]

    def per_sample(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ce, dice = self._reduced(logits, labels, per_sample=True)
        return ce + (1 - dice)

