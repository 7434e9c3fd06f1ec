"""Conv3d forward (and its backward-data) as an implicit GEMM on NDHWC activations.

y[m, n] = sum_k A[m, k] * B[k, n] (+ bias[n]), fp32 accumulation, where
  m = one output voxel (batch, od, oh, ow)   M = N*Do*Ho*Wo
  n = one output channel                     N = Cout
  k = (tap, input channel)                   K = taps*Cin
A is never materialized (no im2col buffer): each tap's input voxels are gathered by index arithmetic
(`input_coords`), and taps outside the input are masked to zero, which is the padding. Run backwards
(TRANSPOSED), the same gather is the backward-data of a conv. Each output element is the sum of one
program in a fixed order: no atomics. Activations and weights are read through their strides.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lib.launch import launched
from ..lib.indexing import cdiv, grouped_program, tap_coords, voxel_coords


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc += a @ b in fp32. UPCAST feeds the dot fp32 copies: exact for bf16 (its products fit fp32)
    and needed under the CPU interpreter, whose bf16 dot returns garbage (Triton 3.9)."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def voxel_gemm_tile(M, NCOLS, D, H, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile of an [M, NCOLS] GEMM whose rows are the voxels of an
    (N, D, H, W) grid: the rows' mask, the column offsets and mask, and the rows' voxel coordinates
    (n, d, h, w). Grouped program order: GROUP_M row blocks share their column blocks while they sit
    in L2."""
    pid_m, pid_n = grouped_program(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(NCOLS, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < NCOLS
    nb, d, h, w = voxel_coords(offs_m, D, H, W)
    return mask_m, offs_n, mask_n, nb, d, h, w


@triton.jit
def input_coords(od, oh, ow, kd, kh, kw, ID, IH, IW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
                 TRANSPOSED: tl.constexpr):
    """(id, ih, iw, ok): the input voxel that output voxel (od, oh, ow) reads for tap (kd, kh, kw),
    and whether it lies inside the input (broadcasting: voxels along one axis and taps along the
    other give a [voxels, taps] tile). Direct (the forward): i = o*stride - pad + tap*dilation.
    TRANSPOSED: i = (o + pad - tap*dilation) / stride, only where the division is exact; this is the
    backward-data of the direct conv. At stride 1 it is exactly the forward with the flipped,
    channel-swapped weight and padding dilation*(k-1)-pad, only the flip lives in this arithmetic."""
    if TRANSPOSED:
        nd = od + PD - kd * DD
        nh = oh + PH - kh * DH
        nw = ow + PW - kw * DW
        idd = nd // SD
        ih = nh // SH
        iw = nw // SW
        ok = (nd >= 0) & (nh >= 0) & (nw >= 0)
        ok = ok & (nd - idd * SD == 0) & (nh - ih * SH == 0) & (nw - iw * SW == 0)
    else:
        idd = od * SD - PD + kd * DD
        ih = oh * SH - PH + kh * DH
        iw = ow * SW - PW + kw * DW
        ok = (idd >= 0) & (ih >= 0) & (iw >= 0)
    ok = ok & (idd < ID) & (ih < IH) & (iw < IW)
    return idd, ih, iw, ok


@launched
@triton.jit
def _conv_gather_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, C, CO,
    ID, IH, IW, OD, OH, OW,
    sxn, sxc, sxd, sxh, sxw,
    swc, swn, swd, swh, sww,
    syn, syc, syd, syh, syw,
    SD, SH, SW, PD, PH, PW, DD, DH, DW,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    HAS_BIAS: tl.constexpr, TRANSPOSED: tl.constexpr, FLAT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    mask_m, offs_n, mask_n, nb, od, oh, ow = voxel_gemm_tile(M, CO, OD, OH, OW, BLOCK_M, BLOCK_N,
                                                             GROUP_M)
    # int64 voxel offsets: a 256³ activation with 128 channels has more than 2^31 elements.
    x_batch = nb.to(tl.int64) * sxn
    w_cols = offs_n.to(tl.int64) * swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if FLAT:
        # k = tap*Cin + c as one masked dimension: for thin inputs such as the RGB stem, where
        # Cin = 3 would waste most of a channel block.
        K = KD * KH * KW * C
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            c = offs_k % C
            tap = offs_k // C
            kd, kh, kw = tap_coords(tap, KH, KW)
            idd, ih, iw, ok = input_coords(od[:, None], oh[:, None], ow[:, None], kd[None, :],
                                           kh[None, :], kw[None, :], ID, IH, IW, SD, SH, SW,
                                           PD, PH, PW, DD, DH, DW, TRANSPOSED)
            ok = ok & mask_m[:, None] & mask_k[None, :]
            a_off = (x_batch[:, None] + idd.to(tl.int64) * sxd + ih.to(tl.int64) * sxh
                     + iw.to(tl.int64) * sxw + c[None, :].to(tl.int64) * sxc)
            a = tl.load(x_ptr + a_off, mask=ok, other=0.0)
            w_rows = (c * swc + kd * swd + kh * swh + kw * sww).to(tl.int64)
            b = tl.load(w_ptr + w_rows[:, None] + w_cols[None, :],
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = mma(a, b, acc, PRECISION, UPCAST)
    else:
        # One flat loop over (tap, channel block): a nested loop would leave the inner one too short
        # (Cin = 64 is one block) for the compiler to pipeline its loads.
        blocks_c = tl.cdiv(C, BLOCK_K)
        for it in range(0, KD * KH * KW * blocks_c):
            tap = it // blocks_c
            c0 = (it - tap * blocks_c) * BLOCK_K
            kd, kh, kw = tap_coords(tap, KH, KW)
            idd, ih, iw, ok = input_coords(od, oh, ow, kd, kh, kw, ID, IH, IW, SD, SH, SW,
                                           PD, PH, PW, DD, DH, DW, TRANSPOSED)
            ok = ok & mask_m
            a_row = (x_batch + idd.to(tl.int64) * sxd + ih.to(tl.int64) * sxh
                     + iw.to(tl.int64) * sxw)
            w_tap = kd * swd + kh * swh + kw * sww  # < 2^31: weights are small
            offs_k = c0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < C
            a = tl.load(x_ptr + a_row[:, None] + offs_k[None, :].to(tl.int64) * sxc,
                        mask=ok[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_ptr + w_tap + offs_k[:, None].to(tl.int64) * swc + w_cols[None, :],
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = mma(a, b, acc, PRECISION, UPCAST)

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_row = (nb.to(tl.int64) * syn + od.to(tl.int64) * syd + oh.to(tl.int64) * syh
             + ow.to(tl.int64) * syw)
    y_off = y_row[:, None] + offs_n[None, :].to(tl.int64) * syc
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def dot_mode(t: torch.Tensor, allow_tf32: bool = False) -> dict:
    """The dot's constexpr arguments: fp32 operands multiply in IEEE fp32 by default (exact on small
    integers), tf32 only if asked; bf16 is upcast under the interpreter only."""
    precision = "tf32" if (t.dtype == torch.float32 and allow_tf32) else "ieee"
    return dict(PRECISION=precision, UPCAST=(t.dtype == torch.bfloat16 and not t.is_cuda))


def conv_gather(x: torch.Tensor, w_view: tuple, out: torch.Tensor, bias, kernel: tuple,
                stride: tuple, padding: tuple, dilation: tuple, transposed: bool, tile,
                allow_tf32: bool = False) -> torch.Tensor:
    """Launch the implicit-GEMM gather conv writing into `out` (N, CO, Do, Ho, Wo), any strides.

    w_view = (w, stride_of_K_channel, stride_of_N_channel, stride_d, stride_h, stride_w): the weight
    tensor and how to walk it, so callers pick the channel roles without copying; the backward-data
    reads the torch weight (Cout, Cin, kd, kh, kw) channel-swapped this way.
    """
    w, swc, swn, swd, swh, sww = w_view
    n, c = x.shape[:2]
    co = out.shape[1]
    m = n * out.shape[2] * out.shape[3] * out.shape[4]
    flat = c < 16  # K order: one flat (tap, channel) dimension, else channel blocks per tap
    grid = (cdiv(m, tile.block_m) * cdiv(co, tile.block_n),)
    _conv_gather_kernel[grid](
        x, w, bias if bias is not None else w, out,
        m, c, co, *x.shape[2:], *out.shape[2:],
        *x.stride(), swc, swn, swd, swh, sww, *out.stride(),
        *stride, *padding, *dilation, *kernel,
        HAS_BIAS=bias is not None, TRANSPOSED=transposed, FLAT=flat,
        **dot_mode(x, allow_tf32),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
