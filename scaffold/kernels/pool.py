"""2×2×2 max pooling, stride 2: one pass forward, one pass backward; channels-last (NDHWC) out, any
input strides (NDHWC is the layout that reads in order).

Forward: a program takes BLOCK_P pooled voxels × BLOCK_C channels and reads their windows' 8 voxels
in window order (d, h, w). It keeps each window's FIRST maximal element, NaN counting as the largest,
and stores it with its offset in the window (0-7, uint8): the choice `torch.max(dim)` makes, and so
the bits of the vendor formulation (`scaffold.model.pool`). Backward: dx at window offset k is dy
where the saved index is k, else zero; each program writes every element of its windows once.
No scatter, no atomics: deterministic, and nothing but copies and compares.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from torch.autograd.function import once_differentiable

from .lib.launch import launched
from .lib.device import triton_usable
from .lib.indexing import cdiv, next_pow2, voxel_coords
from .lib.layout import empty_channels_last
from .lib.rounding import cast_rne, to_f32

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements of one window offset per program (the forward makes 8 loads of this many, the backward 8
# stores): the fastest sizes of an H200 sweep (docs/kernels.md).
_FWD_TILE = 1024
_BWD_TILE = 2048


@triton.jit
def _offsets(p, c, DO, HO, WO, sn, sc, sd, sh, sw, STEP: tl.constexpr):
    """Element offsets of pooled voxels p (flat over N, D', H', W'), channels c, in a tensor of strides
    (sn, sc, sd, sh, sw): the pooled voxel itself (STEP 1) or its window's first voxel (STEP 2)."""
    n, d, h, w = voxel_coords(p, DO, HO, WO)
    row = (n.to(tl.int64) * sn + (STEP * d).to(tl.int64) * sd + (STEP * h).to(tl.int64) * sh
           + (STEP * w).to(tl.int64) * sw)
    return row[:, None] + c[None, :].to(tl.int64) * sc


@launched
@triton.jit
def _pool_fwd_kernel(x_ptr, y_ptr, i_ptr, P, C, DO, HO, WO,
                     sxn, sxc, sxd, sxh, sxw, syn, syc, syd, syh, syw,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (p < P)[:, None] & (c < C)[None, :]
    # Channels fastest: in NDHWC each of the 8 loads reads whole rows.
    src = x_ptr + _offsets(p, c, DO, HO, WO, sxn, sxc, sxd, sxh, sxw, 2)
    best = tl.load(src, mask=mask)
    best32 = to_f32(best)  # compared in fp32 (exact), as the GPU compares 16-bit floats anyway
    index = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.int32)
    # The running maximum is replaced only by a strictly greater value, or by a NaN where it holds
    # none, so the result and its index are those of the first maximal element, NaN the largest.
    for k in tl.static_range(1, 8):
        v = tl.load(src + (k // 4) * sxd + ((k // 2) % 2) * sxh + (k % 2) * sxw, mask=mask)
        v32 = to_f32(v)
        take = (v32 > best32) | ((v32 != v32) & (best32 == best32))  # greater, or the first NaN
        best = tl.where(take, v, best)
        best32 = tl.where(take, v32, best32)
        index = tl.where(take, k, index)
    dst = _offsets(p, c, DO, HO, WO, syn, syc, syd, syh, syw, 1)
    tl.store(y_ptr + dst, best, mask=mask)
    tl.store(i_ptr + dst, index.to(tl.uint8), mask=mask)


@launched
@triton.jit
def _pool_bwd_kernel(g_ptr, i_ptr, dx_ptr, a_ptr, P, C, DO, HO, WO,
                     sgn, sgc, sgd, sgh, sgw, sin, sic, sid, sih, siw, sxn, sxc, sxd, sxh, sxw,
                     san, sac, sad, sah, saw,
                     ADD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (p < P)[:, None] & (c < C)[None, :]
    g = tl.load(g_ptr + _offsets(p, c, DO, HO, WO, sgn, sgc, sgd, sgh, sgw, 1), mask=mask)
    index = tl.load(i_ptr + _offsets(p, c, DO, HO, WO, sin, sic, sid, sih, siw, 1),
                    mask=mask).to(tl.int32)
    dst = dx_ptr + _offsets(p, c, DO, HO, WO, sxn, sxc, sxd, sxh, sxw, 2)
    zero = tl.zeros((BLOCK_P, BLOCK_C), dtype=g.dtype)
    if ADD:
        src = a_ptr + _offsets(p, c, DO, HO, WO, san, sac, sad, sah, saw, 2)
    for k in tl.static_range(8):
        off = (k // 4) * sxd + ((k // 2) % 2) * sxh + (k % 2) * sxw
        v = tl.where(index == k, g, zero)
        if ADD:  # the input's other gradient, added as autograd adds two gradients: in fp32, rounded once
            a = tl.load(src + (k // 4) * sad + ((k // 2) % 2) * sah + (k % 2) * saw, mask=mask)
            v = cast_rne(to_f32(v) + to_f32(a), dx_ptr.dtype.element_ty)
        tl.store(dst + off, v.to(dx_ptr.dtype.element_ty), mask=mask)


def _geometry(pooled: int, c: int, tile: int):
    block_c = min(next_pow2(c), 128)
    block_p = max(1, tile // block_c)
    return (cdiv(pooled, block_p), cdiv(c, block_c)), dict(BLOCK_P=block_p, BLOCK_C=block_c)



def _pooled_shape(shape) -> tuple:
    n, c, d, h, w = shape
    return n, c, d // 2, h // 2, w // 2


def pool_forward(x: torch.Tensor, out: Optional[torch.Tensor] = None,
                 index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, index): the 2×2×2 max pool of x (N, C, D, H, W) and each window's offset (0-7, uint8, in
    (d, h, w) order) of its first maximal element, channels-last (or into `out`, `index`: any
    strides); x may have any strides. Reads x once and writes 1/8 of it (plus the uint8 index)."""
    shape = _pooled_shape(x.shape)
    y = empty_channels_last(shape, x.dtype, x.device) if out is None else out
    index = empty_channels_last(shape, torch.uint8, x.device) if index is None else index
    n, c, do, ho, wo = shape
    grid, meta = _geometry(n * do * ho * wo, c, _FWD_TILE)
    _pool_fwd_kernel[grid](x, y, index, n * do * ho * wo, c, do, ho, wo, *x.stride(), *y.stride(),
                           **meta, num_warps=4)
    return y, index


def pool_backward(g: torch.Tensor, index: torch.Tensor, dtype: torch.dtype,
                  out: Optional[torch.Tensor] = None, add: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dx (N, C, 2D', 2H', 2W') in `dtype`, channels-last (or into `out`): g where the window's index
    points, else 0, plus `add` (a gradient of the same input from another consumer, any strides)
    where given, summed as autograd sums two gradients. g and index may have any strides. Reads dy,
    the index (and `add`) and writes dx once."""
    n, c, do, ho, wo = g.shape
    dx = empty_channels_last((n, c, 2 * do, 2 * ho, 2 * wo), dtype, g.device) if out is None else out
    if add is not None and (add.shape != dx.shape or add.dtype != dtype):
        raise ValueError(f"pool_backward: add must be {tuple(dx.shape)} {dtype}, got {tuple(add.shape)} "
                         f"{add.dtype}")
    grid, meta = _geometry(n * do * ho * wo, c, _BWD_TILE)
    a = dx if add is None else add
    _pool_bwd_kernel[grid](g, index, dx, a, n * do * ho * wo, c, do, ho, wo, *g.stride(),
                           *index.stride(), *dx.stride(), *a.stride(), ADD=add is not None, **meta,
                           num_warps=4)
    return dx


class _MaxPoolFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y, index = pool_forward(x)
        ctx.save_for_backward(index)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    @once_differentiable  # first-order, as the other Triton rungs: a second derivative raises
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return pool_backward(g, index, ctx.dtype)


class _MaxPoolSkipFn(torch.autograd.Function):
    """(pool(x), x): the pool and its input as the skip connection reads it, so that the input's two
    gradients (the decoder's, through the skip, and the pool's) meet in the pool's backward, one pass,
    instead of in an add of their own over the full-size tensor."""

    @staticmethod
    def forward(ctx, x):
        y, index = pool_forward(x)
        ctx.save_for_backward(index)
        ctx.dtype = x.dtype
        ctx.set_materialize_grads(False)  # a gradient that never came stays None, not zeros: 0 + (-0) is +0
        return y, x  # x returned as is: autograd gives the caller a view of it, whose gradient comes here

    @staticmethod
    @once_differentiable
    def backward(ctx, g, g_skip):
        (index,) = ctx.saved_tensors
        if g is None:  # only the skip's gradient (None too when neither output was used)
            return g_skip
        return pool_backward(g, index, ctx.dtype, add=g_skip)


def max_pool2_supported(x: torch.Tensor) -> bool:
    """Whether `max_pool2` takes x: metadata only (a Triton-usable device, a 5-D float tensor with
    even, non-zero D, H, W; any strides, though channels-last is the layout that reads in order)."""
    return (triton_usable(x) and x.dim() == 5 and x.dtype in _DTYPES and x.numel() > 0
            and all(s % 2 == 0 for s in x.shape[2:]))


def _require_supported(x: torch.Tensor) -> None:
    if not max_pool2_supported(x):
        raise ValueError(f"max_pool2: unsupported input {tuple(x.shape)} {x.dtype} {x.device}: need a "
                         "5-D float tensor with even D, H, W on a Triton-usable device")


def max_pool2(x: torch.Tensor) -> torch.Tensor:
    """F.max_pool3d(x, 2) with a deterministic backward, on Triton: bitwise the vendor formulation's
    result and gradient (first maximal element per window, NaN propagating). The vendor formulation
    gathers the windows through a permuted view (a copy), reduces it, converts the index, and in the
    backward builds a one-hot, selects and permutes back: several passes more over the full-size
    tensors."""
    _require_supported(x)
    return _MaxPoolFn.apply(x)


def max_pool2_with_skip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_pool2(x), x as the skip connection reads it): the same values and gradient as the pool and
    the input used apart, with the input's two gradients added inside the pool's backward."""
    _require_supported(x)
    return _MaxPoolSkipFn.apply(x)
