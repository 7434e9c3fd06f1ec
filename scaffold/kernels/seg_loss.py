"""The CE + soft Dice loss head fused into two voxel passes (forward and backward), deterministic.

The function is scaffold.loss.SegmentationLoss.terms: with p = softmax(z) per voxel (fp32), y the label,
  CE   = Σ_v w[y_v]·(−log p_y(v)) / Σ_v w[y_v]                     over the whole batch
  dice = mean over foreground c of (2 I_nc + eps) / (P_nc + G_nc + eps), exactly 1 where G_nc = 0,
         I = Σ_v p_c·[y=c], P = Σ_v p_c, G = Σ_v [y=c]              per sample n
  loss = CE + (1 − mean_n dice_n)

Forward. Logits are viewed as [N, V, C] through strides (V = D·H·W flattened: NDHWC and NCDHW both work
without a copy; other layouts are first made channels-last). Grid (splits, N): each program walks its
contiguous run of voxels in tiles [BLOCK_V, BLOCK_C], upcasts to fp32, takes max, log-sum-exp, log p_y and
p, and accumulates element-wise in registers K = 2 + 3C sums: Σ w·nll, Σ w, and per class I, P, G. It
stores them once, to its own slot of an fp32 partials buffer [splits, N, K]; `splits.sum_splits` adds
the slots in index order. The few remaining operations (CE, per-class Dice, loss) are torch ops on
[N, K] device tensors. No atomics and no host reads: the split count is a pure function of (N, V, C,
device), so the bits are too.

Backward (autograd). From the saved sums, per (n, c) coefficients are built on the device so that
dL/dp_c(v) = A_nc·[y_v = c] + B_nc (the Dice part; zero for the background and for absent classes,
as torch.where gives) and the CE part is s·w[y]·(p_c − [c = y]) with s = (dL/dCE)/Σ w. One pass over the
voxels recomputes p and writes dz_c = s·w[y]·(p_c − [c = y]) + p_c·(a_c − Σ_j a_j·p_j), a = A·[y=c] + B,
in the logits' dtype and layout. The incoming gradients (0-d and (N,) device tensors) are folded into
A, B and s, so nothing is read on the host.

Labels must lie in [0, C): a voxel with any other label adds nothing (the eager head would fail on it);
check a dataset once with scaffold.loss.check_labels.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import triton_usable
# The bf16 widening and round-to-nearest-even store that survive Triton's CPU interpreter, and the
# [N, S, C] stride view of a 5-D tensor: shared with the GroupNorm kernels.
from .nsc import cast_rne, flat_nsc, nsc_strides, to_f32
from .splits import split_count, sum_splits

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_CLASSES = 16


# --- kernels --------------------------------------------------------------------------------------

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


@triton.jit
def _fwd_partials_kernel(z_ptr, y_ptr, w_ptr, part_ptr, N, V, C, K, chunk,
                         z_sn, z_sv, z_sc, y_sn, y_sv,
                         BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    split = tl.program_id(0)
    n = tl.program_id(1)
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    z_base = z_ptr + n.to(tl.int64) * z_sn
    y_base = y_ptr + n.to(tl.int64) * y_sn
    # Element-wise accumulators, reduced once at the end: short fp32 sums, one fixed order.
    nll = tl.zeros([BLOCK_V], tl.float32)
    wsum = tl.zeros([BLOCK_V], tl.float32)
    inter = tl.zeros([BLOCK_V, BLOCK_C], tl.float32)
    psum = tl.zeros([BLOCK_V, BLOCK_C], tl.float32)
    gsum = tl.zeros([BLOCK_V, BLOCK_C], tl.float32)
    for v0 in range(start, end, BLOCK_V):
        logp, p, onehot, wy, mask, rmask = _softmax_tile(z_base, y_base, w, v0, end, C, z_sv, z_sc,
                                                         y_sv, BLOCK_V, BLOCK_C)
        nll += -wy * tl.sum(tl.where(onehot, logp, 0.0), axis=1)
        wsum += wy
        inter += tl.where(onehot, p, 0.0)
        psum += tl.where(mask, p, 0.0)
        gsum += onehot.to(tl.float32)
    out = part_ptr + (split * N + n).to(tl.int64) * K
    tl.store(out, tl.sum(nll, axis=0))
    tl.store(out + 1, tl.sum(wsum, axis=0))
    tl.store(out + 2 + cols, tl.sum(inter, axis=0), mask=cmask)
    tl.store(out + 2 + C + cols, tl.sum(psum, axis=0), mask=cmask)
    tl.store(out + 2 + 2 * C + cols, tl.sum(gsum, axis=0), mask=cmask)


@triton.jit
def _bwd_kernel(z_ptr, y_ptr, w_ptr, coef_ptr, scale_ptr, dz_ptr, V, C,
                z_sn, z_sv, z_sc, y_sn, y_sv, d_sn, d_sv, d_sc,
                BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    v0 = tl.program_id(0) * BLOCK_V  # tiles on axis 0: grid axes 1 and 2 stop at 65535
    n = tl.program_id(1)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    a_coef = tl.load(coef_ptr + (2 * n) * C + cols, mask=cmask, other=0.0)
    b_coef = tl.load(coef_ptr + (2 * n + 1) * C + cols, mask=cmask, other=0.0)
    ce_scale = tl.load(scale_ptr)
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


# --- launch geometry --------------------------------------------------------------------------------

class Plan:
    """Tile and split sizes of one call: a pure function of (N, V, C, device) and an optional tile
    override (tests use tiny tiles to get many splits at tiny shapes)."""

    def __init__(self, N: int, V: int, C: int, device: torch.device, block_v: Optional[int] = None):
        self.block_c = triton.next_power_of_2(C)
        elems = 2048 if device.type == "cuda" else 256  # the interpreter pays per tile, not per element
        self.block_v = block_v or max(16, elems // self.block_c)
        self.num_warps = 4
        self.k = 2 + 3 * C
        steps = triton.cdiv(V, self.block_v)
        splits = split_count(device, N, steps, N * self.k)
        self.chunk = triton.cdiv(steps, splits) * self.block_v
        self.splits = triton.cdiv(V, self.chunk)
        self.tiles = steps


def _label_view(labels: torch.Tensor) -> torch.Tensor:
    """Labels as [N, V]: a view when D, H, W collapse (the usual contiguous case), else a copy."""
    return labels.reshape(labels.shape[0], -1)


# --- launchers (tests call these directly, e.g. with a NaN-poisoned `out`) ---------------------------

def forward_sums(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                 block_v: Optional[int] = None) -> torch.Tensor:
    """The per-sample sums [N, K] (K = 2 + 3C: Σ w·nll, Σ w, then I, P, G per class), fp32."""
    N, C = logits.shape[:2]
    z, (z_sn, z_sv, z_sc) = flat_nsc(logits)
    y = _label_view(labels)
    V = y.shape[1]
    plan = Plan(N, V, C, logits.device, block_v)
    partials = torch.empty((plan.splits, N * plan.k), dtype=torch.float32, device=logits.device)
    _fwd_partials_kernel[(plan.splits, N)](
        z, y, weight, partials, N, V, C, plan.k, plan.chunk, z_sn, z_sv, z_sc, y.stride(0), y.stride(1),
        BLOCK_V=plan.block_v, BLOCK_C=plan.block_c, num_warps=plan.num_warps)
    sums = torch.empty((N, plan.k), dtype=torch.float32, device=logits.device)
    sum_splits(partials, sums.view(-1))
    return sums


def _class_sums(sums: torch.Tensor, C: int):
    """(I, P, G) of the foreground classes, each [N, C − 1]."""
    return tuple(sums[:, 2 + j * C + 1: 2 + (j + 1) * C] for j in range(3))


def terms_from_sums(sums: torch.Tensor, C: int, eps: float):
    """(loss, ce, dice (N,)) from the per-sample sums; tiny device ops, no host reads."""
    ce = sums[:, 0].sum() / sums[:, 1].sum()
    inter, psum, gsum = _class_sums(sums, C)
    dice = (2 * inter + eps) / (psum + gsum + eps)
    dice = torch.where(gsum > 0, dice, torch.ones_like(dice)).mean(1)
    return ce + (1 - dice.mean()), ce, dice


def backward_coefficients(sums: torch.Tensor, C: int, eps: float, g_loss: torch.Tensor,
                          g_ce: torch.Tensor, g_dice: torch.Tensor):
    """(coef [N, 2, C], ce_scale [1]): dL/dp_c(v) = coef[n, 0, c]·[y_v = c] + coef[n, 1, c] for the Dice
    terms, and the CE gradient's factor (dL/dCE)/Σ w."""
    N = sums.shape[0]
    ce_scale = ((g_loss + g_ce) / sums[:, 1].sum()).reshape(1)
    inter, psum, gsum = _class_sums(sums, C)
    # d(loss)/d(dice_n) = −g_loss/N, plus dice_n's own incoming gradient; dice_n averages C − 1 classes.
    beta = ((g_dice - g_loss / N) / (C - 1)).reshape(N, 1)
    denom = psum + gsum + eps
    zero = torch.zeros_like(denom)
    a = torch.where(gsum > 0, beta * 2 / denom, zero)
    b = torch.where(gsum > 0, -beta * (2 * inter + eps) / (denom * denom), zero)
    background = sums.new_zeros((N, 1))
    coef = torch.stack([torch.cat([background, a], 1), torch.cat([background, b], 1)], 1)
    return coef.contiguous(), ce_scale.contiguous()


