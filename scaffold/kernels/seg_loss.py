"""The CE + soft Dice loss head (scaffold.loss.SegmentationLoss.terms) in three launches, deterministic.

With p = softmax(z) per voxel (fp32), y the label and w the class weights:
  CE   = Σ_v w[y_v]·(−log p_y(v)) / Σ_v w[y_v]                     over the whole batch
  dice = mean over foreground c of (2 I_nc + eps) / (P_nc + G_nc + eps), exactly 1 where G_nc = 0,
         I = Σ_v p_c·[y=c], P = Σ_v p_c, G = Σ_v [y=c]              per sample n
  loss = CE + (1 − mean_n dice_n)
Logits are viewed as [N, V, C] through their strides (NDHWC and NCDHW are read in place). Forward:
per (split of the voxels, sample) K = 2 + 3C fp32 partial sums; then one program adds them in a
fixed tree and computes the terms. Backward, one launch: dz per voxel tile, p recomputed. No atomics
and no host reads: the split count and the tree are pure functions of (N, V, C, device).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .lib.launch import launched
from .lib.device import arch_key, sm_count, triton_usable
from .lib.indexing import cdiv, next_pow2
from .lib.layout import flat_nsc, nsc_strides
from .lib.rounding import cast_rne, to_f32
from .lib.splits import chunk_range

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_CLASSES = 16


# --- kernels --------------------------------------------------------------------------------------

@triton.jit
def _store_sums(out, nll, wsum, inter, psum, gsum, cols, cmask, C):
    """One row of K = 2 + 3C sums: Σ w·nll, Σ w, then I, P, G per class (a split's partials or a
    sample's totals; the layout the finalize and the backward read)."""
    tl.store(out, nll)
    tl.store(out + 1, wsum)
    tl.store(out + 2 + cols, inter, mask=cmask)
    tl.store(out + 2 + C + cols, psum, mask=cmask)
    tl.store(out + 2 + 2 * C + cols, gsum, mask=cmask)


@triton.jit
def _grad_scales(sums_ptr, gl_ptr, gc_ptr, gd_ptr, n, N, K, C,
                 HAS_GL: tl.constexpr, HAS_GC: tl.constexpr, HAS_GD: tl.constexpr):
    """The backward's per-sample scalars from the saved sums and the incoming gradients: the CE factor
    s = (dL/dCE)/Σ w over the batch, and beta = dL/d(dice_n) spread over the C − 1 foreground classes."""
    w_total = tl.load(sums_ptr + 1)
    for m in range(1, N):  # the batch's Σ w, in sample order
        w_total += tl.load(sums_ptr + m * K + 1)
    g_loss = tl.load(gl_ptr) if HAS_GL else 0.0
    g_ce = tl.load(gc_ptr) if HAS_GC else 0.0
    g_dice = tl.load(gd_ptr + n) if HAS_GD else 0.0
    ce_scale = (g_loss + g_ce) / w_total
    beta = (g_dice - g_loss / N) / (C - 1)  # d(loss)/d(dice_n) = −g_loss/N; the mean over C − 1
    return ce_scale, beta


@triton.jit
def _zero_sums(BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    """Element-wise accumulators of a split's K sums: Σ w·nll and Σ w per voxel lane, then I, P, G per
    (voxel lane, class). Summed in registers, reduced once by `_store_partial_sums`: short fp32 sums,
    one fixed order."""
    nll = tl.zeros([BLOCK_V], tl.float32)
    wsum = tl.zeros([BLOCK_V], tl.float32)
    inter = tl.zeros([BLOCK_V, BLOCK_C], tl.float32)
    psum = tl.zeros([BLOCK_V, BLOCK_C], tl.float32)
    gsum = tl.zeros([BLOCK_V, BLOCK_C], tl.float32)
    return nll, wsum, inter, psum, gsum


@triton.jit
def _store_partial_sums(part_ptr, n, split, splits, K, nll, wsum, inter, psum, gsum, cols, cmask, C):
    """The accumulators of `_zero_sums`, reduced, to the split's own slot of the [N, splits, K] partials."""
    out = part_ptr + (n * splits + split).to(tl.int64) * K
    _store_sums(out, tl.sum(nll, axis=0), tl.sum(wsum, axis=0), tl.sum(inter, axis=0),
                tl.sum(psum, axis=0), tl.sum(gsum, axis=0), cols, cmask, C)


@triton.jit
def _softmax_tile(z_base, y_base, w, v0, end, C, z_sv, z_sc, y_sv,
                  BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    """One tile of voxels [v0, v0 + BLOCK_V) ∩ [.., end): log p, p (0 on padding columns), the one-hot
    target (false on padding rows), w[y] and the valid-element mask, all fp32 / bool."""
    rows = v0 + tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < end
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * z_sv + cols.to(tl.int64)[None, :] * z_sc
    z = to_f32(tl.load(z_base + offs, mask=mask, other=0.0))
    z = tl.where(cmask[None, :], z, float("-inf"))  # padding rows keep finite zeros: no NaN anywhere
    y = tl.load(y_base + rows.to(tl.int64) * y_sv, mask=rmask, other=0).to(tl.int32)
    onehot = (cols[None, :] == y[:, None]) & rmask[:, None]
    shifted = z - tl.max(z, axis=1)[:, None]
    logp = shifted - tl.log(tl.sum(tl.exp(shifted), axis=1))[:, None]
    p = tl.exp(logp)
    wy = tl.sum(tl.where(onehot, w[None, :], 0.0), axis=1)
    return logp, p, onehot, wy, mask, rmask


@launched
@triton.jit
def _loss_fwd_partials_kernel(z_ptr, y_ptr, w_ptr, part_ptr, V, C, K, chunk, splits,
                              z_sn, z_sv, z_sc, y_sn, y_sv,
                              BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    """The "tile" form's forward: walks the split's contiguous run of voxels in tiles [BLOCK_V,
    BLOCK_C], upcasts to fp32, takes max, log-sum-exp, log p_y and p, and accumulates K = 2 + 3C sums
    element-wise in registers: Σ w·nll, Σ w, and per class I, P, G. Stores them once, to its own slot
    of an fp32 partials buffer [N, splits, K]. Grid (splits, N); splits are many: a streaming
    reduction needs loads in flight."""
    split = tl.program_id(0)
    n = tl.program_id(1)
    start, end = chunk_range(split, chunk, V)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    z_base = z_ptr + n.to(tl.int64) * z_sn
    y_base = y_ptr + n.to(tl.int64) * y_sn
    nll, wsum, inter, psum, gsum = _zero_sums(BLOCK_V, BLOCK_C)
    for v0 in range(start, end, BLOCK_V):
        logp, p, onehot, wy, mask, rmask = _softmax_tile(z_base, y_base, w, v0, end, C, z_sv, z_sc,
                                                         y_sv, BLOCK_V, BLOCK_C)
        nll += -wy * tl.sum(tl.where(onehot, logp, 0.0), axis=1)
        wsum += wy
        inter += tl.where(onehot, p, 0.0)
        psum += tl.where(mask, p, 0.0)
        gsum += onehot.to(tl.float32)
    _store_partial_sums(part_ptr, n, split, splits, K, nll, wsum, inter, psum, gsum, cols, cmask, C)


@launched
@triton.jit
def _loss_finalize_kernel(part_ptr, sums_ptr, loss_ptr, ce_ptr, dice_ptr, N, C, K, splits, eps,
                          BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program: per sample, the split partials summed in a fixed order (the same tree every call),
    the sums stored for the backward, the sample's soft Dice; then CE and the loss over the batch."""
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    foreground = cmask & (cols >= 1)
    zero = tl.sum(tl.zeros([BLOCK_P], tl.float32), axis=0)
    nll_total = zero
    w_total = zero
    dice_total = zero
    for n in range(0, N):
        a_nll = tl.zeros([BLOCK_P], tl.float32)
        a_w = tl.zeros([BLOCK_P], tl.float32)
        a_i = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        a_p = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        a_g = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        for p0 in range(0, splits, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            pmask = p < splits
            row = part_ptr + (n * splits + p).to(tl.int64) * K
            m2 = pmask[:, None] & cmask[None, :]
            a_nll += tl.load(row, mask=pmask, other=0.0)
            a_w += tl.load(row + 1, mask=pmask, other=0.0)
            a_i += tl.load(row[:, None] + 2 + cols[None, :], mask=m2, other=0.0)
            a_p += tl.load(row[:, None] + 2 + C + cols[None, :], mask=m2, other=0.0)
            a_g += tl.load(row[:, None] + 2 + 2 * C + cols[None, :], mask=m2, other=0.0)
        nll = tl.sum(a_nll, axis=0)
        wsum = tl.sum(a_w, axis=0)
        inter = tl.sum(a_i, axis=0)
        psum = tl.sum(a_p, axis=0)
        gsum = tl.sum(a_g, axis=0)
        out = sums_ptr + n * K
        _store_sums(out, nll, wsum, inter, psum, gsum, cols, cmask, C)
        dice_c = tl.where(gsum > 0.0, (2.0 * inter + eps) / (psum + gsum + eps), 1.0)
        dice = tl.sum(tl.where(foreground, dice_c, 0.0), axis=0) / (C - 1)
        tl.store(dice_ptr + n, dice)
        nll_total += nll
        w_total += wsum
        dice_total += dice
    ce = nll_total / w_total
    tl.store(ce_ptr, ce)
    tl.store(loss_ptr, ce + (1.0 - dice_total / N))


@launched
@triton.jit
def _loss_bwd_kernel(z_ptr, y_ptr, w_ptr, sums_ptr, gl_ptr, gc_ptr, gd_ptr, dz_ptr, N, V, C, K, eps,
                     z_sn, z_sv, z_sc, y_sn, y_sv, d_sn, d_sv, d_sc,
                     HAS_GL: tl.constexpr, HAS_GC: tl.constexpr, HAS_GD: tl.constexpr,
                     BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    """The "tile" form's backward, one voxel tile per program. With the sample's coefficients, Dice
    part dL/dp_c(v) = A_nc·[y_v = c] + B_nc (zero for the background and for absent classes) and CE
    part s·w[y]·(p_c − [c = y]), s = (dL/dCE)/Σ w, it recomputes p for its tile and writes
    dz_c = s·w[y]·(p_c − [c = y]) + p_c·(a_c − Σ_j a_j·p_j), a = A·[y=c] + B, in the logits' dtype and
    layout."""
    v0 = tl.program_id(0) * BLOCK_V  # tiles on axis 0: grid axes 1 and 2 stop at 65535
    n = tl.program_id(1)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    # The per-sample coefficients, rebuilt by every program from the saved sums (a few dozen flops):
    # dL/dp_c(v) = a_c·[y_v = c] + b_c for the Dice part, s·w[y]·(p − onehot) for the CE part.
    ce_scale, beta = _grad_scales(sums_ptr, gl_ptr, gc_ptr, gd_ptr, n, N, K, C, HAS_GL, HAS_GC, HAS_GD)
    row = sums_ptr + n * K + 2
    inter = tl.load(row + cols, mask=cmask, other=0.0)
    gsum = tl.load(row + 2 * C + cols, mask=cmask, other=0.0)
    denom = tl.load(row + C + cols, mask=cmask, other=0.0) + gsum + eps
    present = (cols >= 1) & cmask & (gsum > 0.0)
    a_coef = tl.where(present, beta * 2.0 / denom, 0.0)
    b_coef = tl.where(present, -beta * (2.0 * inter + eps) / (denom * denom), 0.0)
    _logp, p, onehot, wy, mask, _rmask = _softmax_tile(
        z_ptr + n.to(tl.int64) * z_sn, y_ptr + n.to(tl.int64) * y_sn, w, v0, V, C, z_sv, z_sc, y_sv,
        BLOCK_V, BLOCK_C)
    g = onehot.to(tl.float32)
    a = a_coef[None, :] * g + b_coef[None, :]  # dL/dp_c of the Dice term
    ap = tl.sum(a * p, axis=1)
    dz = (ce_scale * wy)[:, None] * (p - g) + p * (a - ap[:, None])
    rows = v0 + tl.arange(0, BLOCK_V)
    offs = rows.to(tl.int64)[:, None] * d_sv + cols.to(tl.int64)[None, :] * d_sc
    tl.store(dz_ptr + n.to(tl.int64) * d_sn + offs, cast_rne(dz, dz_ptr.dtype.element_ty), mask=mask)


# --- the "rows" and "unrolled" forms: one voxel per lane, the classes unrolled at compile time ---------
# The "tile" kernels above hold a [voxels, next_pow2(C)] tile and reduce across the class axis (padded
# lanes, cross-lane shuffles). These hold one voxel per lane and loop over the C classes (a compile-time
# constant), re-reading the logits from L1: no padding, no shuffles. The rows forward still adds its
# per-class sums into [voxels, next_pow2(C)] accumulator tiles; the unrolled forward keeps each class's
# sums in per-lane scalars of its own (C <= 8), so no tile at all. Both share the backward. Same sums,
# same formulas; the floating-point order differs between forms, so each form is bitwise repeatable on
# its own.

@triton.jit
def _row_stats(zrow, rmask, z_sc, C: tl.constexpr):
    """Per voxel: the max logit m and ls = log Σ_c exp(z_c − m), so log p_c = (z_c − m) − ls."""
    m = to_f32(tl.load(zrow, mask=rmask, other=0.0))
    for c in tl.static_range(1, C):
        m = tl.maximum(m, to_f32(tl.load(zrow + c * z_sc, mask=rmask, other=0.0)))
    se = tl.zeros_like(m)
    for c in tl.static_range(C):
        se += tl.exp(to_f32(tl.load(zrow + c * z_sc, mask=rmask, other=0.0)) - m)
    return m, tl.log(se)


@launched
@triton.jit
def _loss_fwd_partials_rows_kernel(z_ptr, y_ptr, w_ptr, part_ptr, V, K, chunk, splits,
                                   z_sn, z_sv, z_sc, y_sn, y_sv,
                                   C: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    split = tl.program_id(0)
    n = tl.program_id(1)
    start, end = chunk_range(split, chunk, V)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    z_base = z_ptr + n.to(tl.int64) * z_sn
    y_base = y_ptr + n.to(tl.int64) * y_sn
    nll, wsum, inter, psum, gsum = _zero_sums(BLOCK_V, BLOCK_C)
    for v0 in range(start, end, BLOCK_V):
        rows = v0 + tl.arange(0, BLOCK_V)
        rmask = rows < end
        zrow = z_base + rows.to(tl.int64) * z_sv
        y = tl.load(y_base + rows.to(tl.int64) * y_sv, mask=rmask, other=0).to(tl.int32)
        valid = rmask & (y >= 0) & (y < C)  # another label adds nothing, as in the tile form
        m, ls = _row_stats(zrow, rmask, z_sc, C)
        zy = to_f32(tl.load(zrow + y.to(tl.int64) * z_sc, mask=valid, other=0.0))
        wy = tl.load(w_ptr + y, mask=valid, other=0.0)
        logp_y = (zy - m) - ls
        nll += tl.where(valid, -wy * logp_y, 0.0)
        wsum += wy
        onehot = (cols[None, :] == y[:, None]) & valid[:, None]
        inter += tl.where(onehot, tl.exp(logp_y)[:, None], 0.0)
        gsum += onehot.to(tl.float32)
        mask2 = rmask[:, None] & cmask[None, :]
        z2 = to_f32(tl.load(zrow[:, None] + cols.to(tl.int64)[None, :] * z_sc, mask=mask2, other=0.0))
        psum += tl.where(mask2, tl.exp((z2 - m[:, None]) - ls[:, None]), 0.0)
    _store_partial_sums(part_ptr, n, split, splits, K, nll, wsum, inter, psum, gsum, cols, cmask, C)


@triton.jit
def _class_sums(acc_i, acc_p, acc_g, zrow, rmask, valid, y, m, ls, z_sc, c: tl.constexpr,
                C: tl.constexpr):
    """Adds class c's p·[y=c], p and [y=c] of one tile to its per-lane accumulators (a no-op past C)."""
    if c < C:
        p = tl.exp((to_f32(tl.load(zrow + c * z_sc, mask=rmask, other=0.0)) - m) - ls)
        hit = valid & (y == c)
        acc_i += tl.where(hit, p, 0.0)
        acc_p += tl.where(rmask, p, 0.0)
        acc_g += hit.to(tl.float32)
    return acc_i, acc_p, acc_g


@triton.jit
def _store_class_sums(out, acc_i, acc_p, acc_g, c: tl.constexpr, C: tl.constexpr):
    if c < C:
        tl.store(out + 2 + c, tl.sum(acc_i, axis=0))
        tl.store(out + 2 + C + c, tl.sum(acc_p, axis=0))
        tl.store(out + 2 + 2 * C + c, tl.sum(acc_g, axis=0))


@launched
@triton.jit
def _loss_fwd_partials_unrolled_kernel(z_ptr, y_ptr, w_ptr, part_ptr, V, K, chunk, splits,
                                       z_sn, z_sv, z_sc, y_sn, y_sv,
                                       C: tl.constexpr, BLOCK_V: tl.constexpr):
    """The rows form's forward with every per-class sum in its own per-lane accumulator (C <= 8): no
    [voxels, classes] tile at all. The accumulators are spelled out: Triton has no arrays."""
    split = tl.program_id(0)
    n = tl.program_id(1)
    start, end = chunk_range(split, chunk, V)
    z_base = z_ptr + n.to(tl.int64) * z_sn
    y_base = y_ptr + n.to(tl.int64) * y_sn
    nll = tl.zeros([BLOCK_V], tl.float32)
    wsum = tl.zeros([BLOCK_V], tl.float32)
    i0 = tl.zeros([BLOCK_V], tl.float32)
    p0 = tl.zeros([BLOCK_V], tl.float32)
    g0 = tl.zeros([BLOCK_V], tl.float32)
    i1, p1, g1 = i0, p0, g0
    i2, p2, g2 = i0, p0, g0
    i3, p3, g3 = i0, p0, g0
    i4, p4, g4 = i0, p0, g0
    i5, p5, g5 = i0, p0, g0
    i6, p6, g6 = i0, p0, g0
    i7, p7, g7 = i0, p0, g0
    for v0 in range(start, end, BLOCK_V):
        rows = v0 + tl.arange(0, BLOCK_V)
        rmask = rows < end
        zrow = z_base + rows.to(tl.int64) * z_sv
        y = tl.load(y_base + rows.to(tl.int64) * y_sv, mask=rmask, other=0).to(tl.int32)
        valid = rmask & (y >= 0) & (y < C)
        m, ls = _row_stats(zrow, rmask, z_sc, C)
        zy = to_f32(tl.load(zrow + y.to(tl.int64) * z_sc, mask=valid, other=0.0))
        wy = tl.load(w_ptr + y, mask=valid, other=0.0)
        nll += tl.where(valid, -wy * ((zy - m) - ls), 0.0)
        wsum += wy
        i0, p0, g0 = _class_sums(i0, p0, g0, zrow, rmask, valid, y, m, ls, z_sc, 0, C)
        i1, p1, g1 = _class_sums(i1, p1, g1, zrow, rmask, valid, y, m, ls, z_sc, 1, C)
        i2, p2, g2 = _class_sums(i2, p2, g2, zrow, rmask, valid, y, m, ls, z_sc, 2, C)
        i3, p3, g3 = _class_sums(i3, p3, g3, zrow, rmask, valid, y, m, ls, z_sc, 3, C)
        i4, p4, g4 = _class_sums(i4, p4, g4, zrow, rmask, valid, y, m, ls, z_sc, 4, C)
        i5, p5, g5 = _class_sums(i5, p5, g5, zrow, rmask, valid, y, m, ls, z_sc, 5, C)
        i6, p6, g6 = _class_sums(i6, p6, g6, zrow, rmask, valid, y, m, ls, z_sc, 6, C)
        i7, p7, g7 = _class_sums(i7, p7, g7, zrow, rmask, valid, y, m, ls, z_sc, 7, C)
    out = part_ptr + (n * splits + split).to(tl.int64) * K
    tl.store(out, tl.sum(nll, axis=0))
    tl.store(out + 1, tl.sum(wsum, axis=0))
    _store_class_sums(out, i0, p0, g0, 0, C)
    _store_class_sums(out, i1, p1, g1, 1, C)
    _store_class_sums(out, i2, p2, g2, 2, C)
    _store_class_sums(out, i3, p3, g3, 3, C)
    _store_class_sums(out, i4, p4, g4, 4, C)
    _store_class_sums(out, i5, p5, g5, 5, C)
    _store_class_sums(out, i6, p6, g6, 6, C)
    _store_class_sums(out, i7, p7, g7, 7, C)


@triton.jit
def _dice_coef(sums_ptr, n, K, beta, eps, c: tl.constexpr, C: tl.constexpr):
    """(A_c, B_c) of sample n: dL/dp_c = A_c·[y = c] + B_c from the Dice term (0, 0 for the background
    and for a class absent from the sample)."""
    row = sums_ptr + n * K + 2
    inter = tl.load(row + c)
    gsum = tl.load(row + 2 * C + c)
    denom = tl.load(row + C + c) + gsum + eps
    present = (gsum > 0.0) & (c >= 1)
    a = tl.where(present, beta * 2.0 / denom, 0.0)
    b = tl.where(present, -beta * (2.0 * inter + eps) / (denom * denom), 0.0)
    return a, b


@launched
@triton.jit
def _loss_bwd_rows_kernel(z_ptr, y_ptr, w_ptr, sums_ptr, gl_ptr, gc_ptr, gd_ptr, dz_ptr, N, V, K, eps,
                          z_sn, z_sv, z_sc, y_sn, y_sv, d_sn, d_sv, d_sc,
                          HAS_GL: tl.constexpr, HAS_GC: tl.constexpr, HAS_GD: tl.constexpr,
                          C: tl.constexpr, BLOCK_V: tl.constexpr):
    v0 = tl.program_id(0) * BLOCK_V
    n = tl.program_id(1)
    ce_scale, beta = _grad_scales(sums_ptr, gl_ptr, gc_ptr, gd_ptr, n, N, K, C, HAS_GL, HAS_GC, HAS_GD)
    rows = v0 + tl.arange(0, BLOCK_V)
    rmask = rows < V
    n64 = n.to(tl.int64)
    zrow = z_ptr + n64 * z_sn + rows.to(tl.int64) * z_sv
    drow = dz_ptr + n64 * d_sn + rows.to(tl.int64) * d_sv
    y = tl.load(y_ptr + n64 * y_sn + rows.to(tl.int64) * y_sv, mask=rmask, other=0).to(tl.int32)
    valid = rmask & (y >= 0) & (y < C)
    m, ls = _row_stats(zrow, rmask, z_sc, C)
    wy = tl.load(w_ptr + y, mask=valid, other=0.0)
    ap = tl.zeros([BLOCK_V], tl.float32)  # Σ_j a_j·p_j
    for c in tl.static_range(C):
        a_c, b_c = _dice_coef(sums_ptr, n, K, beta, eps, c, C)
        g = (valid & (y == c)).to(tl.float32)
        p = tl.exp((to_f32(tl.load(zrow + c * z_sc, mask=rmask, other=0.0)) - m) - ls)
        ap += (a_c * g + b_c) * p
    cs = ce_scale * wy
    for c in tl.static_range(C):
        a_c, b_c = _dice_coef(sums_ptr, n, K, beta, eps, c, C)
        g = (valid & (y == c)).to(tl.float32)
        p = tl.exp((to_f32(tl.load(zrow + c * z_sc, mask=rmask, other=0.0)) - m) - ls)
        dz = cs * (p - g) + p * ((a_c * g + b_c) - ap)
        tl.store(drow + c * d_sc, cast_rne(dz, dz_ptr.dtype.element_ty), mask=rmask)


# --- launch geometry --------------------------------------------------------------------------------

FORMS = ("tile", "rows", "unrolled")
UNROLLED_MAX_CLASSES = 8  # the "unrolled" forward spells out 8 accumulator sets


@dataclass(frozen=True)
class LossTile:
    """Launch shape of the passes: `voxels` per tile (BLOCK_V) on `warps` warps, about `per_sm` forward
    split programs per multiprocessor, and the forward's `form`: "tile", "rows" or "unrolled" (see the
    kernels; the last two share the rows backward)."""
    voxels: int
    warps: int
    per_sm: int
    form: str = "tile"

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"seg_loss tile form {self.form!r}: expected one of {FORMS}")


# arch -> tile. Filled from `python -m scaffold.bench.tune_loss` sweeps; other devices use the heuristic.
TILE_TABLE: dict[str, LossTile] = {
    # H200, 2026-12-02, 128³ × 6 classes bf16, device time of forward + backward: the unrolled form
    # (128 voxels, 4 warps, ~8 split programs per SM) 81.5 µs (forward 32.3, backward 49.2); the rows
    # form's best (128, 4, 16) 106.1 µs (forward 56.9); the best tile-form plan (32, 2, 16) 168 µs.
    "sm90": LossTile(128, 4, 8, "unrolled"),
}


def _heuristic_tile(arch: str, block_c: int) -> LossTile:
    if arch == "cpu":
        return LossTile(max(16, 256 // block_c), 4, 4)  # the interpreter pays per tile, not per element
    # As measured on sm90 (the table): one voxel per lane, per-class sums in per-lane accumulators (the
    # plan takes the rows forward past 8 classes), enough split programs to keep loads in flight.
    return LossTile(128, 4, 8, "unrolled")


class Plan:
    """Tile and split sizes of one call: a pure function of (N, V, C, device) and an optional tile
    override (tests use tiny tiles to get many splits at tiny shapes)."""

    def __init__(self, N: int, V: int, C: int, device: torch.device, block_v: Optional[int] = None,
                 tile: Optional[LossTile] = None):
        self.block_c = next_pow2(C)
        arch = arch_key(device)
        t = tile or TILE_TABLE.get(arch) or _heuristic_tile(arch, self.block_c)
        self.num_warps, self.form = t.warps, t.form
        if self.form == "unrolled" and C > UNROLLED_MAX_CLASSES:
            self.form = "rows"  # the same backward, and a forward with its per-class sums in a tile
        self.block_v = block_v or t.voxels
        self.k = 2 + 3 * C
        steps = cdiv(V, self.block_v)
        # Splits per sample: about per_sm programs per multiprocessor over the batch, each walking at
        # least two tiles. A pure function of shape and device, so the fixed summation order is too.
        splits = max(1, min(cdiv(t.per_sm * sm_count(device), N), steps // 2))
        self.chunk = cdiv(steps, splits) * self.block_v
        self.splits = cdiv(V, self.chunk)
        self.tiles = steps
        self.block_p = max(16, min(next_pow2(self.splits), 512 if device.type == "cuda"
                                   else 16))


def _label_view(labels: torch.Tensor) -> torch.Tensor:
    """Labels as [N, V]: a view when D, H, W collapse (the usual contiguous case), else a copy. uint8
    labels (what the trainer passes) are read as such: a quarter of int64's bytes."""
    return labels.reshape(labels.shape[0], -1)


# --- launchers (tests call these directly, e.g. with a NaN-poisoned `out`) ---------------------------

def forward(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, eps: float,
            block_v: Optional[int] = None, tile: Optional[LossTile] = None):
    """(loss, ce, dice (N,), sums [N, K]); K = 2 + 3C: Σ w·nll, Σ w, then I, P, G per class. Two launches:
    the split partials, then one program for the fixed-order sums and the terms."""
    N, C = logits.shape[:2]
    # V = D·H·W flattened: NDHWC and NCDHW work without a copy; other layouts are first made
    # channels-last.
    z, (z_sn, z_sv, z_sc) = flat_nsc(logits)
    y = _label_view(labels)
    V = y.shape[1]
    plan = Plan(N, V, C, logits.device, block_v, tile)
    f32 = dict(dtype=torch.float32, device=logits.device)
    partials = torch.empty((N, plan.splits, plan.k), **f32)
    sums = torch.empty((N, plan.k), **f32)
    loss, ce, dice = torch.empty((), **f32), torch.empty((), **f32), torch.empty((N,), **f32)
    if plan.form == "unrolled":
        _loss_fwd_partials_unrolled_kernel[(plan.splits, N)](
            z, y, weight, partials, V, plan.k, plan.chunk, plan.splits, z_sn, z_sv, z_sc,
            y.stride(0), y.stride(1), C=C, BLOCK_V=plan.block_v, num_warps=plan.num_warps)
    elif plan.form == "rows":
        _loss_fwd_partials_rows_kernel[(plan.splits, N)](
            z, y, weight, partials, V, plan.k, plan.chunk, plan.splits, z_sn, z_sv, z_sc,
            y.stride(0), y.stride(1), C=C, BLOCK_V=plan.block_v, BLOCK_C=plan.block_c,
            num_warps=plan.num_warps)
    else:
        _loss_fwd_partials_kernel[(plan.splits, N)](
            z, y, weight, partials, V, C, plan.k, plan.chunk, plan.splits, z_sn, z_sv, z_sc,
            y.stride(0), y.stride(1), BLOCK_V=plan.block_v, BLOCK_C=plan.block_c,
            num_warps=plan.num_warps)
    _loss_finalize_kernel[(1,)](partials, sums, loss, ce, dice, N, C, plan.k, plan.splits, float(eps),
                                BLOCK_P=plan.block_p, BLOCK_C=plan.block_c, num_warps=4)
    return loss, ce, dice, sums


def empty_grad_like(logits: torch.Tensor) -> torch.Tensor:
    """A gradient buffer with the logits' dtype and layout (channels-last in, channels-last out)."""
    if logits.is_contiguous():
        return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device,
                       memory_format=torch.channels_last_3d)


def backward(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor,
             eps: float, g_loss: Optional[torch.Tensor], g_ce: Optional[torch.Tensor],
             g_dice: Optional[torch.Tensor], out: Optional[torch.Tensor] = None,
             block_v: Optional[int] = None, tile: Optional[LossTile] = None) -> torch.Tensor:
    """dL/dlogits for L = g_loss·loss + g_ce·ce + Σ_n g_dice[n]·dice[n] (None: no such term), in the
    logits' dtype and layout. One launch: each program rebuilds the per-sample coefficients itself.
    The incoming gradients (0-d and (N,) device tensors, or None for an unused output) are read on
    the device, so nothing is read on the host."""
    N, C = logits.shape[:2]
    z, (z_sn, z_sv, z_sc) = flat_nsc(logits)
    y = _label_view(labels)
    V = y.shape[1]
    plan = Plan(N, V, C, logits.device, block_v, tile)
    dz = empty_grad_like(logits) if out is None else out
    d_sn, d_sv, d_sc = nsc_strides(dz)
    gl, gc, gd = (t.detach().to(torch.float32).contiguous() if t is not None else sums
                  for t in (g_loss, g_ce, g_dice))
    flags = dict(HAS_GL=g_loss is not None, HAS_GC=g_ce is not None, HAS_GD=g_dice is not None)
    if plan.form in ("rows", "unrolled"):
        _loss_bwd_rows_kernel[(plan.tiles, N)](
            z, y, weight, sums, gl, gc, gd, dz, N, V, plan.k, float(eps), z_sn, z_sv, z_sc,
            y.stride(0), y.stride(1), d_sn, d_sv, d_sc, **flags, C=C, BLOCK_V=plan.block_v,
            num_warps=plan.num_warps)
    else:
        _loss_bwd_kernel[(plan.tiles, N)](
            z, y, weight, sums, gl, gc, gd, dz, N, V, C, plan.k, float(eps), z_sn, z_sv, z_sc,
            y.stride(0), y.stride(1), d_sn, d_sv, d_sc, **flags,
            BLOCK_V=plan.block_v, BLOCK_C=plan.block_c, num_warps=plan.num_warps)
    return dz


# --- autograd ---------------------------------------------------------------------------------------

class _SegLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, weight, eps, block_v, tile):
        loss, ce, dice, sums = forward(logits, labels, weight, eps, block_v, tile)
        ctx.save_for_backward(logits, labels, weight, sums)
        ctx.eps, ctx.block_v, ctx.tile = eps, block_v, tile
        ctx.set_materialize_grads(False)  # unused outputs pass None: no zero tensors to launch
        return loss, ce, dice

    @staticmethod
    def backward(ctx, g_loss, g_ce, g_dice):
        if g_loss is None and g_ce is None and g_dice is None:
            return None, None, None, None, None, None
        logits, labels, weight, sums = ctx.saved_tensors
        dz = backward(logits, labels, weight, sums, ctx.eps, g_loss, g_ce, g_dice, block_v=ctx.block_v,
                      tile=ctx.tile)
        return dz, None, None, None, None, None


# --- public entry points ----------------------------------------------------------------------------

def seg_loss_supported(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `seg_loss_terms` handles this call; metadata only (no host sync)."""
    return (triton_usable(logits) and logits.dim() == 5 and logits.dtype in _DTYPES
            and 2 <= logits.shape[1] <= MAX_CLASSES and logits.numel() > 0
            and labels.dim() == 4 and labels.device == logits.device
            and not labels.is_floating_point() and not labels.is_complex() and labels.dtype != torch.bool
            and labels.shape[0] == logits.shape[0] and labels.shape[1:] == logits.shape[2:]
            and weight.dim() == 1 and weight.numel() == logits.shape[1] and weight.device == logits.device)


def _check(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> None:
    if logits.dim() != 5 or labels.dim() != 4 or logits.shape[0] != labels.shape[0] \
            or logits.shape[2:] != labels.shape[1:]:
        raise ValueError(f"seg_loss: logits {tuple(logits.shape)} do not match labels "
                         f"{tuple(labels.shape)}: expected (N, C, D, H, W) and (N, D, H, W)")
    if weight.dim() != 1 or weight.numel() != logits.shape[1]:
        raise ValueError(f"seg_loss: weight must have shape ({logits.shape[1]},) (one per class), "
                         f"got {tuple(weight.shape)}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"seg_loss: labels must be an integer tensor (uint8 or int64), got {labels.dtype}")
    if not seg_loss_supported(logits, labels, weight):
        raise ValueError(f"seg_loss: unsupported call (device {logits.device}, dtype {logits.dtype}, "
                         f"{logits.shape[1]} classes, labels on {labels.device}, weight on "
                         f"{weight.device}); check seg_loss_supported first")


def seg_loss_terms(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, eps: float,
                   *, block_v: Optional[int] = None, tile: Optional[LossTile] = None):
    """(loss, ce, soft Dice per sample (N,)) as SegmentationLoss.terms gives them: fp32 device tensors,
    differentiable with respect to the logits. `block_v` and `tile` override the plan (tests and
    benchmarks only).

    Labels must lie in [0, C): a voxel with any other label adds nothing (the eager head would fail
    on it); check a dataset once with scaffold.loss.check_labels."""
    _check(logits, labels, weight)
    w = weight.detach().to(torch.float32).contiguous()
    return _SegLossFunction.apply(logits, labels, w, float(eps), block_v, tile)
