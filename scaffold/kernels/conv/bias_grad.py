"""Bias gradient: db[c] = sum over (n, d, h, w) of dy[n, c, d, h, w], deterministic.

The voxels are cut into S contiguous chunks (S a pure function of shape and device); a program per
(channel block, chunk) accumulates its [BLOCK_M, BLOCK_C] tiles elementwise in fp32, reduces the tile
once at the end, and writes its partial to slot s; `sum_splits` adds the slots in index order.
dy is read through its strides (NDHWC or NCDHW alike); no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lib.launch import launched
from ..lib.indexing import cdiv, next_pow2, voxel_rows
from ..lib.splits import chunk_range, split_plan, sum_splits


@launched
@triton.jit
def _bias_grad_kernel(g_ptr, p_ptr, M, C, CHUNK, OD, OH, OW, sgn, sgc, sgd, sgh, sgw,
                      BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_c = tl.program_id(0)
    split = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    m_start, m_end = chunk_range(split, CHUNK, M)
    for m0 in range(m_start, m_end, BLOCK_M):
        mask_m, _nb, _od, _oh, _ow, row = voxel_rows(m0, m_end, OD, OH, OW, sgn, sgd, sgh, sgw, BLOCK_M)
        acc += tl.load(g_ptr + row[:, None] + offs_c[None, :].to(tl.int64) * sgc,
                       mask=mask_m[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    tl.store(p_ptr + split * C + offs_c, total.to(p_ptr.dtype.element_ty), mask=mask_c)


def bias_grad(g: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of g (N, C, D, H, W; any strides) over all but the channel dim, as a (C,) tensor of `dtype`."""
    n, c = g.shape[:2]
    m = n * g.shape[2] * g.shape[3] * g.shape[4]
    if out is None:
        out = torch.empty(c, device=g.device, dtype=dtype)
    block_c = min(max(next_pow2(c), 16), 64)
    block_m = 16 if not g.is_cuda else 128
    steps = cdiv(m, block_m)
    s, per_split = split_plan(g.device, cdiv(c, block_c), steps, c, min_steps=8)
    chunk = per_split * block_m
    partials = out if s == 1 else torch.empty((s, c), device=g.device, dtype=torch.float32)
    _bias_grad_kernel[(cdiv(c, block_c), s)](
        g, partials, m, c, chunk, *g.shape[2:], *g.stride(),
        BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
    if s > 1:
        sum_splits(partials, out)
    return out
