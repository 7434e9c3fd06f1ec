"""The U-Net's tail in one pass each way: GroupNorm + ReLU, then the 1×1×1 head convolution (C -> K classes).

Run apart, the tail writes the normalized activation y (C channels at full resolution) for the head to
read, and the backward writes the head's input gradient dy (C channels) for the GroupNorm's backward to
read twice, and reads y again for the head's weight gradient. Here y and dy never reach memory:
forward: the GroupNorm's statistics (its own two launches), then per tile y = ReLU(GroupNorm(x)), rounded
  to the head's compute dtype as the separate ops would store it, and the K logits Σ_c y·W[k, c] + bias;
backward, from the logits' gradient dl (K channels, a tenth of C's bytes): per (sample, split) dy = dl·W
  (one dot over the classes, rounded as a stored dy would be), the GroupNorm's sums of g and g·x̂
  (g = dy where y passed the ReLU), the head's weight and bias gradient partials Σ dl·y and Σ dl; those
  merged in a fixed order (the GroupNorm's combine, and one for the head); then per tile dx from the
  same dy recomputed (same tile, same warps, so the same dot instruction and the same bits).
x and y are read as [N, S, C] through their strides (NDHWC or NCDHW). Every sum runs in a fixed order and
nothing is atomic, and the three tile kernels compile without floating-point contraction, so y and dy come
out the same bits wherever they are recomputed: bitwise reproducible. Not the separate ops' bits: the
logits and dy are summed over their K or C terms in another order than the convolution kernels sum them.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from torch.autograd.function import once_differentiable

from .lib.launch import launched
from .groupnorm import (_channel_params, _masked_grad, _store_partials, _tile_ptrs, group_norm_supported,
                        merge_grad_sums, plan_for, statistics)
from .conv.gather import dot_mode, mma
from .lib.device import triton_usable
from .lib.indexing import cdiv, next_pow2
from .lib.layout import empty_channels_last, flat_nsc, nsc_strides
from .lib.rounding import cast_rne, to_f32
from .lib.splits import chunk_range

MAX_CLASSES = 16  # the head's K: the kernels unroll over it
MAX_HEAD_CHANNELS = 256  # the head's C: one tile row holds all of a voxel's channels
# The backward's tile, the same in both of its passes (each recomputes dy with a dot, and one shape
# and one number of warps give one instruction, so the same bits): rows × C of about BWD_TILE
# elements on BWD_WARPS warps, at least 16 rows (a dot's). Few elements per thread keep the
# registers low enough for several programs per SM (the passes are latency-bound, not
# bandwidth-bound: sm90 compile at C = 64, 128 registers in the partials pass, 80 in dx).
BWD_TILE, BWD_WARPS, BWD_REDUCE_EACH = 2048, 4, True
_NO_FUSION = dict(enable_fp_fusion=False)


# --- pieces every tile kernel shares -----------------------------------------------------------------

@triton.jit
def _normalized(x, mean, rstd, w, b, Y_DTYPE: tl.constexpr):
    """ReLU(GroupNorm(x)) as the head reads it: rounded to Y_DTYPE (the stored y of the separate ops).
    The pre-ReLU expression is _masked_grad's, so the ReLU masks agree."""
    y = (x - mean[None, :]) * (rstd * w)[None, :] + b[None, :]
    y = tl.where(y < 0.0, 0.0, y)
    return cast_rne(y, Y_DTYPE)


@triton.jit
def _head_dy(dl, hw_ptr, C, K, Y_DTYPE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
             BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """dy = dl·W for a [BLOCK_S, BLOCK_K] tile of the logits' gradient (zero past K and past the
    tile's rows): one dot over the classes with fp32 accumulation, rounded to Y_DTYPE as the head's
    stored input gradient would be; fp32. Both kernels that recompute it run it on the same tile
    shape and warps, so they get the same bits."""
    ks = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_C)
    w = tl.load(hw_ptr + ks[:, None] * C + cols[None, :], mask=(ks < K)[:, None] & (cols < C)[None, :],
                other=0.0)
    dy = mma(dl, w.to(dl.dtype), tl.zeros([dl.shape[0], BLOCK_C], tl.float32), PRECISION, UPCAST)
    return to_f32(cast_rne(dy, Y_DTYPE))


# --- kernels --------------------------------------------------------------------------------------

