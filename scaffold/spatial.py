"""Spatial (domain) parallelism: each volume split over a group of ranks, along D, then H.

With `parallel.spatial_shards = S` the world is a 2-D mesh, data-parallel × spatial (torch's
DeviceMesh; consecutive ranks share a volume). Rank i of a shard group holds planes
[i·D/S, (i+1)·D/S) of every volume of its data-parallel rank: its slab of the masks, of the input and of
every activation at full resolution; the parameters are whole on every rank. Each level of the U-Net
is split by its own `Grid` (`level_grid`): D alone while each rank keeps at least one plane; then, where
the depth runs out (S > 2^(scale − level)), D into one-plane blocks and H into the rest; past that
(fewer voxels on a face than ranks) the level runs whole on every rank. What crosses block boundaries:

- a 3×3×3 convolution (padding 1) needs one plane (and, where H is split, one row) of each
  neighbour: `halo` sends this rank's first and last planes to its neighbours along D and receives
  theirs, then does the same with rows along H on the planes so extended, which brings the corners
  (batched isend/irecv of device tensors over the shard group: NCCL on GPUs, gloo on the CPU); zeros
  at the volume's faces, which is the convolution's own zero padding. The convolution then runs
  unchanged, on whatever ladder rung it picks (Triton or vendor), over the extended block, and what it
  computes beyond the block is dropped. The backward sends the halo's gradients back to their owners,
  which add them to their boundary planes (rows);
- GroupNorm's statistics, the loss's sums and the validation counts: each rank sums its block, and
  `all_sum` adds the ranks' partial sums **in rank order** (an all-gather, then a fixed-order sum), so
  a run at a fixed S is bitwise reproducible; its backward is the same fixed-order sum of the
  gradients, the exact adjoint of a sum over ranks;
- where a level is split differently from the one above it, the Down block's input and the Up block's
  transposed-convolution output move to the other split (`redistribute`: each rank sends every other
  the part of its block that lies in theirs; every voxel goes to one rank, so the backward is the same
  exchange reversed, exact);
- where a level runs whole, the Down block gathers its input whole on every rank of the group (its
  backward a fixed-order ring reduce-scatter, one block in flight), the levels below run whole and
  identically on each, and the Up block cuts its transposed convolution's output back to the block;
- nothing else: the 2×2×2 pool, the transposed convolution (kernel = stride = 2), the skip concat and
  the 1×1×1 head are local within a split.

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

from scaffold.model.grid import Grid, level_grid, level_grids  # noqa: F401 - part of this module's API
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


def _neighbours(sg: ShardGroup, grid: Optional[Grid], dim: int) -> tuple[Optional[int], Optional[int]]:
    """Global ranks of the previous and next blocks along D (dim 2) or H (dim 3) under `grid` (None:
    D slabs over the whole group); None at the volume's faces."""
    if grid is None or (dim == 2 and grid.ph == 1):
        return sg.prev, sg.next
    i, j = divmod(sg.index, grid.ph)
    if dim == 2:
        return (sg.ranks[sg.index - grid.ph] if i > 0 else None,
                sg.ranks[sg.index + grid.ph] if i + 1 < grid.pd else None)
    return (sg.ranks[sg.index - 1] if j > 0 else None, sg.ranks[sg.index + 1] if j + 1 < grid.ph else None)


