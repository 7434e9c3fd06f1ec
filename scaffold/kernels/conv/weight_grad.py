"""Conv3d backward-weight as a split-K GEMM, deterministic.

dW[r, q] = sum_m G[m, r] * X[gather(m, tap), c], fp32 accumulation, where
  m = one voxel of G (the conv's output gradient), the reduction, M = N*Do*Ho*Wo
  r = one output channel of the conv                R = Cout
  q = (tap, input channel), q = tap*Cin + c         Q = taps*Cin
  gather(m, tap) = o*stride - pad + tap*dilation, masked to zero outside the input.
The M reduction is cut into S contiguous chunks (S a pure function of the shape and the device);
program (tile, s) writes the fp32 partial of chunk s to its own slot and `sum_splits` adds the slots
in index order: no atomics. The transposed conv's weight gradient is this kernel with G = its input
and X = its output gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lib.launch import launched
from ..lib.indexing import cdiv, tap_coords, voxel_rows
from ..lib.splits import chunk_range, split_plan, sum_splits
from .gather import dot_mode, input_coords, mma


@launched
@triton.jit
def _conv_wgrad_kernel(
    g_ptr, x_ptr, p_ptr,
    M, R, C, CHUNK,
    ID, IH, IW, OD, OH, OW,
    sgn, sgc, sgd, sgh, sgw,
    sxn, sxc, sxd, sxh, sxw,
    SD, SH, SW, PD, PH, PW, DD, DH, DW,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    FLAT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    Q = KD * KH * KW * C
    blocks_r = tl.cdiv(R, BLOCK_R)
    pid_r = pid % blocks_r  # neighbouring programs share the X columns they gather
    pid_q = pid // blocks_r
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if FLAT:  # q as one masked dimension: thin inputs such as the RGB stem (Cin < 16)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        mask_q = offs_q < Q
        c = offs_q % C
        tap = offs_q // C
    else:
        # One tap per program: its offsets are scalars and the gather's index math stays 1-D.
        blocks_c = tl.cdiv(C, BLOCK_Q)
        tap = pid_q // blocks_c
        c = (pid_q % blocks_c) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        mask_q = c < C
        offs_q = tap * C + c
    kd, kh, kw = tap_coords(tap, KH, KW)
    x_col = c.to(tl.int64) * sxc

    acc = tl.zeros((BLOCK_R, BLOCK_Q), dtype=tl.float32)
    m_start, m_end = chunk_range(split, CHUNK, M)
    for m0 in range(m_start, m_end, BLOCK_M):
        mask_m, nb, od, oh, ow, g_row = voxel_rows(m0, m_end, OD, OH, OW, sgn, sgd, sgh, sgw, BLOCK_M)
        g = tl.load(g_ptr + g_row[:, None] + offs_r[None, :].to(tl.int64) * sgc,
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        if FLAT:
            idd, ih, iw, ok = input_coords(od[:, None], oh[:, None], ow[:, None], kd[None, :],
                                           kh[None, :], kw[None, :], ID, IH, IW, SD, SH, SW,
                                           PD, PH, PW, DD, DH, DW, TRANSPOSED=False)
            ok = ok & mask_m[:, None] & mask_q[None, :]
            x_off = (nb.to(tl.int64)[:, None] * sxn + idd.to(tl.int64) * sxd
                     + ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw + x_col[None, :])
        else:
            idd, ih, iw, ok = input_coords(od, oh, ow, kd, kh, kw, ID, IH, IW, SD, SH, SW,
                                           PD, PH, PW, DD, DH, DW, TRANSPOSED=False)
            ok = ok & mask_m
            x_row = (nb.to(tl.int64) * sxn + idd.to(tl.int64) * sxd + ih.to(tl.int64) * sxh
                     + iw.to(tl.int64) * sxw)
            x_off = x_row[:, None] + x_col[None, :]
            ok = ok[:, None] & mask_q[None, :]
        xg = tl.load(x_ptr + x_off, mask=ok, other=0.0)
        acc = mma(tl.trans(g), xg, acc, PRECISION, UPCAST)

    slot = split.to(tl.int64) * R * Q
    p_off = slot + offs_r[:, None].to(tl.int64) * Q + offs_q[None, :]
    tl.store(p_ptr + p_off, acc.to(p_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_q[None, :])


def conv_weight_grad(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, kernel: tuple,
                     stride: tuple, padding: tuple, dilation: tuple, tile,
                     allow_tf32: bool = False) -> torch.Tensor:
    """dW for the conv x -> g (g: output gradient, N×R×Do×Ho×Wo; x: input, N×C×D×H×W, any strides).

    `out` is (R, C, kd, kh, kw) in channels_last_3d order (its storage is the dense [R, Q] matrix)
    and receives the result in its own dtype.
    """
    assert out.is_contiguous(memory_format=torch.channels_last_3d), "out must be channels_last_3d"
    n, r = g.shape[:2]
    c = x.shape[1]
    taps = kernel[0] * kernel[1] * kernel[2]
    m = n * g.shape[2] * g.shape[3] * g.shape[4]
    flat = c < 16
    blocks_r = cdiv(r, tile.block_m)
    blocks_q = cdiv(taps * c, tile.block_n) if flat else taps * cdiv(c, tile.block_n)
    s, per_split = split_plan(g.device, blocks_r * blocks_q, cdiv(m, tile.block_k), r * c * taps)
    chunk = per_split * tile.block_k
    # With S = 1 the kernel stores the result directly.
    partials = out if s == 1 else torch.empty((s, r * c * taps), device=g.device,
                                              dtype=torch.float32)
    _conv_wgrad_kernel[(blocks_r * blocks_q, s)](
        g, x, partials, m, r, c, chunk, *x.shape[2:], *g.shape[2:],
        *g.stride(), *x.stride(), *stride, *padding, *dilation, *kernel,
        FLAT=flat, **dot_mode(x, allow_tf32),
        BLOCK_R=tile.block_m, BLOCK_Q=tile.block_n, BLOCK_M=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if s > 1:
        sum_splits(partials, out.permute(0, 2, 3, 4, 1).view(-1))
    return out