@launched
@triton.jit
def _nh_fwd_kernel(x_ptr, lg_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, hw_ptr, hb_ptr, S, C, G, CG, K,
                   x_sn, x_ss, x_sc, l_sn, l_ss, l_sc,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_HB: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """The logits of one [BLOCK_S, C] tile of one sample: y = ReLU(GroupNorm(x)) as stored, then
    y·Wᵀ (+ bias) as a dot with fp32 accumulation, rounded once to the logits' dtype."""
    s0 = tl.program_id(0) * BLOCK_S
    n = tl.program_id(1)
    mean, rstd, w, b = _channel_params(mean_ptr, rstd_ptr, w_ptr, b_ptr, n, C, G, CG, HAS_W, HAS_B, BLOCK_C)
    xp, mask = _tile_ptrs(x_ptr + n.to(tl.int64) * x_sn, s0, S, C, x_ss, x_sc, BLOCK_S, BLOCK_C)
    y = _normalized(to_f32(tl.load(xp, mask=mask, other=0.0)), mean, rstd, w, b, lg_ptr.dtype.element_ty)
    ks = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_C)
    wt = tl.load(hw_ptr + ks[None, :] * C + cols[:, None], mask=(cols < C)[:, None] & (ks < K)[None, :],
                 other=0.0)  # [C, K]: the head's weight transposed
    logits = mma(y, wt.to(y.dtype), tl.zeros([BLOCK_S, BLOCK_K], tl.float32), PRECISION, UPCAST)
    if HAS_HB:
        logits += to_f32(tl.load(hb_ptr + ks, mask=ks < K, other=0.0))[None, :]
    lp, lmask = _tile_ptrs(lg_ptr + n.to(tl.int64) * l_sn, s0, S, K, l_ss, l_sc, BLOCK_S, BLOCK_K)
    tl.store(lp, cast_rne(logits, lg_ptr.dtype.element_ty), mask=lmask)