def _exchange(first: torch.Tensor, last: torch.Tensor, sg: ShardGroup, prev: Optional[int],
              next_: Optional[int]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Sends `first` to the previous rank and `last` to the next (global ranks of the group; None at
    the volume's faces); returns (what the previous rank sent as its `last`, what the next rank sent as
    its `first`), None at the faces."""
    ops, from_prev, from_next = [], None, None
    if prev is not None:
        from_prev = torch.empty_like(last)
        ops += [dist.P2POp(dist.isend, first, prev, sg.group), dist.P2POp(dist.irecv, from_prev, prev, sg.group)]
    if next_ is not None:
        from_next = torch.empty_like(first)
        ops += [dist.P2POp(dist.isend, last, next_, sg.group), dist.P2POp(dist.irecv, from_next, next_, sg.group)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return from_prev, from_next


def _layout(x: torch.Tensor) -> torch.memory_format:
    cl = x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
    return torch.channels_last_3d if cl else torch.contiguous_format


class _Halo(torch.autograd.Function):
    """One plane (dim 2) or row (dim 3) of each neighbour around this rank's block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sg: ShardGroup, grid: Optional[Grid], dim: int) -> torch.Tensor:
        prev, next_ = _neighbours(sg, grid, dim)
        ctx.sg, ctx.neighbours, ctx.dim = sg, (prev, next_), dim
        size = x.shape[dim]
        lo, hi = _exchange(x.narrow(dim, 0, 1).contiguous(), x.narrow(dim, size - 1, 1).contiguous(), sg,
                           prev, next_)
        shape = list(x.shape)
        shape[dim] = size + 2
        out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_layout(x))
        out.narrow(dim, 1, size).copy_(x)
        for start, got in ((0, lo), (size + 1, hi)):  # zeros at the volume's faces
            if got is None:
                out.narrow(dim, start, 1).zero_()
            else:
                out.narrow(dim, start, 1).copy_(got)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dim, (prev, next_) = ctx.dim, ctx.neighbours
        size = grad.shape[dim] - 2
        to_prev, to_next = grad.narrow(dim, 0, 1).contiguous(), grad.narrow(dim, size + 1, 1).contiguous()
        from_prev, from_next = _exchange(to_prev, to_next, ctx.sg, prev, next_)
        gx = grad.narrow(dim, 1, size).clone(memory_format=_layout(grad))
        if from_prev is not None:  # the previous rank's upper halo is my first plane (row)
            gx.narrow(dim, 0, 1).add_(from_prev)
        if from_next is not None:
            gx.narrow(dim, size - 1, 1).add_(from_next)
        return gx, None, None, None


def halo(x: torch.Tensor, sg: ShardGroup, grid: Optional[Grid] = None) -> torch.Tensor:
    """(N, C, d, h, W) block -> (N, C, d + 2, h, W), and (…, h + 2, W) too where `grid` splits H: the
    neighbours' adjacent planes (then rows, of the planes so extended, which brings the corners) around
    it, zeros at the volume's faces; differentiable. `grid` None: D slabs over the whole group."""
    x = _Halo.apply(x, sg, grid, 2)
    if grid is not None and grid.ph > 1:
        x = _Halo.apply(x, sg, grid, 3)
    return x


# ------------------------------------------------------------------------------------ sharded modules

class HaloConv3d(FastConv3d):
    """A 3×3×3 FastConv3d (padding 1) over a block: halo, the same convolution on D + 2 planes (and
    H + 2 rows where H is split), the block's part of its output. Same parameters and state-dict keys."""

    shards: ShardGroup
    grid: Optional[Grid] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(halo(x, self.shards, self.grid))
        y = y[:, :, 1:-1, 1:-1] if self.grid is not None and self.grid.ph > 1 else y[:, :, 1:-1]
        return y.contiguous(memory_format=_layout(y))


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


