"""Index arithmetic shared by the convolution kernels: program order and voxel coordinates.

`grouped_program` maps a 1-D program id to a (row block, column block) pair so that GROUP_M consecutive
row blocks sweep the same column blocks while those sit in L2. `voxel_coords` splits flat voxel indices
of an (N, D, H, W) grid into their coordinates (W fastest, as NDHWC stores them); `tap_coords` splits
a kernel tap index into (kd, kh, kw) the same way.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_program(pid, blocks_m, blocks_n, GROUP_M: tl.constexpr):
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
def tap_coords(tap, KH: tl.constexpr, KW: tl.constexpr):
    """(kd, kh, kw) of flat tap indices over a (KD, KH, KW) kernel (kw fastest)."""
    return tap // (KW * KH), (tap // KW) % KH, tap % KW