@launched
@triton.jit
def _nh_bwd_partials_kernel(x_ptr, dl_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, hw_ptr, pg_ptr, pgx_ptr, pw_ptr,
                            pb_ptr, S, C, G, CG, K, chunk, splits, x_sn, x_ss, x_sc, l_sn, l_ss, l_sc,
                            HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                            PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                            BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                            REDUCE_EACH: tl.constexpr):
    """Per (sample, split), grid (N, splits): each channel's Σ g and Σ g·x̂ (the GroupNorm's), and the
    head's Σ dl[k]·y[c] (a dot) and Σ dl[k], over the split's voxels. REDUCE_EACH sums each tile over
    its rows before adding it (per-channel accumulators, fewer registers), else the tiles are added
    elementwise and summed over rows at the end: a fixed order either way."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    start, end = chunk_range(split, chunk, S)
    mean, rstd, w, b = _channel_params(mean_ptr, rstd_ptr, w_ptr, b_ptr, n, C, G, CG, HAS_W, HAS_B, BLOCK_C)
    xbase = x_ptr + n.to(tl.int64) * x_sn
    lbase = dl_ptr + n.to(tl.int64) * l_sn
    ks = tl.arange(0, BLOCK_K)
    if REDUCE_EACH:
        acc_g = tl.zeros([BLOCK_C], tl.float32)
        acc_gx = tl.zeros([BLOCK_C], tl.float32)
        acc_b = tl.zeros([BLOCK_K], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
        acc_gx = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
        acc_b = tl.zeros([BLOCK_S, BLOCK_K], tl.float32)
    acc_w = tl.zeros([BLOCK_K, BLOCK_C], tl.float32)
    for s0 in range(start, end, BLOCK_S):
        xp, mask = _tile_ptrs(xbase, s0, end, C, x_ss, x_sc, BLOCK_S, BLOCK_C)
        lp, lmask = _tile_ptrs(lbase, s0, end, K, l_ss, l_sc, BLOCK_S, BLOCK_K)
        x = to_f32(tl.load(xp, mask=mask, other=0.0))
        dl = tl.load(lp, mask=lmask, other=0.0)  # rows past the split: dl = 0, so they add 0
        y = _normalized(x, mean, rstd, w, b, dl_ptr.dtype.element_ty)
        dy = _head_dy(dl, hw_ptr, C, K, dl_ptr.dtype.element_ty, PRECISION, UPCAST, BLOCK_C, BLOCK_K)
        xhat, g = _masked_grad(x, dy, mean, rstd, w, b, True)
        if REDUCE_EACH:
            acc_g += tl.sum(g, axis=0)
            acc_gx += tl.sum(g * xhat, axis=0)
            acc_b += tl.sum(to_f32(dl), axis=0)
        else:
            acc_g += g
            acc_gx += g * xhat
            acc_b += to_f32(dl)
        acc_w = mma(tl.trans(dl), y, acc_w, PRECISION, UPCAST)
    if not REDUCE_EACH:
        acc_g = tl.sum(acc_g, axis=0)
        acc_gx = tl.sum(acc_gx, axis=0)
        acc_b = tl.sum(acc_b, axis=0)
    _store_partials(pg_ptr, pgx_ptr, acc_g, acc_gx, n, split, splits, C, BLOCK_C)
    row = n * splits + split
    cols = tl.arange(0, BLOCK_C)
    tl.store(pw_ptr + (row * K + ks[:, None]) * C + cols[None, :], acc_w,
             mask=(ks < K)[:, None] & (cols < C)[None, :])
    tl.store(pb_ptr + row * K + ks, acc_b, mask=ks < K)


@launched
@triton.jit
def _nh_head_grads_kernel(pw_ptr, pb_ptr, dw_ptr, db_ptr, rows, K, C, HAS_HB: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """The head's weight gradient [K, C] (the last program also its bias gradient [K]): the rows'
    partials (samples × splits) added BLOCK_R rows at a time, then over those, in a fixed order."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    r = tl.arange(0, BLOCK_R)
    mask = offs < K * C
    acc = tl.zeros([BLOCK_R, BLOCK], tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        m = (r0 + r < rows)[:, None] & mask[None, :]
        acc += tl.load(pw_ptr + (r0 + r)[:, None] * (K * C) + offs[None, :], mask=m, other=0.0)
    tl.store(dw_ptr + offs, cast_rne(tl.sum(acc, axis=0), dw_ptr.dtype.element_ty), mask=mask)
    if HAS_HB:
        if pid == tl.num_programs(0) - 1:
            kmask = tl.arange(0, BLOCK) < K
            accb = tl.zeros([BLOCK_R, BLOCK], tl.float32)
            for r0 in range(0, rows, BLOCK_R):
                m = (r0 + r < rows)[:, None] & kmask[None, :]
                accb += tl.load(pb_ptr + (r0 + r)[:, None] * K + tl.arange(0, BLOCK)[None, :], mask=m, other=0.0)
            tl.store(db_ptr + tl.arange(0, BLOCK), cast_rne(tl.sum(accb, axis=0), db_ptr.dtype.element_ty),
                     mask=kmask)


@launched
@triton.jit
def _nh_bwd_dx_kernel(x_ptr, dl_ptr, dx_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, hw_ptr, c1_ptr, c2_ptr,
                      S, C, G, CG, K, x_sn, x_ss, x_sc, l_sn, l_ss, l_sc, o_sn, o_ss, o_sc,
                      HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """dx = rstd·(g·w − c1 − x̂·c2) over one [BLOCK_S, C] tile, dy recomputed from dl."""
    s0 = tl.program_id(0) * BLOCK_S
    n = tl.program_id(1)
    mean, rstd, w, b = _channel_params(mean_ptr, rstd_ptr, w_ptr, b_ptr, n, C, G, CG, HAS_W, HAS_B, BLOCK_C)
    cols = tl.arange(0, BLOCK_C)
    grp = n * G + cols // CG
    c1 = tl.load(c1_ptr + grp, mask=cols < C, other=0.0)
    c2 = tl.load(c2_ptr + grp, mask=cols < C, other=0.0)
    n64 = n.to(tl.int64)
    xp, mask = _tile_ptrs(x_ptr + n64 * x_sn, s0, S, C, x_ss, x_sc, BLOCK_S, BLOCK_C)
    op, _ = _tile_ptrs(dx_ptr + n64 * o_sn, s0, S, C, o_ss, o_sc, BLOCK_S, BLOCK_C)
    lp, lmask = _tile_ptrs(dl_ptr + n64 * l_sn, s0, S, K, l_ss, l_sc, BLOCK_S, BLOCK_K)
    x = to_f32(tl.load(xp, mask=mask, other=0.0))
    dy = _head_dy(tl.load(lp, mask=lmask, other=0.0), hw_ptr, C, K, dl_ptr.dtype.element_ty, PRECISION,
                  UPCAST, BLOCK_C, BLOCK_K)
    xhat, g = _masked_grad(x, dy, mean, rstd, w, b, True)
    dx = rstd[None, :] * (g * w[None, :] - c1[None, :] - xhat * c2[None, :])
    tl.store(op, cast_rne(dx, dx_ptr.dtype.element_ty), mask=mask)


# --- launchers ------------------------------------------------------------------------------------

def _block_k(K: int) -> int:
    return max(16, next_pow2(K))  # a dot's dimension: at least 16


def _dummy(t: Optional[torch.Tensor], other: torch.Tensor) -> torch.Tensor:
    return t if t is not None else other


def forward(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
            eps: float, head_weight: torch.Tensor, head_bias: Optional[torch.Tensor],
            out_dtype: torch.dtype):
    """(logits, mean, rstd): the head (K×C weight, any [K, C, 1, 1, 1] tensor) applied to
    ReLU(GroupNorm(x)) in `out_dtype` (the head's compute dtype), channels-last [N, K, D, H, W]."""
    N, C = x.shape[:2]
    K = head_weight.shape[0]
    S = x[0, 0].numel()
    G = num_groups
    x, (x_sn, x_ss, x_sc) = flat_nsc(x)
    plan = plan_for(N, C, S, G, x.device, x.dtype)
    hw = head_weight.reshape(K, C).contiguous()
    logits = empty_channels_last((N, K) + tuple(x.shape[2:]), out_dtype, x.device)
    mean, rstd = statistics(x, (x_sn, x_ss, x_sc), plan, G, eps)
    _nh_fwd_kernel[(plan.tiles, N)](
        x, logits, mean, rstd, _dummy(weight, mean), _dummy(bias, mean), hw, _dummy(head_bias, hw),
        S, C, G, C // G, K, x_sn, x_ss, x_sc, *nsc_strides(logits),
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_HB=head_bias is not None, **dot_mode(logits),
        BLOCK_S=max(16, plan.ew_block_s), BLOCK_C=max(16, plan.block_c), BLOCK_K=_block_k(K),
        num_warps=plan.ew_warps, **_NO_FUSION)
    return logits, mean, rstd


def backward(dl: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
             mean: torch.Tensor, rstd: torch.Tensor, num_groups: int, head_weight: torch.Tensor,
             head_bias: Optional[torch.Tensor]):
    """(dx, dweight, dbias, dhead_weight, dhead_bias); dl is the logits' gradient, in the logits' dtype
    (the dtype y and dy are rounded to). Parameter gradients come in their parameters' dtypes (fp32
    where a GroupNorm parameter is missing)."""
    N, C = x.shape[:2]
    K = head_weight.shape[0]
    S = x[0, 0].numel()
    G = num_groups
    x, (x_sn, x_ss, x_sc) = flat_nsc(x)
    dl, (l_sn, l_ss, l_sc) = flat_nsc(dl)
    plan = plan_for(N, C, S, G, x.device, x.dtype)
    hw = head_weight.reshape(K, C).contiguous()
    block_k = _block_k(K)
    block_c = max(16, plan.block_c)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last_3d)
    f32 = dict(dtype=torch.float32, device=x.device)
    pg = torch.empty((N, plan.splits, C), **f32)
    pgx = torch.empty((N, plan.splits, C), **f32)
    pw = torch.empty((N, plan.splits, K, C), **f32)
    pb = torch.empty((N, plan.splits, K), **f32)
    # The head weight's gradient in the weight's own strides (a channels-last [K, C, 1, 1, 1] weight has
    # strides (C, 1, C, C, C)): DDP compares a gradient's strides with its bucket's, size-1 dims included,
    # and warns on a mismatch. The kernel writes it through its dense [K, C] view.
    dhw_full = torch.empty_like(head_weight)
    dhb = torch.empty((K,), dtype=(head_bias if head_bias is not None else head_weight).dtype, device=x.device)
    w, b = _dummy(weight, mean), _dummy(bias, mean)
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, **dot_mode(dl))
    # Both passes recompute dy with a dot: the same tile and warps give the same instruction, so the
    # same bits in both.
    block_s = max(16, BWD_TILE // block_c)
    tile = dict(BLOCK_S=block_s, BLOCK_C=block_c, BLOCK_K=block_k, num_warps=BWD_WARPS, **_NO_FUSION)
    _nh_bwd_partials_kernel[(N, plan.splits)](
        x, dl, mean, rstd, w, b, hw, pg, pgx, pw, pb, S, C, G, C // G, K, plan.chunk, plan.splits,
        x_sn, x_ss, x_sc, l_sn, l_ss, l_sc, **flags, **tile, REDUCE_EACH=BWD_REDUCE_EACH)
    c1, c2, dw, db = merge_grad_sums(pg, pgx, weight, bias, plan, S, G)
    hblock = max(64, next_pow2(K))  # one program's columns (the bias's K included)
    _nh_head_grads_kernel[(cdiv(K * C, hblock),)](pw, pb, dhw_full.view(K, C), dhb, N * plan.splits, K, C,
                                                   HAS_HB=head_bias is not None, BLOCK_R=64, BLOCK=hblock,
                                                   num_warps=4)
    _nh_bwd_dx_kernel[(cdiv(S, block_s), N)](
        x, dl, dx, mean, rstd, w, b, hw, c1, c2, S, C, G, C // G, K,
        x_sn, x_ss, x_sc, l_sn, l_ss, l_sc, *nsc_strides(dx), **flags, **tile)
    return dx, dw, db, dhw_full, dhb


class _NormHeadFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, head_weight, head_bias, num_groups, eps, out_dtype):
        logits, mean, rstd = forward(x, num_groups, weight, bias, eps, head_weight, head_bias, out_dtype)
        ctx.save_for_backward(x, weight, bias, mean, rstd, head_weight, head_bias)
        ctx.num_groups = num_groups
        return logits

    @staticmethod
    @once_differentiable  # first-order, as the other Triton rungs
    def backward(ctx, dl):
        x, weight, bias, mean, rstd, hw, hb = ctx.saved_tensors
        dx, dw, db, dhw, dhb = backward(dl, x, weight, bias, mean, rstd, ctx.num_groups, hw, hb)
        return (dx, dw if weight is not None else None, db if bias is not None else None, dhw,
                dhb if hb is not None else None, None, None, None)