def _ring_sum_slab(t: torch.Tensor, sg: ShardGroup, grid: Optional[Grid] = None) -> torch.Tensor:
    """This rank's `grid` block (default: its D slab) of Σ over the shard group of `t` (a whole volume,
    the same shape on every rank): a ring of S − 1 steps in which each rank passes one block's partial
    sum to the next and adds its own part to the one it receives (a reduce-scatter). Block j is summed
    in the fixed order of ranks j+1, j+2, …, j (mod S), so the result is bitwise the same on every run
    at a fixed S; one block is in flight per rank, where gathering every rank's whole would hold S of
    them."""
    n, r = sg.count, sg.index
    grid = grid or Grid(n, 1)
    nxt, prv = sg.ranks[(r + 1) % n], sg.ranks[(r - 1) % n]

    def piece(j: int) -> torch.Tensor:
        d0, d1, h0, h1 = grid.box(j, t.shape[2])
        return t[:, :, d0:d1, h0:h1]

    acc = piece((r - 1) % n).contiguous()  # block r − 1's sum starts here (sent in the default layout)
    for step in range(n - 1):
        got = torch.empty_like(acc)
        ops = [dist.P2POp(dist.isend, acc, nxt, sg.group), dist.P2POp(dist.irecv, got, prv, sg.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        acc = (got + piece((r - 2 - step) % n)).contiguous()  # the block received, summed over ranks j+1 … r
    return acc.contiguous(memory_format=_layout(t))


class _Gather(torch.autograd.Function):
    """The shard group's blocks (D slabs, or a grid's blocks) joined into the whole volume on every rank;
    the backward sums the ranks' gradients of the whole and keeps this rank's block (the adjoint), as
    a fixed-order ring reduce-scatter (`_ring_sum_slab`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sg: ShardGroup, grid: Grid) -> torch.Tensor:
        ctx.sg, ctx.grid = sg, grid
        parts = _gather(x, sg)
        rows = [torch.cat(parts[i * grid.ph:(i + 1) * grid.ph], 3) for i in range(grid.pd)]
        return torch.cat(rows, 2).contiguous(memory_format=_layout(x))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ring_sum_slab(grad, ctx.sg, ctx.grid), None, None


def gather_depth(x: torch.Tensor, sg: ShardGroup, grid: Optional[Grid] = None) -> torch.Tensor:
    """The whole volume on every rank from its `grid` blocks (default: D slabs); differentiable."""
    return _Gather.apply(x, sg, grid or Grid(sg.count, 1))


class _Redistribute(torch.autograd.Function):
    """A volume split one way (`src` blocks) split another (`dst`): each rank sends every other the
    part of its block that lies in theirs and assembles its new block from what it receives. Every
    voxel moves to exactly one rank, so the backward is the same exchange reversed: no sums, exact."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sg: ShardGroup, src: Grid, dst: Grid) -> torch.Tensor:
        ctx.sg, ctx.src, ctx.dst, ctx.shape = sg, src, dst, x.shape
        edge = x.shape[2] * src.pd
        return _move(x, sg, src, dst, edge)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        edge = ctx.shape[2] * ctx.src.pd
        return _move(grad, ctx.sg, ctx.dst, ctx.src, edge), None, None, None


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> Optional[tuple[int, int, int, int]]:
    d0, d1 = max(a[0], b[0]), min(a[1], b[1])
    h0, h1 = max(a[2], b[2]), min(a[3], b[3])
    return (d0, d1, h0, h1) if d0 < d1 and h0 < h1 else None


def _move(x: torch.Tensor, sg: ShardGroup, src: Grid, dst: Grid, edge: int) -> torch.Tensor:
    """This rank's `dst` block of the volume whose `src` blocks the ranks hold (x is this rank's)."""
    r = sg.index
    mine_src, mine_dst = src.box(r, edge), dst.box(r, edge)
    n, c, w = x.shape[0], x.shape[1], x.shape[4]
    out = torch.empty((n, c, mine_dst[1] - mine_dst[0], mine_dst[3] - mine_dst[2], w), dtype=x.dtype,
                      device=x.device, memory_format=_layout(x))
    ops, landing = [], []
    for j in range(sg.count):
        give = _overlap(mine_src, dst.box(j, edge))  # my voxels that j holds next
        take = _overlap(src.box(j, edge), mine_dst)  # j's voxels that I hold next
        if j == r:
            if give is not None:
                out[:, :, give[0] - mine_dst[0]:give[1] - mine_dst[0], give[2] - mine_dst[2]:give[3] - mine_dst[2]] = \
                    x[:, :, give[0] - mine_src[0]:give[1] - mine_src[0], give[2] - mine_src[2]:give[3] - mine_src[2]]
            continue
        if give is not None:
            part = x[:, :, give[0] - mine_src[0]:give[1] - mine_src[0], give[2] - mine_src[2]:give[3] - mine_src[2]]
            ops.append(dist.P2POp(dist.isend, part.contiguous(), sg.ranks[j], sg.group))
        if take is not None:
            buf = torch.empty((n, c, take[1] - take[0], take[3] - take[2], w), dtype=x.dtype, device=x.device)
            ops.append(dist.P2POp(dist.irecv, buf, sg.ranks[j], sg.group))
            landing.append((take, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for take, buf in landing:
        out[:, :, take[0] - mine_dst[0]:take[1] - mine_dst[0], take[2] - mine_dst[2]:take[3] - mine_dst[2]] = buf
    return out


def redistribute(x: torch.Tensor, sg: ShardGroup, src: Grid, dst: Grid) -> torch.Tensor:
    """x, this rank's `src` block, as its `dst` block (differentiable)."""
    return x if src == dst else _Redistribute.apply(x, sg, src, dst)


def shard_model(model: torch.nn.Module, sg: Optional[ShardGroup]) -> torch.nn.Module:
    """Turns the U-Net's 3×3×3 convolutions and GroupNorms at split levels into their block forms, in
    place (same parameters and state-dict keys). Where a level is split differently from the one above
    (D, then D and H), the Down block's input and the Up block's transposed convolution output move to
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

