"""Backward-weight of the 3×3×3 conv (stride 1, padding 1) on Hopper (sm_90) in Gluon.

  dW[co, ci, kd, kh, kw] = sum over voxels v of dy[v, co] · x[v + (kd, kh, kw) − 1, ci]

Per tap that is a GEMM whose reduction runs over the voxels: [Cout, V] · [V, Cin]. A program owns one
(kh, kw) pair, one 64 × 64 block of (Cout, Cin) and one contiguous chunk of the volume's boxes
(BD×BH×BW voxels each), and keeps the three kd taps' accumulators. For each box a one-warp loader
copies dy's box (BD planes, `co` block) and x's box shifted by (kh − 1, kw − 1) with its d halo
(BD + 2 planes, `ci` block; two copies, BD then 2 planes: shapes are powers of two); out-of-volume
coordinates read as zero, which is both the padding and the ragged last boxes. Output plane p at
tap kd is the MMA of dy's plane p, transposed in shared memory (the MMA reads it MN-major), with x's
plane p + kd: 3·BD MMAs per box, each input plane read once for three taps. Two MMA warpgroups, each
with its own three accumulators, share the boxes one of three ways (the tile's `mode`):

  alternate  64 output channels a program; the warpgroups take alternate boxes of the chunk
  planes     64 output channels; each warpgroup takes half the planes of every box
  cout       128 output channels a program (dy copied as two 64-channel boxes); each warpgroup takes
             every plane of every box for its 64 channels, so x's box serves 128 channels: half the
             bytes per FLOP of the 64-channel modes at sites of 128 output channels and more

Determinism: every program and warpgroup writes its fp32 partial to a slot of its own (chunk c,
warpgroup j: slot 2c + j; `cout`: slot c, each warpgroup its own rows) and `sum_splits` adds the slots
in index order. No atomics: the bits depend only on the shape and the device's multiprocessor count
(which sets the chunks).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..lib.device import sm_count
from ..lib.indexing import cdiv
from ..lib.launch import launched
from ..lib.splits import _wave_split_plan, sum_splits
from . import gluon as G

gluon, gl = G.gluon, G.gl


SM90_SMEM_PER_SM = 233472  # bytes of shared memory on one sm_90 multiprocessor


@dataclass(frozen=True)
class WgradTile:
    """A box of BD×BH×BW voxels per step (the MMAs' reduction: one BH·BW plane per MMA), BCO output
    and BCI input channels per program (MMA rows and columns), ring depth."""
    bd: int = 4
    bh: int = 4
    bw: int = 8
    bco: int = 64
    bci: int = 64
    stages: int = 4
    split_planes: bool = False  # the two MMA warpgroups take half the planes of every box, not alternate boxes

    def __post_init__(self):
        if self.bco not in (64, 128):
            raise ValueError(f"WgradTile: bco is one or two warpgroups' 64 MMA rows, got {self.bco}")
        if self.split_planes and (self.bd % 2 or self.bco != 64):
            raise ValueError(f"WgradTile: split_planes needs an even bd and bco 64, got {self.bd}, {self.bco}")
        if self.mode == "alternate" and (self.stages < 3 or self.stages % 2):
            # a warpgroup frees a box's stage two boxes later (two stages deadlock), and with an odd
            # ring it would wait on a stage two phases ahead (a parity wait cannot tell those apart)
            raise ValueError(f"WgradTile: alternate boxes need an even ring of 4 or more, got {self.stages}")
        if (self.bh * self.bw) % 16 or self.bci % 64:
            raise ValueError(f"WgradTile: a plane of {self.bh}x{self.bw} voxels (the MMA's K) must be "
                             f"a multiple of 16 and bci a multiple of 64")

    @property
    def mode(self) -> str:
        """How the two MMA warpgroups share the work (see the module doc)."""
        return "cout" if self.bco == 128 else "planes" if self.split_planes else "alternate"

    @property
    def slots_per_chunk(self) -> int:
        """fp32 partial slots a chunk of boxes writes: one per warpgroup, or one (`cout`: each
        warpgroup its own output channels)."""
        return 1 if self.mode == "cout" else 2

    @property
    def plane(self) -> int:
        return self.bh * self.bw

    def smem_bytes(self) -> int:
        return self.stages * self.plane * ((self.bd + 2) * self.bci + self.bd * self.bco) * 2

    @property
    def per_sm(self) -> int:
        """Programs a multiprocessor holds at once (its 228 KiB of shared memory; barriers aside)."""
        return max(1, SM90_SMEM_PER_SM // (self.smem_bytes() + 1024))

    def step_flops(self) -> int:
        """FLOPs of one box: three taps, BD planes each."""
        return 2 * 3 * self.bd * self.plane * self.bco * self.bci


DEFAULT_TILE = WgradTile()  # 64 output channels: alternate boxes
WIDE_TILE = WgradTile(bco=128, stages=4)  # 128 output channels a program, one x box for both halves


def tile_for(cout: int) -> WgradTile:
    """The tile of a site: 128 output channels a program from 128 on (H200, scale 7: 8–12% faster than
    the 64-channel tile at every such site, 0.292 against 0.323 ms at 128>128 on 64³), else 64."""
    return WIDE_TILE if cout >= 128 else DEFAULT_TILE


def takes(dy: torch.Tensor, x: torch.Tensor, w_shape, dtype: torch.dtype, stride=(1, 1, 1),
          padding=(1, 1, 1), dilation=(1, 1, 1)) -> bool:
    """Metadata only: bf16 (the compute dtype) on sm_90, 3×3×3, stride 1, padding 1, channels
    multiples of 64 (as the forward)."""
    if not (x.is_cuda and G.available(x.device)) or dtype != torch.bfloat16:
        return False
    if x.dim() != 5 or dy.dim() != 5 or tuple(w_shape[2:]) != (3, 3, 3):
        return False
    if (tuple(stride), tuple(padding), tuple(dilation)) != ((1, 1, 1),) * 3:
        return False
    if tuple(dy.shape[2:]) != tuple(x.shape[2:]) or dy.shape[0] != x.shape[0]:
        return False
    return not (x.shape[1] % 64 or dy.shape[1] % 64)


def supported(dy: torch.Tensor, x: torch.Tensor, w_shape, stride=(1, 1, 1), padding=(1, 1, 1),
              dilation=(1, 1, 1)) -> bool:
    """Whether the kernel takes these very operands: bf16, NDHWC contiguous, 16-byte aligned."""
    if dy.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return False
    if not takes(dy, x, w_shape, torch.bfloat16, stride, padding, dilation):
        return False
    return all(t.permute(0, 2, 3, 4, 1).is_contiguous() and t.data_ptr() % 16 == 0 for t in (dy, x))


if gluon is not None:
    mbarrier, fence_async_shared = G.mbarrier, G.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = G.warpgroup_mma, G.warpgroup_mma_wait

    @gluon.jit
    def _wgrad_loader(x_desc, xh_desc, g_desc, x_lo, x_hi, g_buf, ready, empty, kh, kw, ci0, co0, start,
                      count, tiles_w, tiles_h, tiles_d, BD: gl.constexpr, BH: gl.constexpr,
                      BW: gl.constexpr, BCI: gl.constexpr, BCO: gl.constexpr, STAGES: gl.constexpr,
                      PUBLIC_REINTERPRET: gl.constexpr):
        PLANE: gl.constexpr = BH * BW
        GS: gl.constexpr = BCO // 64  # dy's 64-channel boxes a stage holds
        for i in range(count):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first use passes at once
            n, d0, h0, w0, _ = G._tile_origin(start + i, 1, tiles_w, tiles_h, tiles_d, BD, BH, BW, BCO)
            bar = ready.index(s)
            mbarrier.expect(bar, ((BD + 2) * BCI + BD * BCO) * PLANE * 2)
            G._tma_load(x_desc, [n, d0 - 1, h0 - 1 + kh, w0 - 1 + kw, ci0], bar,
                        G._box(x_lo.index(s), x_desc, PUBLIC_REINTERPRET))
            G._tma_load(xh_desc, [n, d0 - 1 + BD, h0 - 1 + kh, w0 - 1 + kw, ci0], bar,
                        G._box(x_hi.index(s), xh_desc, PUBLIC_REINTERPRET))
            for c in gl.static_range(GS):
                G._tma_load(g_desc, [n, d0, h0, w0, co0 + 64 * c], bar,
                            G._box(g_buf.index(s * GS + c), g_desc, PUBLIC_REINTERPRET))

    @gluon.jit
    def _wgrad_store(acc, p_ptr, slot, tap, co0, ci0, Cout, Cin, BCO: gl.constexpr, BCI: gl.constexpr,
                     LAYOUT: gl.constexpr):
        """acc (one tap's [BCO, BCI] block) into partial slot `slot`, laid out as dW's channels-last
        flat index: (co, tap, ci)."""
        co = co0 + gl.arange(0, BCO, layout=gl.SliceLayout(1, LAYOUT))
        ci = ci0 + gl.arange(0, BCI, layout=gl.SliceLayout(0, LAYOUT))
        q = 27 * Cin
        off = (slot.to(gl.int64) * Cout * q + gl.expand_dims(co.to(gl.int64) * q, 1)
               + gl.expand_dims(tap * Cin + ci, 0))
        mask = gl.expand_dims(co < Cout, 1) & gl.expand_dims(ci < Cin, 0)
        gl.store(p_ptr + off, acc, mask=mask)

    @gluon.jit
    def _wgrad_mma(x_lo, x_hi, g_buf, ready, empty, p_ptr, split, tap, co0, ci0, Cout, Cin, count,
                   J: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr,
                   BCI: gl.constexpr, STAGES: gl.constexpr, MMA_LAYOUT: gl.constexpr,
                   MODE: gl.constexpr):
        """Warpgroup J's share, three accumulators (kd = 0, 1, 2) of 64 output channels: MODE 0 boxes
        J, J + 2, J + 4, ... of the chunk; 1 half the planes of every box; 2 every plane of every box,
        output channels 64·J on."""
        PLANE: gl.constexpr = BH * BW
        GS: gl.constexpr = 2 if MODE == 2 else 1
        NP: gl.constexpr = BD // 2 if MODE == 1 else BD  # planes of a box this warpgroup takes
        P0: gl.constexpr = J * NP if MODE == 1 else 0
        LAG: gl.constexpr = 2 if MODE == 0 else 1  # this warpgroup's previous box: i - LAG
        G_IDX: gl.constexpr = J if MODE == 2 else 0
        acc0 = gl.zeros([64, BCI], gl.float32, layout=MMA_LAYOUT)
        acc1 = gl.zeros([64, BCI], gl.float32, layout=MMA_LAYOUT)
        acc2 = gl.zeros([64, BCI], gl.float32, layout=MMA_LAYOUT)
        for i in range(J if MODE == 0 else 0, count, LAG):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            g = g_buf.index(s * GS + G_IDX)
            for p in gl.static_range(P0, P0 + NP):
                a = g.slice(p * PLANE, PLANE, dim=0).permute((1, 0))  # [64, PLANE]
                acc0 = warpgroup_mma(a, G._plane(x_lo, x_hi, s, p, BD, PLANE), acc0, is_async=True)
                acc1 = warpgroup_mma(a, G._plane(x_lo, x_hi, s, p + 1, BD, PLANE), acc1, is_async=True)
                acc2 = warpgroup_mma(a, G._plane(x_lo, x_hi, s, p + 2, BD, PLANE), acc2, is_async=True)
                # This plane's three MMAs may run on; the previous plane's have retired. At most two
                # planes' six MMA groups are ever in flight: a wait counts 7 groups at most (the
                # instruction's field), and 12 in flight gave nondeterministic sums.
                acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=3, deps=(acc0, acc1, acc2))
                if p == P0:  # so has this warpgroup's previous box: its stage goes back to the loader
                    if i >= LAG:
                        mbarrier.arrive(empty.index((i - LAG) % STAGES), count=1)
        acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2))
        slot = split if MODE == 2 else 2 * split + J
        c0 = co0 + 64 * J if MODE == 2 else co0
        _wgrad_store(acc0, p_ptr, slot, tap, c0, ci0, Cout, Cin, 64, BCI, MMA_LAYOUT)
        _wgrad_store(acc1, p_ptr, slot, tap + 9, c0, ci0, Cout, Cin, 64, BCI, MMA_LAYOUT)
        _wgrad_store(acc2, p_ptr, slot, tap + 18, c0, ci0, Cout, Cin, 64, BCI, MMA_LAYOUT)

    @launched
    @gluon.jit
    def _conv3x3x3_wgrad_kernel(x_desc, xh_desc, g_desc, p_ptr, Cin, Cout, tiles_d, tiles_h, tiles_w,
                                num_boxes, per_split, tiles_ci, tiles_co, BD: gl.constexpr,
                                BH: gl.constexpr, BW: gl.constexpr, BCI: gl.constexpr,
                                BCO: gl.constexpr, STAGES: gl.constexpr, X_LAYOUT: gl.constexpr,
                                G_LAYOUT: gl.constexpr, MMA_LAYOUT: gl.constexpr,
                                PUBLIC_REINTERPRET: gl.constexpr, MODE: gl.constexpr):
        PLANE: gl.constexpr = BH * BW
        # Program order: (kh, kw) fastest, then the channel blocks, then the chunk, so the programs
        # that run together read the same boxes (from L2).
        pid = gl.program_id(0)
        t = pid % 9
        rest = pid // 9
        ci0 = (rest % tiles_ci) * BCI
        rest = rest // tiles_ci
        co0 = (rest % tiles_co) * BCO
        split = rest // tiles_co
        start = split * per_split
        count = gl.minimum(per_split, num_boxes - start)
        x_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BD * PLANE, BCI], X_LAYOUT)
        x_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * PLANE, BCI], X_LAYOUT)
        g_buf = gl.allocate_shared_memory(gl.bfloat16, [STAGES * (BCO // 64), BD * PLANE, 64], G_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1 if MODE == 0 else 2)  # the warpgroups that read it
        fence_async_shared()
        gl.warp_specialize([
            (_wgrad_mma, (x_lo, x_hi, g_buf, ready, empty, p_ptr, split, t, co0, ci0, Cout, Cin, count,
                          0, BD, BH, BW, BCI, STAGES, MMA_LAYOUT, MODE)),
            (_wgrad_mma, (x_lo, x_hi, g_buf, ready, empty, p_ptr, split, t, co0, ci0, Cout, Cin, count,
                          1, BD, BH, BW, BCI, STAGES, MMA_LAYOUT, MODE)),
            (_wgrad_loader, (x_desc, xh_desc, g_desc, x_lo, x_hi, g_buf, ready, empty, t // 3, t % 3,
                             ci0, co0, start, count, tiles_w, tiles_h, tiles_d, BD, BH, BW, BCI, BCO,
                             STAGES, PUBLIC_REINTERPRET)),
        ], [4, 1], [232, 40])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


MODES = {"alternate": 0, "planes": 1, "cout": 2}


@functools.lru_cache(maxsize=None)
def _layouts(tile: WgradTile):
    """(x ring layout, dy ring layout, MMA layout, x box, x halo box, dy box descriptor layouts)."""
    rows = tile.bd * tile.plane
    xl2 = gl.NVMMASharedLayout.get_default_for([rows, tile.bci], gl.bfloat16)
    gl2 = gl.NVMMASharedLayout.get_default_for([rows, 64], gl.bfloat16)
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, tile.bci, 16])
    box = lambda planes, c: gl.NVMMASharedLayout.get_default_for(  # noqa: E731
        [1, planes, tile.bh, tile.bw, c], gl.bfloat16)
    return xl2, gl2, mma, box(tile.bd, tile.bci), box(2, tile.bci), box(tile.bd, 64)


@functools.lru_cache(maxsize=None)
def plan(shape_x, cout: int, tile: WgradTile, sms: int) -> tuple[int, int, int, int]:
    """(programs, splits, boxes per split, boxes) for x of shape (N, D, H, W, Cin)-ordered sizes (a
    tuple: cached, as every step asks again)."""
    n, d, h, w, cin = shape_x
    boxes = n * cdiv(d, tile.bd) * cdiv(h, tile.bh) * cdiv(w, tile.bw)
    tiles = 9 * cdiv(cin, tile.bci) * cdiv(cout, tile.bco)
    # fp32 partials: tile.slots_per_chunk slots a chunk; 2 boxes at least a chunk
    s, per = _wave_split_plan(sms * tile.per_sm, tiles, boxes, tile.slots_per_chunk * cout * cin * 27,
                              float(tile.step_flops()), 2, 1 << 30)
    return tiles * s, s, per, boxes


def partials_shape(shape_x, cout: int, tile: WgradTile, sms: int) -> tuple[int, int]:
    """The fp32 partials a launch writes: [slots_per_chunk·splits, Cout·27·Cin]."""
    return tile.slots_per_chunk * plan(shape_x, cout, tile, sms)[1], cout * 27 * shape_x[4]


def kernel_arguments(xv, gv, partials, tile: WgradTile, sms: int = 132) -> tuple:
    """(grid, positional arguments, keyword arguments) of one launch. xv, gv: x and dy as [N, D, H, W,
    C] views; partials: fp32 [slots_per_chunk·splits, Cout·27·Cin]. Tensors need only shape, stride, dtype and
    data_ptr (an ahead-of-time compile passes stand-ins)."""
    n, d, h, w, cin = xv.shape
    cout = gv.shape[4]
    programs, s, per, boxes = plan(tuple(xv.shape), cout, tile, sms)
    xl2, gl2, mma, xl, xhl, gdl = _layouts(tile)
    x_desc = G.TensorDescriptor(xv, list(xv.shape), list(xv.stride()),
                                [1, tile.bd, tile.bh, tile.bw, tile.bci], xl)
    xh_desc = G.TensorDescriptor(xv, list(xv.shape), list(xv.stride()), [1, 2, tile.bh, tile.bw, tile.bci],
                                 xhl)
    g_desc = G.TensorDescriptor(gv, list(gv.shape), list(gv.stride()),
                                [1, tile.bd, tile.bh, tile.bw, 64], gdl)
    args = (x_desc, xh_desc, g_desc, partials, cin, cout, cdiv(d, tile.bd), cdiv(h, tile.bh),
            cdiv(w, tile.bw), boxes, per, cdiv(cin, tile.bci), cdiv(cout, tile.bco),
            tile.bd, tile.bh, tile.bw, tile.bci, tile.bco, tile.stages, xl2, gl2, mma,
            G._public_reinterpret(), MODES[tile.mode])
    return (programs,), args, {"num_warps": 4}


def conv3d_backward_weight(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
                           tile: WgradTile | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """dW (Cout, Cin, 3, 3, 3) of conv3d(x, w, padding=1) for bf16 NDHWC dy and x, channels_last_3d,
    in `dtype` (default dy's), or written into `out` (channels_last_3d)."""
    cout, cin = dy.shape[1], x.shape[1]
    tile = tile or tile_for(cout)
    if out is None:
        out = torch.empty((cout, cin, 3, 3, 3), device=dy.device, dtype=dtype or dy.dtype,
                          memory_format=torch.channels_last_3d)
    xv, gv = x.permute(0, 2, 3, 4, 1), dy.permute(0, 2, 3, 4, 1)
    sms = sm_count(dy.device)
    partials = torch.empty(partials_shape(tuple(xv.shape), cout, tile, sms), device=dy.device,
                           dtype=torch.float32)
    grid, args, kwargs = kernel_arguments(xv, gv, partials, tile, sms)
    _conv3x3x3_wgrad_kernel[grid](*args, **kwargs)
    sum_splits(partials, out.permute(0, 2, 3, 4, 1).view(-1))
    return out
