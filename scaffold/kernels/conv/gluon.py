"""Conv3d 3×3×3, stride 1, padding 1 on Hopper (sm_90) in Gluon: an implicit GEMM fed by the copy engine.

Gluon (`triton.experimental.gluon`) exposes what Triton's automatic pipelining hides: shared-memory
layouts, tensor-memory-accelerator (TMA) copies, mbarriers and asynchronous warpgroup MMAs (wgmma).
This module holds the forward (and, through it, backward-data) of the U-Net's 3×3×3 convs:

  y[box, co] = sum over (tap, ci) of x[box + tap − 1, ci] · W[co, ci, tap]

A tile is a box of BD×BH×BW output voxels of one sample (rows) by BN output channels (columns).
x is read through a 5-D descriptor over [N, D, H, W, C] (channels-last): the operand of a step (tap,
BK-channel block) is the box shifted by the tap, one TMA copy, and coordinates outside the volume
(negative ones included) read as zero, which is the padding. W is read as a [27·Cin, Cout] matrix (row
tap·Cin + ci), prepared once per call (weights are small). Copies run STAGES deep in a shared-memory
ring, each stage signalled by its own mbarrier; one wgmma stays in flight, and a stage is refilled once
the MMA that read it has retired.

Three ways to run the steps (GluonTile):
  persistent                one program per SM takes tiles pid, pid + P, ...; their steps are one flat
                            sequence, so the next tile's first copies fly during a tile's last MMAs
                            and its store.
  ws                        the same, warp-specialized (the default at 64-wide outputs): a one-warp loader partition runs the copies,
                            gated by per-stage release barriers that the MMA warps arrive on.
  halo                      (BD = 2, measured slower) one box of BD + 2 planes per (kh, kw) (two copies:
                            boxes are powers of two), the three kd taps as whole-plane row slices of it,
                            one accumulator per output plane: a third less traffic from L2, but Gluon's
                            power-of-two shapes leave room for a 2-deep ring only.

Backward-data is the forward on dy with the flipped, channel-swapped weight (padding 1 is symmetric).
fp32 accumulation; each output element is one fixed-order sum (no split, no atomics): bitwise
reproducible. Needs Triton's Gluon with the Hopper modules (`available()` says whether it is here);
on the CPU, in the interpreter, or without Gluon the module imports and reports itself unavailable.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..lib.device import sm_count
from ..lib.launch import launched

try:  # Gluon ships with Triton >= 3.4 as an experimental package; its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _GLUON_ERROR = None
except Exception as e:  # pragma: no cover - depends on the install
    gluon = gl = TensorDescriptor = None
    _GLUON_ERROR = f"{type(e).__name__}: {e}"


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when the Gluon kernels can run on `device` (default: the current CUDA device), else why not."""
    if _GLUON_ERROR is not None:
        return f"triton.experimental.gluon (Hopper) not importable: {_GLUON_ERROR}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    device = device or torch.device("cuda", torch.cuda.current_device())
    return _arch_reason(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _arch_reason(index: int) -> str | None:
    if torch.cuda.get_device_capability(index)[0] != 9:
        return "not an sm_90 (Hopper) GPU"
    return None


def available(device: torch.device | None = None) -> bool:
    return unavailable_reason(device) is None


@dataclass(frozen=True)
class GluonTile:
    """Box of output voxels (BD×BH×BW rows), output channels per tile (BN), input channels per
    step (BK), ring depth, whether to read the d halo once per (kh, kw), and warps."""
    bd: int
    bh: int
    bw: int
    bn: int
    bk: int = 64
    stages: int = 3
    halo: bool = True
    warps: int = 8
    persistent: bool = True
    per_sm: int = 1  # persistent programs per multiprocessor (what its shared memory allows)
    ws: bool = False  # warp-specialized (a loader warp beside the MMA warps); persistent
    direct: bool = False  # store straight from the accumulators' registers (no shared-memory scratch)

    def __post_init__(self):
        if self.halo and self.ws:
            if self.bd != 4 or self.warps != 4:
                raise ValueError(f"GluonTile: a warp-specialized halo tile has bd=4 and warps=4 (two MMA "
                                 f"warpgroups of two planes each), got bd={self.bd}, warps={self.warps}")
        elif self.halo and self.bd != 2:
            raise ValueError(f"GluonTile: a halo tile has bd=2 (one accumulator per plane), got {self.bd}")
        if (self.bh * self.bw if self.halo else self.bm) < 16 * self.warps:
            raise ValueError(f"GluonTile: {self.warps} warps need >= {16 * self.warps} rows per MMA")

    @property
    def bm(self) -> int:
        return self.bd * self.bh * self.bw

    @property
    def halo_ws(self) -> bool:
        return self.halo and self.ws

    @property
    def a_rows(self) -> int:
        """Rows of one A stage in shared memory: the box (with its halo), rounded up to a power of
        two (Gluon's shared-memory shapes are powers of two); a warp-specialized halo tile keeps
        its BD + 2 planes in two allocations (BD, then 2) and wastes none."""
        rows = (self.bd + 2 if self.halo else self.bd) * self.bh * self.bw
        if self.halo_ws:
            return rows
        return 1 << (rows - 1).bit_length()

    def smem_bytes(self) -> int:
        """The ring's bytes, plus the epilogue's layout-conversion scratch (bf16 tile) unless direct."""
        per = self.a_rows * self.bk * 2 + ((3 if self.halo_ws else 4) if self.halo else 1) * self.bk * self.bn * 2
        scratch = 0 if self.direct else (self.bh * self.bw if self.halo else self.bm) * self.bn * 2
        return self.stages * per + scratch


def default_tile(cin: int, cout: int) -> GluonTile:
    """The tile of a site: for 64-wide outputs the warp-specialized d-halo tile (a 4×8×8 box, each
    input plane read once per (kh, kw); 3 stages; the fastest measured there, and faster than
    deterministic cuDNN at 128³ and 64³: docs/performance-log.md); for 128 channels and wider, in
    and out, the same d-halo tile 128 outputs wide on 32-channel steps, 4 stages (131 FLOP per byte
    read from L2 against the box tile's 87: 5–25% faster than it at every such site of scales 7 and
    8); else (64 input channels) 256 × 128 with the warp-specialized loader, 3 stages (ties the
    d-halo tile at 128³, 5% ahead at 64³: two 32-channel steps per tap are too few)."""
    if cout <= 64:
        return GluonTile(4, 8, 8, 64, stages=3, halo=True, warps=4, ws=True, direct=True)
    if cin >= 128:
        return GluonTile(4, 8, 8, 128, bk=32, stages=4, halo=True, warps=4, ws=True, direct=True)
    return GluonTile(4, 8, 8, 128, stages=3, halo=False, warps=8, ws=True)


def takes(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, stride=(1, 1, 1), padding=(1, 1, 1),
          dilation=(1, 1, 1), groups: int = 1) -> bool:
    """Metadata only: whether the kernel takes conv3d(x, w) computed in `dtype` (autocast's, where it
    casts the operands) on x's device: bf16 on sm_90, 3×3×3, stride 1, padding 1, dilation 1,
    channels multiples of 64 (one copy-engine row of 128 bytes per step)."""
    if not (x.is_cuda and available(x.device)) or groups != 1 or dtype != torch.bfloat16:
        return False
    if x.dim() != 5 or w.dim() != 5 or tuple(w.shape[2:]) != (3, 3, 3) or w.shape[1] != x.shape[1]:
        return False
    if (tuple(stride), tuple(padding), tuple(dilation)) != ((1, 1, 1),) * 3:
        return False
    return not (x.shape[1] % 64 or w.shape[0] % 64)


def supported(x: torch.Tensor, w: torch.Tensor, stride=(1, 1, 1), padding=(1, 1, 1),
              dilation=(1, 1, 1), groups: int = 1) -> bool:
    """Whether the Gluon forward takes these very operands: `takes` for bf16 x and w, and x NDHWC
    contiguous on 16 bytes (the copy engine's rule)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if not takes(x, w, x.dtype, stride, padding, dilation, groups):
        return False
    return x.permute(0, 2, 3, 4, 1).is_contiguous() and x.data_ptr() % 16 == 0  # the copy engine's rule


if gluon is not None:

    # One copy-engine load: `tma.async_load` where this Triton has it (3.9 does), else its older name
    # `tma.async_copy_global_to_shared` (3.6), chosen here so the kernels never name a missing one.
    _tma_async_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _tma_load(desc, coord, bar, dst):
        _tma_async_load(desc, coord, bar, dst)

    @gluon.jit
    def _issue(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, it, s, n, d0, h0, w0, n0, Cin, blocks_c,
               BD: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr, BK: gl.constexpr,
               BN: gl.constexpr, HALO: gl.constexpr, PUBLIC_REINTERPRET: gl.constexpr):
        """Start the copies of step `it` (its A box and its weight tiles) into ring stage `s`."""
        KD_PER: gl.constexpr = 3 if HALO else 1
        B_SLOTS: gl.constexpr = 4 if HALO else 1
        BDL: gl.constexpr = BD + 2 if HALO else BD
        PLANE: gl.constexpr = BH * BW
        A_BYTES: gl.constexpr = BDL * PLANE * BK * 2
        B_BYTES: gl.constexpr = BK * BN * 2
        cb = it % blocks_c
        t = it // blocks_c
        c0 = cb * BK
        kw = t % 3
        kh = (t // 3) % 3
        kd = t // 9  # 0 when HALO (t < 9)
        bar = bars.index(s)
        mbarrier.expect(bar, A_BYTES + KD_PER * B_BYTES)
        a_stage = a_bufs.index(s)
        # Box shapes are powers of two: with the halo, the BD + 2 planes are two copies (BD, then 2).
        a_dst = _box(a_stage.slice(0, BD * PLANE, dim=0), x_desc, PUBLIC_REINTERPRET)
        _tma_load(x_desc, [n, d0 - 1 + kd, h0 - 1 + kh, w0 - 1 + kw, c0], bar, a_dst)
        if HALO:
            h_dst = _box(a_stage.slice(BD * PLANE, 2 * PLANE, dim=0), xh_desc, PUBLIC_REINTERPRET)
            _tma_load(xh_desc, [n, d0 - 1 + BD, h0 - 1 + kh, w0 - 1 + kw, c0], bar, h_dst)
        for j in gl.static_range(KD_PER):
            tap = ((kd + j) * 3 + kh) * 3 + kw
            _tma_load(w_desc, [tap * Cin + c0, n0], bar, b_bufs.index(s * B_SLOTS + j))

    @launched
    @gluon.jit
    def _conv3x3x3_kernel(x_desc, xh_desc, w_desc, y_ptr, b_ptr, Cin, Cout, D, H, W, tiles_d, tiles_h, tiles_w,
                          tiles_n, num_tiles, blocks_c, syn, syc, syd, syh, syw,
                          BD: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr, BN: gl.constexpr,
                          BK: gl.constexpr, STAGES: gl.constexpr, HALO: gl.constexpr,
                          A_ROWS: gl.constexpr,
                          A2_LAYOUT: gl.constexpr, MMA_LAYOUT: gl.constexpr,
                          OUT_LAYOUT: gl.constexpr, PUBLIC_REINTERPRET: gl.constexpr, WS: gl.constexpr,
                          HAS_BIAS: gl.constexpr):
        BM: gl.constexpr = BD * BH * BW
        KD_PER: gl.constexpr = 3 if HALO else 1
        B_SLOTS: gl.constexpr = 4 if HALO else 1  # shared-memory shapes are powers of two
        PLANE: gl.constexpr = BH * BW

        pid = gl.program_id(0)
        pid_n = pid % tiles_n  # the output-channel tiles of one box run side by side: same A boxes
        box = pid // tiles_n
        tw = box % tiles_w
        th = (box // tiles_w) % tiles_h
        td = (box // (tiles_w * tiles_h)) % tiles_d
        n = box // (tiles_w * tiles_h * tiles_d)
        d0 = td * BD
        h0 = th * BH
        w0 = tw * BW
        n0 = pid_n * BN

        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, A_ROWS, BK], A2_LAYOUT)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES * B_SLOTS, BK, BN], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()

        if HALO:  # BD == 2: one accumulator per output plane, each MMA a whole-plane row slice
            total = 9 * blocks_c
            for i in gl.static_range(STAGES - 1):
                if i < total:
                    _issue(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, i, i, n, d0, h0, w0, n0, Cin,
                           blocks_c, BD, BH, BW, BK, BN, HALO, PUBLIC_REINTERPRET)
            acc0 = gl.zeros([PLANE, BN], gl.float32, layout=MMA_LAYOUT)
            acc1 = gl.zeros([PLANE, BN], gl.float32, layout=MMA_LAYOUT)
            for it in range(total):
                s = it % STAGES
                mbarrier.wait(bars.index(s), (it // STAGES) & 1)
                a = a_bufs.index(s)
                for j in gl.static_range(3):  # kd = j: planes j (output plane 0) and j + 1 (plane 1)
                    b = b_bufs.index(s * B_SLOTS + j)
                    acc0 = warpgroup_mma(a.slice(j * PLANE, PLANE, dim=0), b, acc0, is_async=True)
                    acc1 = warpgroup_mma(a.slice((j + 1) * PLANE, PLANE, dim=0), b, acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=6, deps=(acc0, acc1))
                nxt = it + STAGES - 1
                if nxt < total:
                    _issue(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, nxt, nxt % STAGES, n, d0, h0,
                           w0, n0, Cin, blocks_c, BD, BH, BW, BK, BN, HALO, PUBLIC_REINTERPRET)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(i))
            _store(acc0, y_ptr, b_ptr, n, d0, h0, w0, n0, Cout, D, H, W, syn, syc, syd, syh, syw,
                   PLANE, BH, BW, BN, OUT_LAYOUT, HAS_BIAS)
            _store(acc1, y_ptr, b_ptr, n, d0 + 1, h0, w0, n0, Cout, D, H, W, syn, syc, syd, syh, syw,
                   PLANE, BH, BW, BN, OUT_LAYOUT, HAS_BIAS)
        elif WS:
            # Warp-specialized: one loader warp runs the copies STAGES ahead, gated by `empty` (a
            # stage is released once the MMA that read it has retired); the kernel's own warps
            # issue the MMAs and store each tile (persistent, flat steps as below).
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(empty.index(i), count=1)
            fence_async_shared()
            nprog = gl.num_programs(0)
            gl.warp_specialize([
                (_ws_mma, (a_bufs, b_bufs, bars, empty, y_ptr, b_ptr, pid, nprog, num_tiles, tiles_n,
                           tiles_w, tiles_h, tiles_d, blocks_c, Cout, D, H, W, syn, syc, syd, syh, syw,
                           BD, BH, BW, BN, STAGES, MMA_LAYOUT, OUT_LAYOUT, HAS_BIAS)),
                (_ws_loader, (x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, empty, pid, nprog,
                              num_tiles, tiles_n, tiles_w, tiles_h, tiles_d, Cin, blocks_c,
                              BD, BH, BW, BK, BN, STAGES, PUBLIC_REINTERPRET)),
            ], [1], [48])
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(i))
                mbarrier.invalidate(empty.index(i))
        else:
            # Persistent: this program's tiles are pid, pid + P, pid + 2P, ... (P programs), and its
            # steps are one flat sequence over them, so the copies of a tile's first steps are in
            # flight while the previous tile finishes its MMAs and stores its output.
            nprog = gl.num_programs(0)
            steps = 27 * blocks_c
            my_tiles = (num_tiles - pid + nprog - 1) // nprog
            total_steps = my_tiles * steps
            for i in gl.static_range(STAGES - 1):
                if i < total_steps:
                    _issue_flat(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, i, i, pid, nprog, steps,
                                tiles_n, tiles_w, tiles_h, tiles_d, Cin, blocks_c, BD, BH, BW, BK, BN,
                                PUBLIC_REINTERPRET)
            # One inner loop per tile, its accumulator started before it: an accumulator reset inside
            # the step loop (a branch at a tile's last step) makes ptxas wait for every MMA at each
            # step's end (its note C7517), which leaves the tensor cores idle between steps.
            for i in range(my_tiles):
                acc = gl.zeros([BM, BN], gl.float32, layout=MMA_LAYOUT)
                for k in range(steps):
                    g = i * steps + k
                    s = g % STAGES
                    mbarrier.wait(bars.index(s), (g // STAGES) & 1)
                    acc = warpgroup_mma(a_bufs.index(s).slice(0, BM, dim=0), b_bufs.index(s), acc,
                                        is_async=True)
                    # Everything but this step's MMA has retired: the stage of step g - 1 is free.
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    nxt = g + STAGES - 1
                    if nxt < total_steps:
                        _issue_flat(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, nxt, nxt % STAGES,
                                    pid, nprog, steps, tiles_n, tiles_w, tiles_h, tiles_d, Cin, blocks_c,
                                    BD, BH, BW, BK, BN, PUBLIC_REINTERPRET)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                tn, td0, th0, tw0, tn0 = _tile_origin(pid + i * nprog, tiles_n, tiles_w, tiles_h,
                                                      tiles_d, BD, BH, BW, BN)
                _store(acc, y_ptr, b_ptr, tn, td0, th0, tw0, tn0, Cout, D, H, W, syn, syc, syd, syh,
                       syw, BM, BH, BW, BN, OUT_LAYOUT, HAS_BIAS)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(i))

    @gluon.jit
    def _ws_loader(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, empty, pid, nprog, num_tiles, tiles_n,
                   tiles_w, tiles_h, tiles_d, Cin, blocks_c, BD: gl.constexpr, BH: gl.constexpr,
                   BW: gl.constexpr, BK: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                   PUBLIC_REINTERPRET: gl.constexpr):
        steps = 27 * blocks_c
        total_steps = ((num_tiles - pid + nprog - 1) // nprog) * steps
        for g in range(total_steps):
            s = g % STAGES
            # The k-th reuse of a stage waits for its k-th release (the first use passes at once).
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            _issue_flat(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, g, s, pid, nprog, steps, tiles_n,
                        tiles_w, tiles_h, tiles_d, Cin, blocks_c, BD, BH, BW, BK, BN,
                        PUBLIC_REINTERPRET)

    @gluon.jit
    def _ws_mma(a_bufs, b_bufs, bars, empty, y_ptr, b_ptr, pid, nprog, num_tiles, tiles_n, tiles_w,
                tiles_h, tiles_d, blocks_c, Cout, D, H, W, syn, syc, syd, syh, syw, BD: gl.constexpr,
                BH: gl.constexpr, BW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                MMA_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr):
        BM: gl.constexpr = BD * BH * BW
        steps = 27 * blocks_c
        for i in range((num_tiles - pid + nprog - 1) // nprog):
            acc = gl.zeros([BM, BN], gl.float32, layout=MMA_LAYOUT)  # before the loop: see above
            for k in range(steps):
                g = i * steps + k
                s = g % STAGES
                mbarrier.wait(bars.index(s), (g // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s).slice(0, BM, dim=0), b_bufs.index(s), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if g > 0:  # the MMA of step g - 1 has retired: its stage goes back to the loader
                    mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            tn, td0, th0, tw0, tn0 = _tile_origin(pid + i * nprog, tiles_n, tiles_w, tiles_h, tiles_d,
                                                  BD, BH, BW, BN)
            _store(acc, y_ptr, b_ptr, tn, td0, th0, tw0, tn0, Cout, D, H, W, syn, syc, syd, syh, syw,
                   BM, BH, BW, BN, OUT_LAYOUT, HAS_BIAS)

    @gluon.jit
    def _tile_origin(tile, tiles_n, tiles_w, tiles_h, tiles_d, BD: gl.constexpr, BH: gl.constexpr,
                     BW: gl.constexpr, BN: gl.constexpr):
        """(n, d0, h0, w0, n0) of tile number `tile`: output-channel tiles fastest (they read the same
        boxes), then w, h, d, sample."""
        pid_n = tile % tiles_n
        box = tile // tiles_n
        tw = box % tiles_w
        th = (box // tiles_w) % tiles_h
        td = (box // (tiles_w * tiles_h)) % tiles_d
        n = box // (tiles_w * tiles_h * tiles_d)
        return n, td * BD, th * BH, tw * BW, pid_n * BN

    @gluon.jit
    def _issue_flat(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, g, s, pid, nprog, steps, tiles_n,
                    tiles_w, tiles_h, tiles_d, Cin, blocks_c, BD: gl.constexpr, BH: gl.constexpr,
                    BW: gl.constexpr, BK: gl.constexpr, BN: gl.constexpr,
                    PUBLIC_REINTERPRET: gl.constexpr):
        """The copies of flat step g of this program (tile g // steps of its own, step g % steps)."""
        n, d0, h0, w0, n0 = _tile_origin(pid + (g // steps) * nprog, tiles_n, tiles_w, tiles_h,
                                         tiles_d, BD, BH, BW, BN)
        _issue(x_desc, xh_desc, w_desc, a_bufs, b_bufs, bars, g % steps, s, n, d0, h0, w0, n0, Cin,
               blocks_c, BD, BH, BW, BK, BN, False, PUBLIC_REINTERPRET)

    @gluon.jit
    def _store(acc, y_ptr, b_ptr, n, d0, h0, w0, n0, Cout, D, H, W, syn, syc, syd, syh, syw,
               ROWS: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr, BN: gl.constexpr,
               OUT_LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Rows (d, h, w) of a box from (d0, h0, w0), masked to the volume and to Cout; any output
        strides; the bias (fp32 add before the rounding to bf16) where given. OUT_LAYOUT: 8 channels a
        thread (16-byte stores, through shared memory), or the accumulators' own layout (a direct
        tile: 4-byte stores, no shared memory)."""
        c = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, OUT_LAYOUT))
        out = gl.convert_layout(acc, OUT_LAYOUT)
        if HAS_BIAS:
            bias = gl.load(b_ptr + c, mask=c < Cout, other=0.0).to(gl.float32)
            out = out + gl.expand_dims(bias, 0)
        out = out.to(gl.bfloat16)
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT_LAYOUT))
        od = d0 + r // (BH * BW)
        oh = h0 + (r // BW) % BH
        ow = w0 + r % BW
        row = (n.to(gl.int64) * syn + od.to(gl.int64) * syd + oh.to(gl.int64) * syh
               + ow.to(gl.int64) * syw)
        off = gl.expand_dims(row, 1) + gl.expand_dims(c.to(gl.int64) * syc, 0)
        mask = gl.expand_dims((od < D) & (oh < H) & (ow < W), 1) & gl.expand_dims(c < Cout, 0)
        gl.store(y_ptr + off, out, mask=mask)


    # --- d halo, warp-specialized (GluonTile.halo and .ws: BD = 4, two MMA warpgroups) ----------
    #
    # A step is (kh, kw, channel block): one copy of the BD + 2 input planes the three kd taps of
    # the box read (two copies: 4 planes into `a_lo`, 2 into `a_hi`; shapes are powers of two) and
    # the three weight tiles (one allocation per kd: no rounding to four), so each input plane is
    # read from L2 once per (kh, kw) instead of three times. Output plane p at tap kd is the MMA of
    # input plane p + kd, a whole-plane row slice (Gluon slices rows only at multiples of their
    # length). Two MMA warpgroups take two output planes each (an accumulator per plane); a loader
    # warp runs the copies STAGES deep; a stage goes back to it once both warpgroups retired its
    # MMAs. Each output element is still one fixed-order sum over (kh, kw, channel, kd).

    @gluon.jit
    def _box(buf, desc, PUBLIC_REINTERPRET: gl.constexpr):
        """A stage's rows viewed as `desc`'s box, the destination of a copy by it."""
        if PUBLIC_REINTERPRET:
            r = buf.reinterpret(gl.bfloat16, desc.block_shape, desc.layout)
        else:
            r = buf._reinterpret(gl.bfloat16, desc.block_shape, desc.layout)
        return r

    @gluon.jit
    def _plane(a_lo, a_hi, s, q: gl.constexpr, BD: gl.constexpr, PLANE: gl.constexpr):
        if q < BD:
            r = a_lo.index(s).slice(q * PLANE, PLANE, dim=0)
        else:
            r = a_hi.index(s).slice((q - BD) * PLANE, PLANE, dim=0)
        return r

    @gluon.jit
    def _halo_loader(x_desc, xh_desc, w_desc, a_lo, a_hi, b0, b1, b2, ready, empty, pid, nprog,
                     num_tiles, tiles_n, tiles_w, tiles_h, tiles_d, Cin, blocks_c, BD: gl.constexpr,
                     BH: gl.constexpr, BW: gl.constexpr, BK: gl.constexpr, BN: gl.constexpr,
                     STAGES: gl.constexpr, PUBLIC_REINTERPRET: gl.constexpr):
        PLANE: gl.constexpr = BH * BW
        steps = 9 * blocks_c
        total = ((num_tiles - pid + nprog - 1) // nprog) * steps
        for g in range(total):
            s = g % STAGES
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            n, d0, h0, w0, n0 = _tile_origin(pid + (g // steps) * nprog, tiles_n, tiles_w, tiles_h,
                                             tiles_d, BD, BH, BW, BN)
            it = g % steps
            c0 = (it % blocks_c) * BK
            t = it // blocks_c
            kw = t % 3
            kh = t // 3
            bar = ready.index(s)
            mbarrier.expect(bar, (BD + 2) * PLANE * BK * 2 + 3 * BK * BN * 2)
            _tma_load(x_desc, [n, d0 - 1, h0 - 1 + kh, w0 - 1 + kw, c0], bar,
                      _box(a_lo.index(s), x_desc, PUBLIC_REINTERPRET))
            _tma_load(xh_desc, [n, d0 - 1 + BD, h0 - 1 + kh, w0 - 1 + kw, c0], bar,
                      _box(a_hi.index(s), xh_desc, PUBLIC_REINTERPRET))
            tap = kh * 3 + kw
            _tma_load(w_desc, [tap * Cin + c0, n0], bar, b0.index(s))
            _tma_load(w_desc, [(9 + tap) * Cin + c0, n0], bar, b1.index(s))
            _tma_load(w_desc, [(18 + tap) * Cin + c0, n0], bar, b2.index(s))

    @gluon.jit
    def _halo_mma(a_lo, a_hi, b0, b1, b2, ready, empty, y_ptr, b_ptr, pid, nprog, num_tiles, tiles_n,
                  tiles_w, tiles_h, tiles_d, blocks_c, Cout, D, H, W, syn, syc, syd, syh, syw,
                  P0: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr,
                  BN: gl.constexpr, STAGES: gl.constexpr, MMA_LAYOUT: gl.constexpr,
                  OUT_LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Output planes P0 and P0 + 1 of each tile, one accumulator each."""
        PLANE: gl.constexpr = BH * BW
        steps = 9 * blocks_c
        for i in range((num_tiles - pid + nprog - 1) // nprog):
            acc0 = gl.zeros([PLANE, BN], gl.float32, layout=MMA_LAYOUT)
            acc1 = gl.zeros([PLANE, BN], gl.float32, layout=MMA_LAYOUT)
            for k in range(steps):
                g = i * steps + k
                s = g % STAGES
                mbarrier.wait(ready.index(s), (g // STAGES) & 1)
                acc0 = warpgroup_mma(_plane(a_lo, a_hi, s, P0, BD, PLANE), b0.index(s), acc0, is_async=True)
                acc1 = warpgroup_mma(_plane(a_lo, a_hi, s, P0 + 1, BD, PLANE), b0.index(s), acc1,
                                     is_async=True)
                acc0 = warpgroup_mma(_plane(a_lo, a_hi, s, P0 + 1, BD, PLANE), b1.index(s), acc0,
                                     is_async=True)
                acc1 = warpgroup_mma(_plane(a_lo, a_hi, s, P0 + 2, BD, PLANE), b1.index(s), acc1,
                                     is_async=True)
                acc0 = warpgroup_mma(_plane(a_lo, a_hi, s, P0 + 2, BD, PLANE), b2.index(s), acc0,
                                     is_async=True)
                acc1 = warpgroup_mma(_plane(a_lo, a_hi, s, P0 + 3, BD, PLANE), b2.index(s), acc1,
                                     is_async=True)
                # This step's six MMAs may run on; the previous step's have retired: its stage is free.
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=6, deps=(acc0, acc1))
                if g > 0:
                    mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            tn, td0, th0, tw0, tn0 = _tile_origin(pid + i * nprog, tiles_n, tiles_w, tiles_h, tiles_d,
                                                  BD, BH, BW, BN)
            _store(acc0, y_ptr, b_ptr, tn, td0 + P0, th0, tw0, tn0, Cout, D, H, W, syn, syc, syd, syh,
                   syw, PLANE, BH, BW, BN, OUT_LAYOUT, HAS_BIAS)
            _store(acc1, y_ptr, b_ptr, tn, td0 + P0 + 1, th0, tw0, tn0, Cout, D, H, W, syn, syc, syd,
                   syh, syw, PLANE, BH, BW, BN, OUT_LAYOUT, HAS_BIAS)

    @launched
    @gluon.jit
    def _conv3x3x3_halo_ws_kernel(x_desc, xh_desc, w_desc, y_ptr, b_ptr, Cin, Cout, D, H, W, tiles_d,
                                  tiles_h, tiles_w, tiles_n, num_tiles, blocks_c, syn, syc, syd, syh,
                                  syw, BD: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr,
                                  BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                                  HALO: gl.constexpr, A_ROWS: gl.constexpr, A2_LAYOUT: gl.constexpr,
                                  MMA_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr,
                                  PUBLIC_REINTERPRET: gl.constexpr, WS: gl.constexpr,
                                  HAS_BIAS: gl.constexpr):
        PLANE: gl.constexpr = BH * BW
        a_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BD * PLANE, BK], A2_LAYOUT)
        a_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * PLANE, BK], A2_LAYOUT)
        b0 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BK, BN], w_desc.layout)
        b1 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BK, BN], w_desc.layout)
        b2 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BK, BN], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both MMA warpgroups release a stage
        fence_async_shared()
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        gl.warp_specialize([
            (_halo_mma, (a_lo, a_hi, b0, b1, b2, ready, empty, y_ptr, b_ptr, pid, nprog, num_tiles,
                         tiles_n, tiles_w, tiles_h, tiles_d, blocks_c, Cout, D, H, W, syn, syc, syd,
                         syh, syw, 0, BD, BH, BW, BN, STAGES, MMA_LAYOUT, OUT_LAYOUT, HAS_BIAS)),
            (_halo_mma, (a_lo, a_hi, b0, b1, b2, ready, empty, y_ptr, b_ptr, pid, nprog, num_tiles,
                         tiles_n, tiles_w, tiles_h, tiles_d, blocks_c, Cout, D, H, W, syn, syc, syd,
                         syh, syw, 2, BD, BH, BW, BN, STAGES, MMA_LAYOUT, OUT_LAYOUT, HAS_BIAS)),
            (_halo_loader, (x_desc, xh_desc, w_desc, a_lo, a_hi, b0, b1, b2, ready, empty, pid, nprog,
                            num_tiles, tiles_n, tiles_w, tiles_h, tiles_d, Cin, blocks_c, BD, BH, BW,
                            BK, BN, STAGES, PUBLIC_REINTERPRET)),
        ], [4, 1], [232, 40])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


