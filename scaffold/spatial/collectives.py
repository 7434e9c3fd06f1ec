"""The collectives of spatial parallelism, as autograd functions over raw tensors: the halo exchange,
fixed-order sums over a shard group, the gather of a level's blocks and their redistribution between
splits. Every backward is the exact adjoint of its forward, summed in the same fixed order."""
from __future__ import annotations

from typing import Callable, Optional

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


def _post(ops: list[tuple[bool, torch.Tensor, int]], sg: ShardGroup) -> Callable[[], None]:
    """Posts sends (True) and receives (False) of (send?, tensor, global peer rank), as one batch, in
    the order given, and returns the call that waits for them: the receive buffers hold their data once
    it returns (on CUDA: for work queued after it). Where the group cannot move device tensors
    (`sg.stage`: gloo with CUDA tensors, as when two ranks share one GPU), through host copies, which
    the returned call copies back."""
    if not ops:
        return lambda: None
    moved = [(send, (t.cpu() if send else torch.empty(t.shape, dtype=t.dtype)) if sg.stage else t, peer)
             for send, t, peer in ops]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, t, peer, sg.group)
                                    for send, t, peer in moved])

    def finish() -> None:
        for work in works:
            work.wait()
        if sg.stage:
            for (send, t, _), (_, host, _) in zip(ops, moved):
                if not send:
                    t.copy_(host)

    return finish


def _p2p(ops: list[tuple[bool, torch.Tensor, int]], sg: ShardGroup) -> None:
    """`_post`, waited for."""
    _post(ops, sg)()


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
              next_: Optional[int]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Callable[[], None]]:
    """Posts `first` to the previous rank and `last` to the next (global ranks of the group; None at
    the volume's faces); returns (what the previous rank sends as its `last`, what the next rank sends
    as its `first`; None at the faces) and the call that waits for them."""
    ops, from_prev, from_next = [], None, None
    if prev is not None:
        from_prev = torch.empty_like(last)
        ops += [(True, first, prev), (False, from_prev, prev)]
    if next_ is not None:
        from_next = torch.empty_like(first)
        ops += [(True, last, next_), (False, from_next, next_)]
    return from_prev, from_next, _post(ops, sg)


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
        lo, hi, wait = _exchange(x.narrow(dim, 0, 1).contiguous(), x.narrow(dim, size - 1, 1).contiguous(), sg,
                                 prev, next_)
        wait()
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
        from_prev, from_next, wait = _exchange(to_prev, to_next, ctx.sg, prev, next_)
        wait()
        gx = grad.narrow(dim, 1, size).clone(memory_format=_layout(grad))
        if from_prev is not None:  # the previous rank's upper halo is my first plane (row)
            gx.narrow(dim, 0, 1).add_(from_prev)
        if from_next is not None:
            gx.narrow(dim, size - 1, 1).add_(from_next)
        return gx, None, None, None


def halo_rows(x: torch.Tensor, sg: ShardGroup, grid: Optional[Grid] = None) -> torch.Tensor:
    """(N, C, d, h, W) block -> (N, C, d, h + 2, W) where `grid` splits H (the neighbours' adjacent
    rows, zeros at the volume's faces), else x; differentiable."""
    return _Halo.apply(x, sg, grid, 3) if grid is not None and grid.ph > 1 else x


def halo(x: torch.Tensor, sg: ShardGroup, grid: Optional[Grid] = None) -> torch.Tensor:
    """(N, C, d, h, W) block -> (N, C, d + 2, h, W), and (…, h + 2, W) too where `grid` splits H: the
    neighbours' adjacent rows, then planes (of the blocks so extended, which brings the corners)
    around it, zeros at the volume's faces; differentiable. `grid` None: D slabs over the whole group."""
    return _Halo.apply(halo_rows(x, sg, grid), sg, grid, 2)


