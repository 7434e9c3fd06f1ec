"""GroupNorm with an optional fused ReLU (F.group_norm, then F.relu) on 5-D activations, deterministic.

x is viewed as [N, S, C] (S = D·H·W) through its strides, so NDHWC and NCDHW are read in place;
channel c belongs to group c // (C/G). Statistics are fp32, whatever the input dtype.
Forward, three launches: per (sample, split of the voxels) each channel's (mean, M2) partials;
per (sample, group) those merged into the group's mean and rstd; then, tile by tile,
y = (x − mean)·(rstd·w) + b and the ReLU. Backward, four launches: per (sample, split) the sums of
g and g·x̂ (g = dy where the recomputed y passes the ReLU); per (sample, group) their totals and
c1 = mean(g·w), c2 = mean(g·w·x̂); dweight and dbias summed over the batch; dx = rstd·(g·w − c1 − x̂·c2).
Every sum runs in a fixed order and nothing is atomic: the split count is a pure function of
(shape, device), so the bits are too.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .lib.device import arch_key, dtype_key, sm_count, triton_usable
from .lib.indexing import cdiv, next_pow2
from .lib.launch import launched
from .lib.layout import flat_nsc, nsc_strides
from .lib.rounding import cast_rne, to_f32
from .lib.splits import chunk_range

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_CHANNELS = 8192


# --- kernels --------------------------------------------------------------------------------------

@triton.jit
def _tile_ptrs(base, s0, end, C, s_s, s_c, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pointers and mask of the [BLOCK_S, BLOCK_C] tile at voxel s0 of one sample, cut at voxel `end`."""
    rows = s0 + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < end)[:, None] & (cols < C)[None, :]
    offs = rows.to(tl.int64)[:, None] * s_s + cols.to(tl.int64)[None, :] * s_c
    return base + offs, mask


@triton.jit
def _store_partials(a_ptr, b_ptr, a, b, n, split, splits, C, BLOCK_C: tl.constexpr):
    """A split's two per-channel results, each to the split's own row of an [N, splits, C] buffer."""
    cols = tl.arange(0, BLOCK_C)
    out = (n * splits + split) * C + cols
    tl.store(a_ptr + out, a, mask=cols < C)
    tl.store(b_ptr + out, b, mask=cols < C)


@triton.jit
def _partials_block(p0, n, k, cols, splits, C, CG, BLOCK_P: tl.constexpr):
    """Splits [p0, p0 + BLOCK_P) of sample n over one group's channels `cols` (k: their index in the
    group): the split indices, the mask and the offsets into an [N, splits, C] partials buffer."""
    p = p0 + tl.arange(0, BLOCK_P)
    mask = (p < splits)[:, None] & (k < CG)[None, :]
    offs = (n * splits + p)[:, None] * C + cols[None, :]
    return p, mask, offs


