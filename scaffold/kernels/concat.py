"""The U-Net's skip concat, cat([a, b], dim=1), written once in the consumer's dtype, channels-last.

a, b and the output are viewed as [N·S, C] rows (S = D·H·W) through their strides, so any layout whose
spatial dims collapse is read in place. One program copies BLOCK_R rows: the row's Ca channels of a into
output channels [0, Ca), then Cb channels of b into [Ca, Ca + Cb), casting to the output dtype on the
way. Casts round to nearest even, as torch's do, so the result is bitwise that of
torch.cat(...).to(dtype). Backward is the reverse copy: one kernel splits the gradient into the two
parts, each cast back to its input's dtype. Pure copies: no arithmetic, nothing to make
non-deterministic.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from torch.autograd.function import once_differentiable

from .lib.launch import launched
from .groupnorm import MAX_CHANNELS
from .lib.device import triton_usable
from .lib.indexing import cdiv, next_pow2
from .lib.layout import empty_channels_last, flat_nsc, in_room, nsc_strides, room_base
from .lib.rounding import cast_rne

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE = 8192  # elements per half-tile: 16-32 KB in flight per program, enough to stream


@triton.jit
def _program_rows(rows, S, BLOCK_R: tl.constexpr):
    """(n, s, mask) of this program's BLOCK_R rows of the [N·S, C] views: sample, voxel within the
    sample (S per sample), and which of the `rows` rows exist."""
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
    n = r // S
    s = r % S
    rmask = r0 + tl.arange(0, BLOCK_R) < rows
    return n, s, rmask


@triton.jit
def _copy_part(src_ptr, dst_ptr, n, s, rmask, C, c_dst0, s_sn, s_ss, s_sc, d_sn, d_ss, d_sc,
               BLOCK_C: tl.constexpr):
    """Channels [0, C) of the rows (n, s) of src into channels [c_dst0, c_dst0 + C) of dst, cast to
    dst's dtype."""
    c = tl.arange(0, BLOCK_C).to(tl.int64)
    mask = rmask[:, None] & (c < C)[None, :]
    src = src_ptr + (n * s_sn + s * s_ss)[:, None] + c[None, :] * s_sc
    dst = dst_ptr + (n * d_sn + s * d_ss)[:, None] + (c_dst0 + c)[None, :] * d_sc
    v = tl.load(src, mask=mask)
    tl.store(dst, cast_rne(v, dst_ptr.dtype.element_ty), mask=mask)


@launched
@triton.jit
def _concat_kernel(a_ptr, b_ptr, o_ptr, rows, S, CA, CB, a_sn, a_ss, a_sc, b_sn, b_ss, b_sc,
                   o_sn, o_ss, o_sc, BLOCK_R: tl.constexpr, BLOCK_CA: tl.constexpr,
                   BLOCK_CB: tl.constexpr):
    n, s, rmask = _program_rows(rows, S, BLOCK_R)
    _copy_part(a_ptr, o_ptr, n, s, rmask, CA, 0, a_sn, a_ss, a_sc, o_sn, o_ss, o_sc, BLOCK_CA)
    _copy_part(b_ptr, o_ptr, n, s, rmask, CB, CA, b_sn, b_ss, b_sc, o_sn, o_ss, o_sc, BLOCK_CB)


@launched
@triton.jit
def _split_kernel(g_ptr, ga_ptr, gb_ptr, rows, S, CA, CB, g_sn, g_ss, g_sc, a_sn, a_ss, a_sc,
                  b_sn, b_ss, b_sc, BLOCK_R: tl.constexpr, BLOCK_CA: tl.constexpr,
                  BLOCK_CB: tl.constexpr):
    n, s, rmask = _program_rows(rows, S, BLOCK_R)
    # Reading channels [CA, CA+CB) of g: shift the base pointer, then copy to channel 0 of gb.
    _copy_part(g_ptr, ga_ptr, n, s, rmask, CA, 0, g_sn, g_ss, g_sc, a_sn, a_ss, a_sc, BLOCK_CA)
    _copy_part(g_ptr + CA * g_sc, gb_ptr, n, s, rmask, CB, 0, g_sn, g_ss, g_sc, b_sn, b_ss, b_sc,
               BLOCK_CB)


