"""The collectives of spatial parallelism, as autograd functions over raw tensors: the halo exchange,
fixed-order sums over a shard group, the gather of a level's blocks and their redistribution between
splits. Every backward is the exact adjoint of its forward, summed in the same fixed order."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from scaffold.model.grid import Grid
from scaffold.spatial.mesh import ShardGroup

def _gather(t: torch.Tensor, sg: ShardGroup) -> list[torch.Tensor]:
    """Every rank's `t`, in rank order."""
    src = t.contiguous().cpu() if sg.stage else t.contiguous()
    parts = [torch.empty_like(src) for _ in range(sg.count)]
    dist.all_gather(parts, src, group=sg.group)
    return [p.to(t.device) for p in parts] if sg.stage else parts


def _p2p(ops: list[tuple[bool, torch.Tensor, int]], sg: ShardGroup) -> None:
    """Sends (True) and receives (False) of (send?, tensor, global peer rank), as one batch, in the
    order given. Where the group cannot move device tensors (`sg.stage`: gloo with CUDA tensors, as
    when two ranks share one GPU), through host copies; the received ones are copied back."""
    if not ops:
        return
    moved = [(send, (t.cpu() if send else torch.empty(t.shape, dtype=t.dtype)) if sg.stage else t, peer)
             for send, t, peer in ops]
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, t, peer, sg.group)
                                        for send, t, peer in moved]):
        work.wait()
    if sg.stage:
        for (send, t, _), (_, host, _) in zip(ops, moved):
            if not send:
                t.copy_(host)


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
        ops += [(True, first, prev), (False, from_prev, prev)]
    if next_ is not None:
        from_next = torch.empty_like(first)
        ops += [(True, last, next_), (False, from_next, next_)]
    _p2p(ops, sg)
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
        _p2p([(True, acc, nxt), (False, got, prv)], sg)
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
            ops.append((True, part.contiguous(), sg.ranks[j]))
        if take is not None:
            buf = torch.empty((n, c, take[1] - take[0], take[3] - take[2], w), dtype=x.dtype, device=x.device)
            ops.append((False, buf, sg.ranks[j]))
            landing.append((take, buf))
    _p2p(ops, sg)
    for take, buf in landing:
        out[:, :, take[0] - mine_dst[0]:take[1] - mine_dst[0], take[2] - mine_dst[2]:take[3] - mine_dst[2]] = buf
    return out


def redistribute(x: torch.Tensor, sg: ShardGroup, src: Grid, dst: Grid) -> torch.Tensor:
    """x, this rank's `src` block, as its `dst` block (differentiable)."""
    return x if src == dst else _Redistribute.apply(x, sg, src, dst)
