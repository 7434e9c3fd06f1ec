"""Index arithmetic shared by the kernels: host-side ceil-division and powers of two, program order,
voxel coordinates and offsets.

Flat voxel indices run over an (N, D, H, W) grid with W fastest, as NDHWC stores them; flat tap
indices over a (KD, KH, KW) kernel with kw fastest. Offsets are int64: a 256³ activation with 128
channels has more than 2^31 elements.
"""
from __future__ import annotations

import triton
import triton.language as tl


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, for host code: triton.cdiv (a constexpr function since Triton 3.6) costs a
    few microseconds a call on the host, and a launch computes a dozen of these."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for host code (see `cdiv`)."""
    return 1 << (n - 1).bit_length()


@triton.jit
def grouped_program(pid, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """(row block, column block) of 1-D program id `pid`, ordered so that GROUP_M consecutive row
    blocks sweep the same column blocks while those sit in L2."""
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def voxel_coords(offs, D, H, W):
    """(n, d, h, w) of flat voxel indices `offs` over an (N, D, H, W) grid."""
    w = offs % W
    t = offs // W
    h = t % H
    t = t // H
    d = t % D
    n = t // D
    return n, d, h, w


@triton.jit
def voxel_rows(m0, end, D, H, W, sn, sd, sh, sw, BLOCK: tl.constexpr):
    """Flat voxels [m0, m0 + BLOCK) of an (N, D, H, W) grid: which lie below `end`, their
    coordinates (n, d, h, w), and their int64 element offsets under strides (sn, sd, sh, sw)."""
    offs = m0 + tl.arange(0, BLOCK)
    mask = offs < end
    n, d, h, w = voxel_coords(offs, D, H, W)
    row = (n.to(tl.int64) * sn + d.to(tl.int64) * sd + h.to(tl.int64) * sh
           + w.to(tl.int64) * sw)
    return mask, n, d, h, w, row


@triton.jit
def tap_coords(tap, KH: tl.constexpr, KW: tl.constexpr):
    """(kd, kh, kw) of flat tap indices over a (KD, KH, KW) kernel (kw fastest)."""
    return tap // (KW * KH), (tap // KW) % KH, tap % KW
