"""Narrow inputs of the box kernels: fold (kh, kw, ci) into channels, or zero-pad them.

The copy engine needs rows of 16 bytes, so a conv whose input channels are not a
multiple of 8 (the RGB stem) is rewritten before launch (`box_operands`). When KH·KW·Cin is small
(≤ FOLD_MAX) its (kh, kw, ci) taps are folded into channels: x_fold[n, d, h, w, (kh·KW + kw)·Cin + ci]
= x[n, ci, d, h + kh·dil − pad, w + kw·dil − pad] (zero outside, `_fold_hw_kernel`), zero-padded to a
multiple of 16 channels, and the conv becomes a KD×1×1 one over x_fold (stem: 27 → 32 channels, 3 taps
instead of 27 taps of 3 channels). The weight gradient of the folded conv, stored through the same
masks, is bit for bit the layout of the real one ([Cout, kd, kh, kw, ci]), so no copy follows. Wider
odd channel counts, and backward-data, zero-pad Cin instead. Every added term is an exact zero.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lib.launch import launched
from ..lib.indexing import cdiv, next_pow2, tap_coords, voxel_coords

FOLD_MAX = 64  # fold when KH·KW·Cin is at most this (the stem: 27)
_CL = torch.channels_last_3d


def round16(c: int) -> int:
    return (c + 15) // 16 * 16


def box_channels(c: int) -> int:
    """A channel count the copy engine can read in rows: c if a multiple of 8, else c rounded up to
    16 (the zero-padded operand, `pad_channels`)."""
    return c if c % 8 == 0 else round16(c)


def folds(cin: int, kernel: tuple) -> bool:
    """Whether box_operands folds a conv of `cin` input channels and this kernel."""
    return cin % 8 != 0 and kernel[1] * kernel[2] * cin <= FOLD_MAX


def pad_channels(t: torch.Tensor, cp: int) -> torch.Tensor:
    """t (N, C, ...) with zero channels appended up to cp, channels_last_3d (t itself if C == cp)."""
    c = t.shape[1]
    if c == cp:
        return t
    out = torch.empty((t.shape[0], cp, *t.shape[2:]), device=t.device, dtype=t.dtype,
                      memory_format=_CL)
    out[:, c:].zero_()
    out[:, :c].copy_(t)
    return out


@launched
@triton.jit
def _fold_hw_kernel(x_ptr, out_ptr, J, KP, D, HO, WO, H, W, total,
                    sxn, sxc, sxd, sxh, sxw, PH, PW, DH, DW,
                    CIN: tl.constexpr, KW: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_J: tl.constexpr):
    v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    j = tl.arange(0, BLOCK_J)
    n, d, oh, ow = voxel_coords(v, D, HO, WO)
    kh, kw, ci = tap_coords(j, KW, CIN)  # j = (kh·KW + kw)·CIN + ci
    ih = oh[:, None] + (kh * DH - PH)[None, :]
    iw = ow[:, None] + (kw * DW - PW)[None, :]
    live = (v < total)[:, None]
    ok = live & (j < J)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    src = ((n.to(tl.int64) * sxn + d.to(tl.int64) * sxd)[:, None] + ci[None, :].to(tl.int64) * sxc
           + ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw)
    val = tl.load(x_ptr + src, mask=ok, other=0.0)
    tl.store(out_ptr + v.to(tl.int64)[:, None] * KP + j[None, :], val, mask=live & (j < KP)[None, :])


def fold_input(x: torch.Tensor, kernel: tuple, padding: tuple, dilation: tuple) -> torch.Tensor:
    """x_fold (N, KP, D, Ho, Wo), channels_last_3d: the (kh, kw, ci) taps of x as channels, zero
    beyond KH·KW·Cin (KP: that, rounded up to 16). x may have any strides."""
    n, cin, d, h, w = x.shape
    ho = h + 2 * padding[1] - dilation[1] * (kernel[1] - 1)
    wo = w + 2 * padding[2] - dilation[2] * (kernel[2] - 1)
    j = kernel[1] * kernel[2] * cin
    kp = round16(j)
    out = torch.empty((n, kp, d, ho, wo), device=x.device, dtype=x.dtype, memory_format=_CL)
    total = n * d * ho * wo
    block_v = 128 if x.is_cuda else 32
    _fold_hw_kernel[(cdiv(total, block_v),)](
        x, out, j, kp, d, ho, wo, h, w, total, *x.stride(), padding[1], padding[2],
        dilation[1], dilation[2], CIN=cin, KW=kernel[2],
        BLOCK_V=block_v, BLOCK_J=next_pow2(kp))
    return out


def fold_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight of the folded conv: (Cout, KP, KD, 1, 1), channels_last_3d, zero beyond KH·KW·Cin."""
    co, cin, kd, kh, kw = w.shape
    taps = w.permute(0, 2, 3, 4, 1).reshape(co, kd, kh * kw * cin)  # [co, kd, (kh, kw, ci)]
    kp = round16(kh * kw * cin)
    out = torch.zeros((co, kd, 1, 1, kp), device=w.device, dtype=w.dtype)
    out[..., 0, 0, : kh * kw * cin] = taps
    return out.permute(0, 4, 1, 2, 3)


def box_operands(x, w, kernel: tuple, padding: tuple, dilation: tuple):
    """(x, w, kernel, padding, dilation) of the conv the box kernels run for input x (w may be None,
    for the weight gradient): as given when Cin is a multiple of 8, else folded (`folds`) or with
    Cin zero-padded to a multiple of 16. The result is the same conv: every added term is zero."""
    cin = x.shape[1]
    if cin % 8 == 0:
        return x, w, kernel, padding, dilation
    if folds(cin, kernel):
        xf = fold_input(x, kernel, padding, dilation)
        wf = None if w is None else fold_weight(w)
        return (xf, wf, (kernel[0], 1, 1), (padding[0], 0, 0), (dilation[0], 1, 1))
    cp = box_channels(cin)
    return (pad_channels(x, cp), None if w is None else pad_channels(w, cp), kernel, padding,
            dilation)