@launched
@triton.jit
def _gn_fwd_partials_kernel(x_ptr, pmean_ptr, pm2_ptr, S, C, chunk, splits, x_sn, x_ss, x_sc,
                         BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                         STAGES: tl.constexpr, UNROLL: tl.constexpr):
    """Per (sample, split), grid (N, splits): each channel's mean and M2 = Σ(x − mean)² over the
    split's voxels. A split holds a few thousand voxels, so its fp32 sums stay accurate; merging
    (mean, M2) pairs later, not raw sums, keeps 16.7M elements per group accurate too."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    start, end = chunk_range(split, chunk, S)
    base = x_ptr + n.to(tl.int64) * x_sn
    cols = tl.arange(0, BLOCK_C)
    # Shift every value by its channel's first voxel k: sums of d = x - k and d² then cancel only as
    # much as (mean - k)² / var, not mean² / var, which keeps Σd² − (Σd)²/n from cancelling when
    # |mean| >> std.
    # Per-element accumulators; one reduction at the end. Values are read as stored and widened in
    # registers (exact for bf16), so no cast pass precedes this one.
    k = to_f32(tl.load(base + cols.to(tl.int64) * x_sc, mask=cols < C, other=0.0))
    s1 = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    s2 = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    for s0 in tl.range(start, end, BLOCK_S, num_stages=STAGES, loop_unroll_factor=UNROLL):
        ptrs, mask = _tile_ptrs(base, s0, end, C, x_ss, x_sc, BLOCK_S, BLOCK_C)
        d = tl.where(mask, to_f32(tl.load(ptrs, mask=mask, other=0.0)) - k[None, :], 0.0)
        s1 += d
        s2 += d * d
    count = (end - start).to(tl.float32)
    t1 = tl.sum(s1, axis=0)
    mean = k + t1 / count
    m2 = tl.sum(s2, axis=0) - t1 * (t1 / count)
    _store_partials(pmean_ptr, pm2_ptr, mean, m2, n, split, splits, C, BLOCK_C)


@launched
@triton.jit
def _gn_fwd_combine_kernel(pmean_ptr, pm2_ptr, mean_ptr, rstd_ptr, S, C, G, CG, chunk, splits, per, R, eps,
                        BLOCK_P: tl.constexpr, BLOCK_CG: tl.constexpr):
    """Per (sample, group), grid (N, G): the group's mean, the count-weighted mean of the split
    means; then its M2 = Σ M2_i + n_i·(mean_i − mean)² (the parallel-axis theorem). Both sums run
    in a fixed order. Stores the mean and rstd. The splits may come from R blocks of a volume split
    over ranks (R · per of them, `per` splits of S voxels each block; one block: R = 1, per = splits)."""
    n = tl.program_id(0)
    g = tl.program_id(1)
    k = tl.arange(0, BLOCK_CG)
    cols = g * CG + k
    total = (S * CG).to(tl.float32) * R
    acc = tl.zeros([BLOCK_P, BLOCK_CG], tl.float32)
    for p0 in range(0, splits, BLOCK_P):
        p, mask, offs = _partials_block(p0, n, k, cols, splits, C, CG, BLOCK_P)
        cnt = tl.minimum(chunk, S - (p % per) * chunk).to(tl.float32)
        acc += tl.where(mask, cnt[:, None] * tl.load(pmean_ptr + offs, mask=mask, other=0.0), 0.0)
    mean = tl.sum(tl.sum(acc, axis=1), axis=0) / total
    acc = tl.zeros([BLOCK_P, BLOCK_CG], tl.float32)
    for p0 in range(0, splits, BLOCK_P):
        p, mask, offs = _partials_block(p0, n, k, cols, splits, C, CG, BLOCK_P)
        cnt = tl.minimum(chunk, S - (p % per) * chunk).to(tl.float32)
        d = tl.load(pmean_ptr + offs, mask=mask, other=0.0) - mean
        m2 = tl.load(pm2_ptr + offs, mask=mask, other=0.0)
        acc += tl.where(mask, m2 + cnt[:, None] * d * d, 0.0)
    var = tl.sum(tl.sum(acc, axis=1), axis=0) / total
    tl.store(mean_ptr + n * G + g, mean)
    tl.store(rstd_ptr + n * G + g, tl.div_rn(1.0, tl.sqrt_rn(var + eps)))


@triton.jit
def _channel_params(mean_ptr, rstd_ptr, w_ptr, b_ptr, n, C, G, CG,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per-channel mean, rstd, weight and bias of sample n (gathered from the per-group statistics)."""
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    grp = n * G + cols // CG
    mean = tl.load(mean_ptr + grp, mask=cmask, other=0.0)
    rstd = tl.load(rstd_ptr + grp, mask=cmask, other=0.0)
    if HAS_W:
        w = to_f32(tl.load(w_ptr + cols, mask=cmask, other=0.0))
    else:
        w = tl.full([BLOCK_C], 1.0, tl.float32)
    if HAS_B:
        b = to_f32(tl.load(b_ptr + cols, mask=cmask, other=0.0))
    else:
        b = tl.zeros([BLOCK_C], tl.float32)
    return mean, rstd, w, b