@launched
@triton.jit
def _copy_kernel(src_ptr, dst_ptr, rows, S, C, c_dst0, s_sn, s_ss, s_sc, d_sn, d_ss, d_sc,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channels [0, C) of src into channels [c_dst0, c_dst0 + C) of dst: one part of a concat or of
    its gradient (the other part is already where it belongs; see concat_into_room)."""
    n, s, rmask = _program_rows(rows, S, BLOCK_R)
    _copy_part(src_ptr, dst_ptr, n, s, rmask, C, c_dst0, s_sn, s_ss, s_sc, d_sn, d_ss, d_sc, BLOCK_C)


def _geometry(N: int, S: int, ca: int, cb: int):
    block_ca = next_pow2(ca)
    block_cb = next_pow2(cb)
    block_r = max(1, _TILE // max(block_ca, block_cb))
    return (cdiv(N * S, block_r),), dict(BLOCK_R=block_r, BLOCK_CA=block_ca, BLOCK_CB=block_cb)



def concat_forward(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """cat([a, b], dim=1) in `dtype`, channels-last (or into `out`, any layout with collapsible D, H, W).
    Stock PyTorch under autocast does this in two or three passes (cat in the promoted dtype, then the
    convolution's cast to bf16); here it is one read of each input and one write."""
    N, ca = a.shape[:2]
    cb = b.shape[1]
    S = a[0, 0].numel()
    if out is None:
        out = empty_channels_last((N, ca + cb) + tuple(a.shape[2:]), dtype, a.device)
    a, sa = flat_nsc(a)
    b, sb = flat_nsc(b)
    out, so = flat_nsc(out)
    grid, meta = _geometry(N, S, ca, cb)
    _concat_kernel[grid](a, b, out, N * S, S, ca, cb, *sa, *sb, *so, **meta, num_warps=4)
    return out


def split_backward(g: torch.Tensor, ca: int, a_dtype: torch.dtype, b_dtype: torch.dtype):
    """The gradient of cat([a, b], dim=1) split into (grad a, grad b), channels-last, in each dtype."""
    N, C = g.shape[:2]
    cb = C - ca
    S = g[0, 0].numel()
    ga = empty_channels_last((N, ca) + tuple(g.shape[2:]), a_dtype, g.device)
    gb = empty_channels_last((N, cb) + tuple(g.shape[2:]), b_dtype, g.device)
    g, sg = flat_nsc(g)
    grid, meta = _geometry(N, S, ca, cb)
    _split_kernel[grid](g, ga, gb, N * S, S, ca, cb, *sg, *flat_nsc(ga)[1], *flat_nsc(gb)[1], **meta,
                        num_warps=4)
    return ga, gb


def copy_channels(src: torch.Tensor, dst: torch.Tensor, c_dst0: int) -> None:
    """dst[:, c_dst0:c_dst0 + C] = src (C = src's channels), cast to dst's dtype; any layouts whose D,
    H, W collapse."""
    N, C = src.shape[:2]
    S = src[0, 0].numel()
    src, ss = flat_nsc(src)
    sd = nsc_strides(dst)
    grid, meta = _geometry(N, S, C, C)
    _copy_kernel[grid](src, dst, N * S, S, C, c_dst0, *ss, *sd, BLOCK_R=meta["BLOCK_R"],
                       BLOCK_C=meta["BLOCK_CA"], num_warps=4)


# --- the concat into the room its first part left ---------------------------------------------------
#
# The U-Net's skip is written by a GroupNorm that left room for the decoder's half (group_norm(...,
# room=Cb)): the skip is the first Ca channels of a channels-last tensor of Ca + Cb channels. The concat
# then writes only the second part into that room (nothing at all when the transposed conv that makes it
# wrote it there already: blocks.Up) and returns the whole buffer, and its backward passes
# the first part's gradient on as a view of the incoming gradient (the pool's backward reads it in place)
# and copies only the second part out: half the bytes of concat + split each way, the same values.

class _ConcatRoomFn(torch.autograd.Function):
    """cat([a, b], dim=1) where a is the first channels of `room_base(a)`: b is written into the room
    and the buffer returned (an alias of it: no copy of a)."""

    @staticmethod
    def forward(ctx, a, b, dtype):
        base = room_base(a, b.shape[1], dtype)
        if not in_room(b, base, a.shape[1]):  # else the transposed conv wrote it there (blocks.Up)
            copy_channels(b, base, a.shape[1])
        ctx.ca = a.shape[1]
        ctx.b_dtype = b.dtype
        # Not a view of a (autograd would route the whole gradient through a): the buffer as a tensor
        # of its own. The write above went through a kernel, so no saved tensor's version moved.
        return base.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        ca = ctx.ca
        gb = empty_channels_last((g.shape[0], g.shape[1] - ca) + tuple(g.shape[2:]), ctx.b_dtype, g.device)
        copy_channels(g[:, ca:], gb, 0)
        return g[:, :ca], gb, None


@torch.library.custom_op("scaffold::concat_channels", mutates_args=())
def concat_op(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return concat_forward(a, b, dtype)


@concat_op.register_fake
def _(a, b, dtype):
    return empty_channels_last((a.shape[0], a.shape[1] + b.shape[1]) + tuple(a.shape[2:]), dtype, a.device)


@torch.library.custom_op("scaffold::split_channels", mutates_args=())
def split_op(g: torch.Tensor, ca: int, a_dtype: torch.dtype,
             b_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return split_backward(g, ca, a_dtype, b_dtype)


@split_op.register_fake
def _(g, ca, a_dtype, b_dtype):
    rest = tuple(g.shape[2:])
    return (empty_channels_last((g.shape[0], ca) + rest, a_dtype, g.device),
            empty_channels_last((g.shape[0], g.shape[1] - ca) + rest, b_dtype, g.device))


def _setup_context(ctx, inputs, output):
    a, b, _dtype = inputs
    ctx.ca = a.shape[1]
    ctx.dtypes = (a.dtype, b.dtype)


def _backward(ctx, g):
    ga, gb = split_op(g, ctx.ca, *ctx.dtypes)
    return ga, gb, None


concat_op.register_autograd(_backward, setup_context=_setup_context)


class _ConcatFn(torch.autograd.Function):
    """The eager path of concat_op (see groupnorm._GroupNormFn): the same launchers without the
    dispatcher's per-call custom-op cost; `concat_channels` takes it unless torch.compile traces."""

    @staticmethod
    def forward(ctx, a, b, dtype):
        out = concat_forward(a, b, dtype)
        _setup_context(ctx, (a, b, dtype), out)
        return out

    @staticmethod
    @once_differentiable  # first-order, as the registered op: a second derivative raises
    def backward(ctx, g):
        ga, gb = split_backward(g, ctx.ca, *ctx.dtypes)
        return ga, gb, None


def concat_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `concat_channels` handles cat([a, b], dim=1); metadata only."""
    return (triton_usable(a) and a.device == b.device and a.dim() == 5 and b.dim() == 5
            and a.shape[0] == b.shape[0] and a.shape[2:] == b.shape[2:]
            and a.dtype in _DTYPES and b.dtype in _DTYPES and a.numel() > 0 and b.numel() > 0
            and max(a.shape[1], b.shape[1]) <= MAX_CHANNELS)


def concat_channels(a: torch.Tensor, b: torch.Tensor, dtype: Optional[torch.dtype] = None,
                    into_room: bool = False) -> torch.Tensor:
    """cat([a, b], dim=1) as a channels-last tensor in `dtype` (default: torch.cat's promoted dtype);
    autograd-aware, each gradient part returned in its input's dtype. With `into_room`, when `a` is the
    first channels of a buffer with room for b (room_base: a GroupNorm with `room` made it), b is
    written into that room and the buffer returned: the same values, half the copying. The caller
    says so: the room is memory that only the producer of `a` and this concat may touch."""
    if not concat_supported(a, b):
        raise ValueError(f"concat_channels: unsupported inputs a {tuple(a.shape)} {a.dtype} {a.device}, "
                         f"b {tuple(b.shape)} {b.dtype} {b.device}: need 5-D tensors on one Triton-usable "
                         "device with equal N, D, H, W and float dtypes")
    dtype = torch.promote_types(a.dtype, b.dtype) if dtype is None else dtype
    if dtype not in _DTYPES:
        raise ValueError(f"concat_channels: dtype={dtype} must be one of {_DTYPES}")
    if torch.compiler.is_compiling():  # the registered op, which torch.compile traces through
        return concat_op(a, b, dtype)
    if into_room and room_base(a, b.shape[1], dtype) is not None:
        return _ConcatRoomFn.apply(a, b, dtype)
    return _ConcatFn.apply(a, b, dtype)