def empty_grad_like(logits: torch.Tensor) -> torch.Tensor:
    """A gradient buffer with the logits' dtype and layout (channels-last in, channels-last out)."""
    if logits.is_contiguous():
        return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device,
                       memory_format=torch.channels_last_3d)


def backward(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor,
             eps: float, g_loss: torch.Tensor, g_ce: torch.Tensor, g_dice: torch.Tensor,
             out: Optional[torch.Tensor] = None, block_v: Optional[int] = None) -> torch.Tensor:
    """dL/dlogits for L = g_loss·loss + g_ce·ce + Σ_n g_dice[n]·dice[n], in the logits' dtype."""
    N, C = logits.shape[:2]
    z, (z_sn, z_sv, z_sc) = flat_nsc(logits)
    y = _label_view(labels)
    V = y.shape[1]
    plan = Plan(N, V, C, logits.device, block_v)
    coef, ce_scale = backward_coefficients(sums, C, eps, g_loss, g_ce, g_dice)
    dz = empty_grad_like(logits) if out is None else out
    d_sn, d_sv, d_sc = nsc_strides(dz)
    _bwd_kernel[(plan.tiles, N)](
        z, y, weight, coef, ce_scale, dz, V, C, z_sn, z_sv, z_sc, y.stride(0), y.stride(1),
        d_sn, d_sv, d_sc, BLOCK_V=plan.block_v, BLOCK_C=plan.block_c, num_warps=plan.num_warps)
    return dz


# --- autograd ---------------------------------------------------------------------------------------

class _SegLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, weight, eps, block_v):
        sums = forward_sums(logits, labels, weight, block_v)
        ctx.save_for_backward(logits, labels, weight, sums)
        ctx.eps, ctx.block_v = eps, block_v
        return terms_from_sums(sums, logits.shape[1], eps)

    @staticmethod
    def backward(ctx, g_loss, g_ce, g_dice):
        logits, labels, weight, sums = ctx.saved_tensors
        dz = backward(logits, labels, weight, sums, ctx.eps, g_loss, g_ce, g_dice, block_v=ctx.block_v)
        return dz, None, None, None, None


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
                   *, block_v: Optional[int] = None):
    """(loss, ce, soft Dice per sample (N,)) as SegmentationLoss.terms gives them: fp32 device tensors,
    differentiable with respect to the logits. `block_v` overrides the voxel tile (tests only)."""
    _check(logits, labels, weight)
    w = weight.detach().to(torch.float32).contiguous()
    return _SegLossFunction.apply(logits, labels, w, float(eps), block_v)