# --- public entry points --------------------------------------------------------------------------

def norm_head_supported(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor], head_weight: torch.Tensor,
                        head_bias: Optional[torch.Tensor]) -> bool:
    """Whether `norm_head` takes the call; metadata only."""
    if not (group_norm_supported(x, num_groups, weight, bias) and triton_usable(head_weight)):
        return False
    C = x.shape[1]
    hw = head_weight
    if (hw.dim() != 5 or tuple(hw.shape[1:]) != (C, 1, 1, 1) or not 1 <= hw.shape[0] <= MAX_CLASSES
            or C > MAX_HEAD_CHANNELS or hw.device != x.device or hw.dtype not in (torch.float32, torch.bfloat16,
                                                                                  torch.float16)):
        return False
    return head_bias is None or (head_bias.shape == (hw.shape[0],) and head_bias.device == x.device)


def norm_head(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
              eps: float, head_weight: torch.Tensor, head_bias: Optional[torch.Tensor],
              out_dtype: torch.dtype) -> torch.Tensor:
    """conv3d(ReLU(group_norm(x, num_groups, weight, bias, eps)), head_weight, head_bias) with the 1×1×1
    head computing in `out_dtype` (its weight and bias already in it, as autocast would cast them):
    the logits, channels-last, autograd-aware. See the module doc for what differs from the separate
    ops (the order of two sums) and what does not (every rounding they store)."""
    if not norm_head_supported(x, num_groups, weight, bias, head_weight, head_bias):
        raise ValueError(f"norm_head: unsupported call: x {tuple(x.shape)} {x.dtype} {x.device}, head weight "
                         f"{tuple(head_weight.shape)} {head_weight.dtype}; need a 1x1x1 head of at most "
                         f"{MAX_CLASSES} classes over at most {MAX_HEAD_CHANNELS} channels on one device")
    return _NormHeadFn.apply(x, weight, bias, head_weight, head_bias, int(num_groups), float(eps), out_dtype)