@launched
@triton.jit
def _gn_fwd_normalize_kernel(x_ptr, y_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, S, C, G, CG,
                          x_sn, x_ss, x_sc, y_sn, y_ss, y_sc,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, RELU: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = (x − mean)·(rstd·w) + b, then the ReLU, over one [BLOCK_S, C] tile of one sample."""
    s0 = tl.program_id(0) * BLOCK_S  # tiles on axis 0: grid axes 1 and 2 stop at 65535
    n = tl.program_id(1)
    mean, rstd, w, b = _channel_params(mean_ptr, rstd_ptr, w_ptr, b_ptr, n, C, G, CG,
                                       HAS_W, HAS_B, BLOCK_C)
    scale = rstd * w
    xp, mask = _tile_ptrs(x_ptr + n.to(tl.int64) * x_sn, s0, S, C, x_ss, x_sc, BLOCK_S, BLOCK_C)
    x = to_f32(tl.load(xp, mask=mask, other=0.0))
    y = (x - mean[None, :]) * scale[None, :] + b[None, :]
    if RELU:
        y = tl.where(y < 0.0, 0.0, y)  # NaN compares false and stays NaN, as in F.relu
    yp, _ = _tile_ptrs(y_ptr + n.to(tl.int64) * y_sn, s0, S, C, y_ss, y_sc, BLOCK_S, BLOCK_C)
    tl.store(yp, cast_rne(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _masked_grad(x, dy, mean, rstd, w, b, RELU: tl.constexpr):
    """x̂ and the gradient reaching the normalization (dy where the recomputed y passed the ReLU).
    y is recomputed from x and the saved statistics: cheaper than storing it."""
    xhat = (x - mean[None, :]) * rstd[None, :]
    if RELU:
        # The same expression as the forward, so the mask matches its output bit for bit;
        # y <= 0 (not y > 0) lets NaN through, as F.relu's threshold_backward does.
        y = (x - mean[None, :]) * (rstd * w)[None, :] + b[None, :]
        dy = tl.where(y <= 0.0, 0.0, dy)
    return xhat, dy


@launched
@triton.jit
def _gn_bwd_partials_kernel(x_ptr, dy_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, pg_ptr, pgx_ptr,
                         S, C, G, CG, chunk, splits, x_sn, x_ss, x_sc, d_sn, d_ss, d_sc,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr, RELU: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                         STAGES: tl.constexpr, UNROLL: tl.constexpr):
    """Per (sample, split), grid (N, splits): each channel's Σ g and Σ g·x̂ over the split's voxels."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    start, end = chunk_range(split, chunk, S)
    mean, rstd, w, b = _channel_params(mean_ptr, rstd_ptr, w_ptr, b_ptr, n, C, G, CG,
                                       HAS_W, HAS_B, BLOCK_C)
    xbase = x_ptr + n.to(tl.int64) * x_sn
    dbase = dy_ptr + n.to(tl.int64) * d_sn
    acc_g = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    acc_gx = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    for s0 in tl.range(start, end, BLOCK_S, num_stages=STAGES, loop_unroll_factor=UNROLL):
        xp, mask = _tile_ptrs(xbase, s0, end, C, x_ss, x_sc, BLOCK_S, BLOCK_C)
        dp, _ = _tile_ptrs(dbase, s0, end, C, d_ss, d_sc, BLOCK_S, BLOCK_C)
        x = to_f32(tl.load(xp, mask=mask, other=0.0))
        dy = to_f32(tl.load(dp, mask=mask, other=0.0))
        xhat, g = _masked_grad(x, dy, mean, rstd, w, b, RELU)
        acc_g += g  # masked lanes load dy = 0, so they add nothing
        acc_gx += g * xhat
    sum_g = tl.sum(acc_g, axis=0)
    sum_gx = tl.sum(acc_gx, axis=0)
    _store_partials(pg_ptr, pgx_ptr, sum_g, sum_gx, n, split, splits, C, BLOCK_C)


@launched
@triton.jit
def _gn_bwd_combine_kernel(pg_ptr, pgx_ptr, w_ptr, sg_ptr, sgx_ptr, c1_ptr, c2_ptr, S, C, G, CG, splits,
                        HAS_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_CG: tl.constexpr):
    """Per (sample, group), grid (N, G): the split sums added in a fixed order (stored per channel
    for dweight and dbias), then c1 = mean(g·w) and c2 = mean(g·w·x̂) over the group."""
    n = tl.program_id(0)
    g = tl.program_id(1)
    k = tl.arange(0, BLOCK_CG)
    cols = g * CG + k
    acc_g = tl.zeros([BLOCK_P, BLOCK_CG], tl.float32)
    acc_gx = tl.zeros([BLOCK_P, BLOCK_CG], tl.float32)
    for p0 in range(0, splits, BLOCK_P):
        _p, mask, offs = _partials_block(p0, n, k, cols, splits, C, CG, BLOCK_P)
        acc_g += tl.load(pg_ptr + offs, mask=mask, other=0.0)
        acc_gx += tl.load(pgx_ptr + offs, mask=mask, other=0.0)
    sum_g = tl.sum(acc_g, axis=0)
    sum_gx = tl.sum(acc_gx, axis=0)
    kmask = k < CG
    tl.store(sg_ptr + n * C + cols, sum_g, mask=kmask)
    tl.store(sgx_ptr + n * C + cols, sum_gx, mask=kmask)
    if HAS_W:
        w = to_f32(tl.load(w_ptr + cols, mask=kmask, other=0.0))
    else:
        w = tl.where(kmask, 1.0, 0.0)
    total = (S * CG).to(tl.float32)
    tl.store(c1_ptr + n * G + g, tl.sum(w * sum_g, axis=0) / total)
    tl.store(c2_ptr + n * G + g, tl.sum(w * sum_gx, axis=0) / total)


@launched
@triton.jit
def _gn_sum_over_batch_kernel(sg_ptr, sgx_ptr, db_ptr, dw_ptr, N, C, BLOCK: tl.constexpr):
    """dbias = Σ g and dweight = Σ g·x̂ per channel, the samples' sums added in order."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    db = tl.zeros([BLOCK], tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for n in range(0, N):
        db += tl.load(sg_ptr + n * C + cols, mask=mask, other=0.0)
        dw += tl.load(sgx_ptr + n * C + cols, mask=mask, other=0.0)
    tl.store(db_ptr + cols, cast_rne(db, db_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + cols, cast_rne(dw, dw_ptr.dtype.element_ty), mask=mask)


@launched
@triton.jit
def _gn_bwd_dx_kernel(x_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, c1_ptr, c2_ptr,
                   S, C, G, CG, x_sn, x_ss, x_sc, d_sn, d_ss, d_sc, o_sn, o_ss, o_sc,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, RELU: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx = rstd·(g·w − c1 − x̂·c2) over one [BLOCK_S, C] tile of one sample."""
    s0 = tl.program_id(0) * BLOCK_S  # tiles on axis 0: grid axes 1 and 2 stop at 65535
    n = tl.program_id(1)
    mean, rstd, w, b = _channel_params(mean_ptr, rstd_ptr, w_ptr, b_ptr, n, C, G, CG,
                                       HAS_W, HAS_B, BLOCK_C)
    cols = tl.arange(0, BLOCK_C)
    grp = n * G + cols // CG
    c1 = tl.load(c1_ptr + grp, mask=cols < C, other=0.0)
    c2 = tl.load(c2_ptr + grp, mask=cols < C, other=0.0)
    n64 = n.to(tl.int64)
    xp, mask = _tile_ptrs(x_ptr + n64 * x_sn, s0, S, C, x_ss, x_sc, BLOCK_S, BLOCK_C)
    dp, _ = _tile_ptrs(dy_ptr + n64 * d_sn, s0, S, C, d_ss, d_sc, BLOCK_S, BLOCK_C)
    op, _ = _tile_ptrs(dx_ptr + n64 * o_sn, s0, S, C, o_ss, o_sc, BLOCK_S, BLOCK_C)
    x = to_f32(tl.load(xp, mask=mask, other=0.0))
    dy = to_f32(tl.load(dp, mask=mask, other=0.0))
    xhat, g = _masked_grad(x, dy, mean, rstd, w, b, RELU)
    dx = rstd[None, :] * (g * w[None, :] - c1[None, :] - xhat * c2[None, :])
    tl.store(op, cast_rne(dx, dx_ptr.dtype.element_ty), mask=mask)


# --- tiles and splits: a frozen table, then a heuristic --------------------------------------------

@dataclass(frozen=True)
class NormTile:
    """Launch shape of the passes. The split (statistics) passes walk tiles of `split_elems` elements
    ([BLOCK_S, BLOCK_C]) on `split_warps` warps, about `per_sm` programs per SM; the elementwise
    (normalize, dx) passes take tiles of `ew_elems` elements on `ew_warps` warps. The forward's and the
    backward's split loops run `tl.range` with num_stages `*_stages` and loop_unroll_factor `*_unroll`
    (0: the compiler's choice), which change neither the arithmetic nor its order."""
    split_elems: int
    split_warps: int
    per_sm: int
    ew_elems: int
    ew_warps: int
    fwd_stages: int = 0
    fwd_unroll: int = 0
    bwd_stages: int = 0
    bwd_unroll: int = 0


# (arch, dtype, width class) -> tile. Width class: 'narrow' (C <= 128), 'mid' (C <= 256) or 'wide'.
# Filled from `python -m scaffold.bench.tune_norm` sweeps (CUDA-graph timing of every site shape,
# then of the split loops); other keys use the heuristic.
TILE_TABLE: dict[tuple[str, str, str], NormTile] = {
    # H200, 2026-12-02 sweeps (bf16 channels-last, device time, hardware bf16 rounding): narrow sites
    # take 4096-element elementwise tiles on 4 warps (fwd + bwd 64@128³ 0.624 -> 0.606 ms, 128@64³
    # 0.205 -> 0.194, 128@128³ 1.214 -> 1.134 against 8192 on 8 warps); 256-channel sites 2 split
    # programs per SM (256@32³ 0.105 -> 0.088 ms, 256@64³ 0.381 -> 0.364); wider sites long split tiles
    # and fewer splits (512@16³ fwd+bwd 0.089 -> 0.056 ms; 2048@8³ 0.076 -> 0.051).
    # Split loops (`--loops`, same bits): the backward's 3 stages deep at C <= 256 (64@256³
    # bwd 2.823 -> 2.565 ms, 128@128³ 0.706 -> 0.632, 64@128³ 0.379 -> 0.343); the forward's too
    # at 256 channels (256@64³ 0.149 -> 0.124). At C <= 128 the forward's loop took the compiler's
    # choice until 2026-12-04, when 3 stages measured faster at every narrow size (forward, same
    # bits): 64@256³ 1.627 -> 1.524 ms, 128@128³ 0.429 -> 0.405, 64@128³ 0.223 -> 0.210,
    # 128@64³ 0.0755 -> 0.0709, 32@128³ 0.120 -> 0.113 (2 stages in between, 4 slower).
    ("sm90", "bf16", "narrow"): NormTile(4096, 8, 4, 4096, 4, fwd_stages=3, bwd_stages=3),
    ("sm90", "bf16", "mid"): NormTile(4096, 8, 2, 4096, 8, fwd_stages=3, bwd_stages=3),
    ("sm90", "bf16", "wide"): NormTile(16384, 16, 2, 4096, 8),
}


def _heuristic_tile(arch: str) -> NormTile:
    if arch == "cpu":
        return NormTile(64, 1, 4, 64, 1)  # the interpreter pays per program and per element: tiny tiles
    # 16 elements per thread: 16-byte vector loads, and (sm90 compile) 62 registers in the statistics
    # pass, ~100 in the backward's, so 2-4 programs of 8 warps stay resident per SM.
    return NormTile(4096, 8, 4, 4096, 8)


def norm_tile(device: torch.device, dtype: torch.dtype, C: int) -> NormTile:
    """The tile of a call with C channels: the frozen table's entry, else the heuristic's."""
    arch = arch_key(device)
    width = "narrow" if C <= 128 else "mid" if C <= 256 else "wide"
    return TILE_TABLE.get((arch, dtype_key(dtype), width)) or _heuristic_tile(arch)


class Plan:
    """Launch geometry of one call: a pure function of (shape, groups, device, dtype), and of `tile`
    where given (it overrides the table)."""

    def __init__(self, N: int, C: int, S: int, G: int, device: torch.device, dtype: torch.dtype,
                 tile: Optional[NormTile] = None):
        t = tile or norm_tile(device, dtype, C)
        self.num_warps, self.ew_warps = t.split_warps, t.ew_warps
        self.fwd_loop = dict(STAGES=t.fwd_stages or None, UNROLL=t.fwd_unroll or None)
        self.bwd_loop = dict(STAGES=t.bwd_stages or None, UNROLL=t.bwd_unroll or None)
        self.block_c = next_pow2(C)
        self.block_s = max(1, t.split_elems // self.block_c)
        steps = cdiv(S, self.block_s)
        want = cdiv(t.per_sm * sm_count(device), N)  # splits per sample
        splits = max(1, min(want, steps))
        self.chunk = cdiv(steps, splits) * self.block_s
        self.splits = cdiv(S, self.chunk)
        self.ew_block_s = max(1, t.ew_elems // self.block_c)
        self.tiles = cdiv(S, self.ew_block_s)  # elementwise programs per sample
        self.block_cg = next_pow2(C // G)
        self.block_p = max(1, min(next_pow2(self.splits), 4096 // self.block_cg))


@functools.lru_cache(maxsize=1024)
def plan_for(N: int, C: int, S: int, G: int, device: torch.device, dtype: torch.dtype,
             tile: Optional[NormTile] = None) -> Plan:
    """The Plan of a call, built once per (shape, groups, device, dtype, tile): a pure function of
    those, and a launch's host time is spent on every call (two per site and step)."""
    return Plan(N, C, S, G, device, dtype, tile)


# --- layouts --------------------------------------------------------------------------------------

def empty_like_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output shaped like x: contiguous if x is (NCDHW), else channels-last (the fast layout)."""
    if x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    return torch.empty(x.shape, dtype=dtype, device=x.device, memory_format=torch.channels_last_3d)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.group_norm returns for x here. On CUDA under autocast F.group_norm runs in fp32 (it
    is on autocast's fp32 list) and returns fp32; elsewhere the output has the input's dtype."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return x.dtype


# --- launchers (tests call these directly, e.g. with NaN-poisoned `out` buffers) --------------------

# A volume split over ranks: `gather(a, b)` returns every rank's [N, splits, C] partials of a block, joined
# along the splits in rank order ([N, R·splits, C] each), the same on every rank (scaffold.spatial).
Gather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _block_p(plan: Plan, splits: int) -> int:
    return max(1, min(next_pow2(splits), 4096 // plan.block_cg))


def statistics(x: torch.Tensor, strides: tuple, plan: Plan, G: int, eps: float,
               gather: Optional[Gather] = None):
    """(mean, rstd), fp32 [N, G]: the forward's first two launches over x (its [N, S, C] strides).
    With `gather`, x is one block of a volume split over ranks and the statistics are the volume's."""
    N, C = x.shape[:2]
    S = x[0, 0].numel()
    f32 = dict(dtype=torch.float32, device=x.device)
    pmean, pm2 = torch.empty((2, N, plan.splits, C), **f32).unbind(0)  # one allocation: host time
    mean = torch.empty((N, G), **f32)
    rstd = torch.empty((N, G), **f32)
    _gn_fwd_partials_kernel[(N, plan.splits)](
        x, pmean, pm2, S, C, plan.chunk, plan.splits, *strides,
        BLOCK_S=plan.block_s, BLOCK_C=plan.block_c, num_warps=plan.num_warps, **plan.fwd_loop)
    splits, ranks, block_p = plan.splits, 1, plan.block_p
    if gather is not None:
        pmean, pm2 = gather(pmean, pm2)
        splits = pmean.shape[1]
        ranks, block_p = splits // plan.splits, _block_p(plan, splits)
    _gn_fwd_combine_kernel[(N, G)](
        pmean, pm2, mean, rstd, S, C, G, C // G, plan.chunk, splits, plan.splits, ranks, float(eps),
        BLOCK_P=block_p, BLOCK_CG=plan.block_cg, num_warps=4)
    return mean, rstd


def merge_grad_sums(pg: torch.Tensor, pgx: torch.Tensor, weight: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], plan: Plan, S: int, G: int):
    """(c1, c2, dweight, dbias) from the backward's per-split sums of g and g·x̂ ([N, splits, C], any
    number of splits: a split volume's ranks' joined, with S their voxels together): the per-(sample,
    group) constants of dx and the parameters' gradients, in fixed-order sums."""
    N, splits, C = pg.shape
    sums = torch.empty((2 * N * (C + G),), dtype=torch.float32, device=pg.device)  # one allocation
    sg, sgx = sums[:2 * N * C].view(2, N, C).unbind(0)
    c1, c2 = sums[2 * N * C:].view(2, N, G).unbind(0)
    pdtype = weight.dtype if weight is not None else torch.float32
    dw = torch.empty((C,), dtype=pdtype, device=pg.device)
    db = torch.empty((C,), dtype=bias.dtype if bias is not None else pdtype, device=pg.device)
    _gn_bwd_combine_kernel[(N, G)](
        pg, pgx, weight if weight is not None else pg, sg, sgx, c1, c2, S, C, G, C // G, splits,
        HAS_W=weight is not None, BLOCK_P=_block_p(plan, splits), BLOCK_CG=plan.block_cg, num_warps=4)
    block = min(1024, next_pow2(C))
    _gn_sum_over_batch_kernel[(cdiv(C, block),)](sg, sgx, db, dw, N, C, BLOCK=block, num_warps=4)
    return c1, c2, dw, db


def forward(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor],
            bias: Optional[torch.Tensor], eps: float, relu: bool, out_dtype: torch.dtype,
            out: Optional[torch.Tensor] = None, tile: Optional[NormTile] = None,
            gather: Optional[Gather] = None):
    """Returns (y, mean, rstd); mean and rstd are fp32 [N, G]. Reads x twice, writes y once. With
    `gather`, x is one block of a volume split over ranks, normalized with the volume's statistics."""
    N, C = x.shape[:2]
    S = x[0, 0].numel()
    G = num_groups
    # Only D, H, W must collapse into one stride; otherwise x is first made channels-last, which
    # costs one extra read and write of x.
    x, (x_sn, x_ss, x_sc) = flat_nsc(x)
    plan = plan_for(N, C, S, G, x.device, x.dtype, tile)
    y = empty_like_layout(x, out_dtype) if out is None else out
    y_sn, y_ss, y_sc = nsc_strides(y)
    mean, rstd = statistics(x, (x_sn, x_ss, x_sc), plan, G, eps, gather)
    _gn_fwd_normalize_kernel[(plan.tiles, N)](
        x, y, mean, rstd, weight if weight is not None else mean, bias if bias is not None else mean,
        S, C, G, C // G, x_sn, x_ss, x_sc, y_sn, y_ss, y_sc,
        HAS_W=weight is not None, HAS_B=bias is not None, RELU=bool(relu),
        BLOCK_S=plan.ew_block_s, BLOCK_C=plan.block_c, num_warps=plan.ew_warps)
    return y, mean, rstd


def backward(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor, num_groups: int,
             relu: bool, out: Optional[torch.Tensor] = None, tile: Optional[NormTile] = None,
             gather: Optional[Gather] = None):
    """Returns (dx, dweight, dbias); dweight and dbias are [C] in the weight's dtype (fp32 without one).
    Reads x and dy twice, writes dx once. With `gather` (x one block of a split volume): dx from the
    volume's group sums; dweight and dbias this block's part (the ranks' parts are summed with the
    other gradients)."""
    N, C = x.shape[:2]
    S = x[0, 0].numel()
    G = num_groups
    x, (x_sn, x_ss, x_sc) = flat_nsc(x)
    dy, (d_sn, d_ss, d_sc) = flat_nsc(dy)
    plan = plan_for(N, C, S, G, x.device, x.dtype, tile)
    dx = empty_like_layout(x, x.dtype) if out is None else out
    o_sn, o_ss, o_sc = nsc_strides(dx)
    pg, pgx = torch.empty((2, N, plan.splits, C), dtype=torch.float32, device=x.device).unbind(0)
    w = weight if weight is not None else mean
    b = bias if bias is not None else mean
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, RELU=bool(relu))
    _gn_bwd_partials_kernel[(N, plan.splits)](
        x, dy, mean, rstd, w, b, pg, pgx, S, C, G, C // G, plan.chunk, plan.splits,
        x_sn, x_ss, x_sc, d_sn, d_ss, d_sc, **flags,
        BLOCK_S=plan.block_s, BLOCK_C=plan.block_c, num_warps=plan.num_warps, **plan.bwd_loop)
    c1, c2, dw, db = merge_grad_sums(pg, pgx, weight, bias, plan, S, G)
    if gather is not None:
        pg, pgx = gather(pg, pgx)
        c1, c2, _, _ = merge_grad_sums(pg, pgx, weight, bias, plan, S * (pg.shape[1] // plan.splits), G)
    _gn_bwd_dx_kernel[(plan.tiles, N)](
        x, dy, dx, mean, rstd, w, b, c1, c2, S, C, G, C // G,
        x_sn, x_ss, x_sc, d_sn, d_ss, d_sc, o_sn, o_ss, o_sc, **flags,
        BLOCK_S=plan.ew_block_s, BLOCK_C=plan.block_c, num_warps=plan.ew_warps)
    return dx, dw, db


# --- custom ops: torch.compile traces through them; autograd is registered on the forward ----------

@torch.library.custom_op("scaffold::group_norm_fwd", mutates_args=())
def group_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   num_groups: int, eps: float, relu: bool,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return forward(x, num_groups, weight, bias, eps, relu, out_dtype)


@group_norm_fwd.register_fake
def _(x, weight, bias, num_groups, eps, relu, out_dtype):
    stats = x.new_empty((x.shape[0], num_groups), dtype=torch.float32)
    return empty_like_layout(x, out_dtype), stats, torch.empty_like(stats)


@torch.library.custom_op("scaffold::group_norm_bwd", mutates_args=())
def group_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor,
                   num_groups: int, relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(dy, x, weight, bias, mean, rstd, num_groups, relu)


@group_norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, num_groups, relu):
    pdtype = weight.dtype if weight is not None else torch.float32
    dw = x.new_empty((x.shape[1],), dtype=pdtype)
    db = x.new_empty((x.shape[1],), dtype=bias.dtype if bias is not None else pdtype)
    return empty_like_layout(x, x.dtype), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, num_groups, _eps, relu, _out_dtype = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.num_groups = num_groups
    ctx.relu = relu
    ctx.mark_non_differentiable(mean, rstd)


def _grads(ctx, dy, bwd):
    """The forward's input gradients from `bwd` (the registered op or the launcher)."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = bwd(dy, x, weight, bias, mean, rstd, ctx.num_groups, ctx.relu)
    return (dx, dw if weight is not None else None, db if bias is not None else None,
            None, None, None, None)


def _backward(ctx, dy, _dmean, _drstd):
    return _grads(ctx, dy, group_norm_bwd)


group_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _GroupNormFn(torch.autograd.Function):
    """The eager path: the custom op's forward, saved tensors and backward, as a plain autograd
    Function. The dispatcher's custom-op machinery costs the host ~50 µs per call (forward and
    backward each), which a training step pays at every site while its host is the bottleneck;
    `group_norm` takes this path unless torch.compile is tracing. Same launchers, same bits."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_groups, eps, relu, out_dtype, room=0):
        out = None
        if room:  # y is the first C channels of a channels-last buffer with `room` channels after them
            N, C = x.shape[:2]
            buf = torch.empty((N, C + room) + tuple(x.shape[2:]), dtype=out_dtype, device=x.device,
                              memory_format=torch.channels_last_3d)
            out = buf[:, :C]
        y, mean, rstd = forward(x, num_groups, weight, bias, eps, relu, out_dtype, out=out)
        _setup_context(ctx, (x, weight, bias, num_groups, eps, relu, out_dtype), (y, mean, rstd))
        return y, mean, rstd

    @staticmethod
    @once_differentiable  # first-order, as the registered op: a second derivative raises
    def backward(ctx, dy, _dmean, _drstd):
        return _grads(ctx, dy, backward) + (None,)


# --- public entry points --------------------------------------------------------------------------

def group_norm_supported(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor],
                         bias: Optional[torch.Tensor]) -> bool:
    """Whether `group_norm` handles this call; metadata only (no host sync)."""
    if not (triton_usable(x) and x.dim() == 5 and x.dtype in _DTYPES and x.numel() > 0):
        return False
    C = x.shape[1]
    if num_groups <= 0 or C % num_groups or C > MAX_CHANNELS:
        return False
    for p in (weight, bias):
        if p is not None and (p.shape != (C,) or p.device != x.device or p.dtype not in _DTYPES):
            return False
    return True


def _check(x, num_groups, weight, bias) -> None:
    if x.dim() != 5:
        raise ValueError(f"group_norm: x must be 5-D [N, C, D, H, W], got shape {tuple(x.shape)}")
    C = x.shape[1]
    if num_groups <= 0 or C % num_groups:
        raise ValueError(f"group_norm: num_groups={num_groups} must be positive and divide C={C}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (C,):
            raise ValueError(f"group_norm: {name} must have shape ({C},), got {tuple(p.shape)}")
    if not group_norm_supported(x, num_groups, weight, bias):
        raise ValueError(f"group_norm: unsupported call (device {x.device}, dtype {x.dtype}, "
                         f"shape {tuple(x.shape)}); check group_norm_supported first")


def group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], eps: float, relu: bool, *,
               out_dtype: Optional[torch.dtype] = None, room: int = 0) -> torch.Tensor:
    """F.group_norm(x, num_groups, weight, bias, eps), then F.relu when `relu`; autograd-aware.

    Returns the dtype F.group_norm would (fp32 under CUDA autocast) unless `out_dtype` is given: when
    the consumer is a bf16 convolution, writing bf16 here gives it the very bits its own cast would,
    with half the bytes written here and read by the backward. With `room` > 0 the output is the first
    C channels of a channels-last buffer of C + room channels (its `_base`), so that a later concat can
    write its other part next to it instead of copying this one (scaffold.kernels.concat, into_room):
    the same values. Not under torch.compile, which traces the registered op without room."""
    _check(x, num_groups, weight, bias)
    dtype = output_dtype(x) if out_dtype is None else out_dtype
    args = (x, weight, bias, num_groups, float(eps), bool(relu), dtype)
    if torch.compiler.is_compiling():  # the registered op, which torch.compile traces through
        return torch.ops.scaffold.group_norm_fwd(*args)[0]
    return _GroupNormFn.apply(*args, int(room))[0]
