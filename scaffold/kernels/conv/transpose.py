"""ConvTranspose3d with kernel = stride and no padding, as a pointwise GEMM with a scatter store.

With kernel = stride every output voxel receives exactly one tap of exactly one input voxel, so
y = X · W is a plain GEMM, fp32 accumulation:
  m = one input voxel (batch, d, h, w)              M = N*D*H*W
  j = (tap, output channel), j = tap*Cout + co      J = taps*Cout
  k = input channel                                 K = Cin
and column j of row m is stored (plus bias[co]) at output voxel (d*sd + kd, h*sh + kh, w*sw + kw),
channel co. Every output element is written exactly once: no atomics. Backward: grad input is the
strided conv of dy with the same weight (gather.py, kernel = stride, pad 0) and grad weight is
weight_grad.py with G = x and X = dy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lib.launch import launched
from ..lib.indexing import cdiv, tap_coords
from .gather import dot_mode, mma, voxel_gemm_tile


@launched
@triton.jit
def _convT_scatter_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, C, CO,
    ID, IH, IW,
    sxn, sxc, sxd, sxh, sxw,
    swc, swn, swd, swh, sww,
    syn, syc, syd, syh, syw,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    J = KD * KH * KW * CO
    mask_m, offs_j, mask_j, nb, idd, ih, iw = voxel_gemm_tile(M, J, ID, IH, IW, BLOCK_M, BLOCK_N,
                                                              GROUP_M)
    # Columns run tap-major, so a tile's channels land contiguously in an NDHWC output.
    co = offs_j % CO
    tap = offs_j // CO
    kd, kh, kw = tap_coords(tap, KH, KW)
    x_row = (nb.to(tl.int64) * sxn + idd.to(tl.int64) * sxd + ih.to(tl.int64) * sxh
             + iw.to(tl.int64) * sxw)
    w_col = (co * swn + kd * swd + kh * swh + kw * sww).to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < C
        a = tl.load(x_ptr + x_row[:, None] + offs_k[None, :].to(tl.int64) * sxc,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptr + offs_k[:, None].to(tl.int64) * swc + w_col[None, :],
                    mask=mask_k[:, None] & mask_j[None, :], other=0.0)
        acc = mma(a, b, acc, PRECISION, UPCAST)

    if HAS_BIAS:
        acc += tl.load(b_ptr + co, mask=mask_j, other=0.0).to(tl.float32)[None, :]
    y_row = (nb.to(tl.int64) * syn + (idd * KD).to(tl.int64) * syd + (ih * KH).to(tl.int64) * syh
             + (iw * KW).to(tl.int64) * syw)
    y_col = (kd.to(tl.int64) * syd + kh.to(tl.int64) * syh + kw.to(tl.int64) * syw
             + co.to(tl.int64) * syc)
    tl.store(y_ptr + y_row[:, None] + y_col[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_j[None, :])


def conv_transpose_scatter(x: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor, tile,
                           allow_tf32: bool = False) -> torch.Tensor:
    """y = conv_transpose3d(x, w, bias, stride = kernel) written into `out` (any strides). The weight
    (Cin, Cout, kd, kh, kw) is read in place through its strides."""
    n, c = x.shape[:2]
    co = w.shape[1]
    kd, kh, kw = w.shape[2:]
    m = n * x.shape[2] * x.shape[3] * x.shape[4]
    j = kd * kh * kw * co
    grid = (cdiv(m, tile.block_m) * cdiv(j, tile.block_n),)
    _convT_scatter_kernel[grid](
        x, w, bias if bias is not None else w, out, m, c, co, *x.shape[2:],
        *x.stride(), *w.stride(), *out.stride(), kd, kh, kw,
        HAS_BIAS=bias is not None, **dot_mode(x, allow_tf32),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