last_compiled = None  # the last launch's compiled kernel (its .asm: ptx, cubin; for inspection)


def _public_reinterpret() -> bool:
    from triton.experimental.gluon.language import _core
    return hasattr(_core.shared_memory_descriptor, "reinterpret")


@functools.lru_cache(maxsize=None)
def _layouts(tile: GluonTile):
    """(A ring layout, MMA accumulator layout, epilogue layout, x box layout, weight tile layout)."""
    a_rows = tile.bd * tile.bh * tile.bw if tile.halo_ws else tile.a_rows
    a2 = gl.NVMMASharedLayout.get_default_for([a_rows, tile.bk], gl.bfloat16)
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[tile.warps, 1],
                                    instr_shape=[16, tile.bn, 16])  # BM (or a plane) ≥ 16·warps
    tpw_n = min(tile.bn // 8, 32)
    out = mma if tile.direct else gl.BlockedLayout(size_per_thread=[1, 8],
                                                   threads_per_warp=[32 // tpw_n, tpw_n],
                                                   warps_per_cta=[tile.warps, 1], order=[1, 0])
    xl = gl.NVMMASharedLayout.get_default_for([1, tile.bd, tile.bh, tile.bw, tile.bk], gl.bfloat16)
    xhl = gl.NVMMASharedLayout.get_default_for([1, 2, tile.bh, tile.bw, tile.bk], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([tile.bk, tile.bn], gl.bfloat16)
    return a2, mma, out, xl, xhl, wl


def weight_matrix(w: torch.Tensor, mirror: bool = False) -> torch.Tensor:
    """W (Cout, Cin, 3, 3, 3) as the [27·Cin, Cout] matrix the kernel reads (row tap·Cin + ci).
    mirror: the backward-data operand, W flipped in every spatial dim with Cin and Cout swapped,
    as [27·Cout, Cin]."""
    if mirror:
        w = w.flip(2, 3, 4).transpose(0, 1)
    co, ci = w.shape[:2]
    return w.permute(2, 3, 4, 1, 0).reshape(27 * ci, co).contiguous()


def kernel_arguments(xv, wm, out, tile: GluonTile, bias=None, sms: int = 132) -> tuple:
    """(grid, positional arguments, keyword arguments) of one launch of the kernel. xv: the input as
    [N, D, H, W, C] (an NDHWC view); wm: the [27·Cin, Cout] weight matrix; out: the output, (N, Cout,
    D, H, W) with any strides; sms: the device's multiprocessors (a persistent grid's size). Tensors
    need only shape, stride, dtype and data_ptr: an ahead-of-time compile passes stand-ins."""
    n, d, h, w, cin = xv.shape
    cout = wm.shape[1]
    a2, mma, out_layout, xl, xhl, wl = _layouts(tile)
    x_desc = TensorDescriptor(xv, list(xv.shape), list(xv.stride()),
                              [1, tile.bd, tile.bh, tile.bw, tile.bk], xl)
    xh_desc = TensorDescriptor(xv, list(xv.shape), list(xv.stride()), [1, 2, tile.bh, tile.bw, tile.bk],
                               xhl) if tile.halo else x_desc
    w_desc = TensorDescriptor(wm, list(wm.shape), list(wm.stride()), [tile.bk, tile.bn], wl)
    tiles = (-(-d // tile.bd), -(-h // tile.bh), -(-w // tile.bw))
    tiles_n = -(-cout // tile.bn)
    num_tiles = n * tiles[0] * tiles[1] * tiles[2] * tiles_n
    programs = num_tiles
    if ((tile.persistent or tile.ws) and not tile.halo) or tile.halo_ws:  # one wave of programs
        programs = min(num_tiles, sms * tile.per_sm)
    args = (x_desc, xh_desc, w_desc, out, out if bias is None else bias, cin, cout, d, h, w, *tiles,
            tiles_n, num_tiles, -(-cin // tile.bk), *out.stride(),
            tile.bd, tile.bh, tile.bw, tile.bn, tile.bk, tile.stages, tile.halo, tile.a_rows,
            a2, mma, out_layout, _public_reinterpret(), tile.ws, bias is not None)
    return (programs,), args, {"num_warps": tile.warps}


def _launch(x: torch.Tensor, wm: torch.Tensor, out: torch.Tensor, tile: GluonTile,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    grid, args, kwargs = kernel_arguments(x.permute(0, 2, 3, 4, 1), wm, out, tile, bias,
                                          sm_count(x.device))
    global last_compiled
    kernel = _conv3x3x3_halo_ws_kernel if tile.halo_ws else _conv3x3x3_kernel
    compiled = kernel[grid](*args, **kwargs)
    if compiled is not None:  # None: launched directly, the kernel seen before
        last_compiled = compiled
    return out


def conv3d_forward(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                   tile: GluonTile | None = None, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """conv3d(x, w, bias, padding=1) for bf16 NDHWC x; `out` (any strides) is written if given. The
    bias is added in fp32 to the accumulators before their rounding to bf16."""
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0], *x.shape[2:]), device=x.device, dtype=x.dtype,
                          memory_format=torch.channels_last_3d)
    return _launch(x, weight_matrix(w), out, tile or default_tile(w.shape[1], w.shape[0]), bias)


def conv3d_backward_data(dy: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                         tile: GluonTile | None = None) -> torch.Tensor:
    """dx of conv3d(x, w, padding=1): the forward of dy with the flipped, channel-swapped weight."""
    if out is None:
        out = torch.empty((dy.shape[0], w.shape[1], *dy.shape[2:]), device=dy.device, dtype=dy.dtype,
                          memory_format=torch.channels_last_3d)
    return _launch(dy, weight_matrix(w, mirror=True), out,
                   tile or default_tile(w.shape[0], w.shape[1]))