class _PlaneLink:
    """What `_OpenPlanes` and `_ClosePlanes` pass between them: the waits of the exchanges in flight
    and where their planes land (forward: the neighbours' planes; backward: the gradients of mine that
    they computed)."""

    def __init__(self, sg: ShardGroup, grid: Optional[Grid]):
        self.sg, self.neighbours = sg, _neighbours(sg, grid, 2)
        self.got: tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)
        self.wait: Callable[[], None] = lambda: None

    def post(self, first: torch.Tensor, last: torch.Tensor) -> None:
        from_prev, from_next, self.wait = _exchange(first.contiguous(), last.contiguous(), self.sg,
                                                    *self.neighbours)
        self.got = (from_prev, from_next)


class _OpenPlanes(torch.autograd.Function):
    """The first half of a D halo whose exchange overlaps work on the block's interior: posts the
    block's first and last planes to its neighbours and returns (the block, as a view; the three
    planes around its first output plane and around its last, their outer plane still to come, which
    `_ClosePlanes` fills). The backward waits for the gradients `_ClosePlanes`' backward posted and
    adds them, with the edge planes' own, to the block's gradient (fixed order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, link: _PlaneLink):
        d = x.shape[2]
        ctx.link, ctx.d = link, d
        link.post(x.narrow(2, 0, 1), x.narrow(2, d - 1, 1))
        shape = (*x.shape[:2], 3, *x.shape[3:])
        lo = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_layout(x))
        hi = torch.empty_like(lo)
        lo.narrow(2, 1, 2).copy_(x.narrow(2, 0, 2))
        hi.narrow(2, 0, 2).copy_(x.narrow(2, d - 2, 2))
        return x.view_as(x), lo, hi

    @staticmethod
    def backward(ctx, gx, glo, ghi):
        link, d = ctx.link, ctx.d
        link.wait()
        from_prev, from_next = link.got
        if gx._base is not None:  # a view: added to in place below, so a copy of its own
            gx = gx.clone()
        gx.narrow(2, 0, 2).add_(glo.narrow(2, 1, 2))
        gx.narrow(2, d - 2, 2).add_(ghi.narrow(2, 0, 2))
        if from_prev is not None:  # the previous rank's upper plane is my first
            gx.narrow(2, 0, 1).add_(from_prev)
        if from_next is not None:
            gx.narrow(2, d - 1, 1).add_(from_next)
        return gx, None


class _ClosePlanes(torch.autograd.Function):
    """The second half: waits for the neighbours' planes and puts them (zeros at the volume's faces)
    as the outer planes of `_OpenPlanes`' edge planes, in place. The backward posts the gradients of
    those outer planes back to the neighbours they came from and passes the edge planes' on."""

    @staticmethod
    def forward(ctx, lo: torch.Tensor, hi: torch.Tensor, link: _PlaneLink):
        ctx.link = link
        link.wait()
        for plane, got in ((lo.narrow(2, 0, 1), link.got[0]), (hi.narrow(2, 2, 1), link.got[1])):
            if got is None:
                plane.zero_()
            else:
                plane.copy_(got)
        ctx.mark_dirty(lo, hi)
        return lo, hi

    @staticmethod
    def backward(ctx, glo, ghi):
        ctx.link.post(glo.narrow(2, 0, 1), ghi.narrow(2, 2, 1))
        return glo, ghi, None


def halo_planes_overlapped(x: torch.Tensor, sg: ShardGroup, grid: Optional[Grid],
                           interior: Callable[[torch.Tensor], torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The D halo of a block of at least 2 planes, exchanged while `interior(x)` runs: returns
    (interior(x), the three planes around the block's first output plane, the three around its last),
    the outer planes the neighbours' (zeros at the volume's faces); differentiable, and in the
    backward the gradients' exchange overlaps the interior's backward the same way."""
    link = _PlaneLink(sg, grid)
    body, lo, hi = _OpenPlanes.apply(x, link)
    inner = interior(body)  # computed while the planes are in flight
    lo, hi = _ClosePlanes.apply(lo, hi, link)
    return inner, lo, hi


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
