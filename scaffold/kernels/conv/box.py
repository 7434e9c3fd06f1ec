"""Conv3d at stride 1 as an implicit GEMM over boxes of voxels, read with tensor descriptors.

A tile's rows are a box of BD×BH×BW voxels of one sample. For tap (kd, kh, kw) the operand that tap
needs is the same box shifted by the tap: one 5-D descriptor load of x viewed as [N, D, H, W, C]
(channels-last), whose coordinates outside the volume read as zero, which is the zero padding.
  forward        y[box, co]      = sum over (tap, ci) of x[box + tap·dil − pad, ci] · W[co, ci, tap]
  backward-data  dx[box, ci]     = sum over (tap, co) of dy[box − tap·dil + pad, co] · W[co, ci, tap]
  backward-wgt   dW[co, ci, tap] = sum over boxes of dy[box, co]ᵀ · x[box + tap·dil − pad, ci]
fp32 accumulation; where a reduction is split, fp32 partials are added in index order by `sum_splits`
(no atomics). Operands must be channels-last (`box_supported`); transposed convs with kernel = stride
reuse these kernels for their backward passes through a subsampled view of dy (`subsampled_desc`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..lib.launch import launched
from ..lib.device import cuda_major, sm_count
from ..lib.indexing import cdiv, grouped_program, next_pow2, tap_coords, voxel_coords
from ..lib.splits import split_plan, sum_splits, wave_split_plan
from .gather import dot_mode, mma

try:  # Triton >= 3.3 host-side descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the box kernels are simply not used
    TensorDescriptor = None


@triton.jit
def _box_origin(box, tiles_d, tiles_h, tiles_w, BD: tl.constexpr, BH: tl.constexpr,
                BW: tl.constexpr):
    """(n, d0, h0, w0) of box number `box` (w fastest)."""
    n, td, th, tw = voxel_coords(box, tiles_d, tiles_h, tiles_w)
    return n, td * BD, th * BH, tw * BW


@launched
@triton.jit
def _conv_box_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    C, CO, D, H, W, tiles_d, tiles_h, tiles_w, num_boxes, iters_per_split,
    sys, syn, syc, syd, syh, syw,
    PD, PH, PW, DD, DH, DW,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    MIRROR: tl.constexpr, SUB: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BD * BH * BW
    pid_m, pid_n = grouped_program(tl.program_id(0), num_boxes, tl.cdiv(CO, BLOCK_N), GROUP_M)
    n, d0, h0, w0 = _box_origin(pid_m, tiles_d, tiles_h, tiles_w, BD, BH, BW)
    n0 = pid_n * BLOCK_N
    split = tl.program_id(1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    blocks_c = tl.cdiv(C, BLOCK_K)
    # Where a launch has too few tiles to fill the device (the 8³ and 16³ sites), the (tap, channel)
    # loop is split too (grid axis 1): fp32 partials per split, added in index order by `sum_splits`.
    first = split * iters_per_split
    last = tl.minimum(first + iters_per_split, KD * KH * KW * blocks_c)
    # On Hopper each descriptor load is one copy by the tensor memory accelerator into shared memory,
    # so no thread computes a gather address; coordinates outside the volume, negative ones included,
    # read as zero.
    for it in range(first, last):
        tap = it // blocks_c
        c0 = (it - tap * blocks_c) * BLOCK_K
        kd, kh, kw = tap_coords(tap, KH, KW)
        if SUB:  # dy of a transposed conv, kernel = stride, through its subsampled view (BD = 1)
            a = x_desc.load([(n * D + d0) * KD + kd, h0, kh, w0, kw * C + c0])
            b = tl.trans(w_desc.load([n0, tap, c0]).reshape(BLOCK_N, BLOCK_K))
        elif MIRROR:  # backward-data, stride 1 only: the forward's mirror image, no flip or copy of W
            a = x_desc.load([n, d0 + PD - kd * DD, h0 + PH - kh * DH, w0 + PW - kw * DW, c0])
            b = w_desc.load([c0, tap, n0]).reshape(BLOCK_K, BLOCK_N)
        else:
            a = x_desc.load([n, d0 - PD + kd * DD, h0 - PH + kh * DH, w0 - PW + kw * DW, c0])
            b = tl.trans(w_desc.load([n0, tap, c0]).reshape(BLOCK_N, BLOCK_K))
        acc = mma(a.reshape(BLOCK_M, BLOCK_K), b, acc, PRECISION, UPCAST)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < CO
    if HAS_BIAS:  # once: into split 0's partial
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    # Outputs are written with ordinary masked stores, so any strides.
    r = tl.arange(0, BLOCK_M)
    od = d0 + r // (BH * BW)
    oh = h0 + (r // BW) % BH
    ow = w0 + r % BW
    mask_m = (od < D) & (oh < H) & (ow < W)
    y_row = (split.to(tl.int64) * sys + n.to(tl.int64) * syn + od.to(tl.int64) * syd
             + oh.to(tl.int64) * syh + ow.to(tl.int64) * syw)
    y_off = y_row[:, None] + offs_n[None, :].to(tl.int64) * syc
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _wgrad_store(p_ptr, acc, split, tap, offs_r, offs_c, R, C, Q):
    p_off = (split.to(tl.int64) * R * Q + offs_r[:, None].to(tl.int64) * Q
             + (tap * C + offs_c)[None, :])
    tl.store(p_ptr + p_off, acc.to(p_ptr.dtype.element_ty),
             mask=(offs_r < R)[:, None] & (offs_c < C)[None, :])


@launched
@triton.jit
def _conv_box_wgrad_kernel(
    g_desc, x_desc, p_ptr,
    R, C, D, tiles_d, tiles_h, tiles_w, num_boxes, boxes_per_split,
    PD, PH, PW, DD, DH, DW,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, TW: tl.constexpr, SUB: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BD: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    # Split-K over the boxes (grid axis 1), the fp32 partials added in index order by `sum_splits`;
    # the split count makes whole waves of programs (`wave_split_plan`).
    # Each program owns TW (1, 2 or 3) neighbouring kw taps: one load of the dy box feeds TW products.
    BLOCK_M: tl.constexpr = BD * BH * BW
    pid = tl.program_id(0)
    split = tl.program_id(1)
    blocks_r = tl.cdiv(R, BLOCK_R)
    blocks_c = tl.cdiv(C, BLOCK_Q)
    pid_r = pid % blocks_r  # neighbouring programs read the same x boxes
    t = pid // blocks_r
    cb = t % blocks_c
    tg = t // blocks_c  # tap group: (kd, kh, kw0)
    groups_w: tl.constexpr = KW // TW
    kw0 = (tg % groups_w) * TW
    kh = (tg // groups_w) % KH
    kd = tg // (groups_w * KH)
    r0 = pid_r * BLOCK_R
    c0 = cb * BLOCK_Q
    acc0 = tl.zeros((BLOCK_R, BLOCK_Q), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_R, BLOCK_Q), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, BLOCK_Q), dtype=tl.float32)
    first = split * boxes_per_split
    last = tl.minimum(first + boxes_per_split, num_boxes)
    for box in range(first, last):
        n, d0, h0, w0 = _box_origin(box, tiles_d, tiles_h, tiles_w, BD, BH, BW)
        gt = tl.trans(g_desc.load([n, d0, h0, w0, r0]).reshape(BLOCK_M, BLOCK_R))
        if SUB:  # x is dy of a transposed conv, kernel = stride: its subsampled view (BD = 1);
            # the kw tap moves along the view's channel dim, C channels per tap
            xd = (n * D + d0) * KD + kd
            xg = x_desc.load([xd, h0, kh, w0, kw0 * C + c0]).reshape(BLOCK_M, BLOCK_Q)
        else:
            xd = d0 - PD + kd * DD
            xh = h0 - PH + kh * DH
            xw = w0 - PW + kw0 * DW
            xg = x_desc.load([n, xd, xh, xw, c0]).reshape(BLOCK_M, BLOCK_Q)
        acc0 = mma(gt, xg, acc0, PRECISION, UPCAST)
        if TW > 1:
            if SUB:
                xg = x_desc.load([xd, h0, kh, w0, (kw0 + 1) * C + c0]).reshape(BLOCK_M, BLOCK_Q)
            else:
                xg = x_desc.load([n, xd, xh, xw + DW, c0]).reshape(BLOCK_M, BLOCK_Q)
            acc1 = mma(gt, xg, acc1, PRECISION, UPCAST)
        if TW > 2:
            if SUB:
                xg = x_desc.load([xd, h0, kh, w0, (kw0 + 2) * C + c0]).reshape(BLOCK_M, BLOCK_Q)
            else:
                xg = x_desc.load([n, xd, xh, xw + 2 * DW, c0]).reshape(BLOCK_M, BLOCK_Q)
            acc2 = mma(gt, xg, acc2, PRECISION, UPCAST)

    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_c = c0 + tl.arange(0, BLOCK_Q)
    Q = KD * KH * KW * C
    tap = (kd * KH + kh) * KW + kw0
    _wgrad_store(p_ptr, acc0, split, tap, offs_r, offs_c, R, C, Q)
    if TW > 1:
        _wgrad_store(p_ptr, acc1, split, tap + 1, offs_r, offs_c, R, C, Q)
    if TW > 2:
        _wgrad_store(p_ptr, acc2, split, tap + 2, offs_r, offs_c, R, C, Q)


# --- host side ------------------------------------------------------------------------------------

def box_shape(size: tuple, block_m: int) -> tuple:
    """(BD, BH, BW): a box of `block_m` voxels (powers of two) that hugs the volume's W, then H."""
    d, h, w = size
    bw = min(next_pow2(w), block_m)
    bh = min(next_pow2(h), block_m // bw)
    bd = max(1, block_m // (bw * bh))
    return bd, bh, bw


def flat_box_shape(size: tuple, block_m: int) -> tuple:
    """(1, BH, BW): box_shape's box within one (d) plane, for the subsampled view, whose first dim
    runs over (n, d, kd) together and so takes one d per box."""
    h, w = size[1:]
    bw = min(next_pow2(w), block_m)
    return 1, min(next_pow2(h), block_m // bw), bw


# Transposed convs with kernel = stride (the U-Net's upsampling), backward passes (SUB=True): dy is
# read through the 5-D view [N·D, H/k, k, W/k, k·C] of its own memory (`subsampled_desc`), in which the
# tap (a, b, c) of a one-plane box of input voxels is a single box; backward-data is then the forward
# GEMM over (tap, Cout), backward-weight the wgrad GEMM with x in dy's place. Used from 64³ input
# voxels (`TRANSPOSED_BOX_MIN_VOXELS`).

def sub_block_k(c: int, block: int) -> int:
    """Channels per step through the subsampled view: at most `block` and dividing c, so a step
    never runs into the next tap's channels (the view's last dim holds kw·C + c)."""
    return min(block, c & -c)


def subsampled_desc(dy: torch.Tensor, kernel: tuple, block: list):
    """dy (N, C, D, H, W) of a transposed conv with kernel = stride = (kd, kh, kw), channels-last,
    as a descriptor over the 5-D view [N·D, H/kh, kh, W/kw, kw·C]: element
    [(n·D/kd + d')·kd + a, h', b, w', c·C + co] is dy[n, co, d'·kd + a, h'·kh + b, w'·kw + c],
    so one box of it is the tap (a, b, c) of a box of input voxels."""
    n, c, d, h, w = dy.shape
    kd, kh, kw = kernel
    view = dy.as_strided((n * d, h // kh, kh, w // kw, kw * c),
                         (h * w * c, kh * w * c, w * c, kw * c, 1))
    return TensorDescriptor.from_tensor(view, block)


def _operand_box_desc(t: torch.Tensor, box: tuple, block_c: int, kernel: tuple, sub: bool):
    """The descriptor of the shifted-box operand t: boxes (BD, BH, BW) × block_c channels over t's
    NDHWC view, or (sub) one-plane boxes over t's subsampled view (`subsampled_desc`)."""
    if sub:
        return subsampled_desc(t, kernel, [1, box[1], 1, box[2], block_c])
    return TensorDescriptor.from_tensor(_ndhwc(t), [1, *box, block_c])


@functools.lru_cache(maxsize=1024)
def _box_launch(out_shape: tuple, c: int, co: int, kernel: tuple, tile, sub: bool,
                device: torch.device) -> tuple:
    """Launch geometry of `conv_box`, a pure function of shapes, tile and device, computed once per
    key (a launch's host time is paid on every call): (box, channel block, box tiles per dim,
    boxes, programs, splits, (tap, channel) steps per split)."""
    size = tuple(out_shape[2:])
    box = flat_box_shape(size, tile.block_m) if sub else box_shape(size, tile.block_m)
    block_k = sub_block_k(c, tile.block_k) if sub else tile.block_k
    tiles, num_boxes = _box_grid(out_shape, box)
    programs = num_boxes * cdiv(co, tile.block_n)
    iters = kernel[0] * kernel[1] * kernel[2] * cdiv(c, block_k)
    # Split only a launch of less than one wave: more tiles already keep every multiprocessor busy.
    numel = out_shape[0] * co * size[0] * size[1] * size[2]
    s, per_split = (split_plan(device, programs, iters, numel)
                    if programs < sm_count(device) else (1, iters))
    return box, block_k, tiles, num_boxes, programs, s, per_split


def _box_grid(shape: tuple, box: tuple) -> tuple:
    """((tiles_d, tiles_h, tiles_w), boxes in all) of boxes `box` over a volume (N, C, D, H, W)."""
    tiles = tuple(cdiv(shape[2 + i], box[i]) for i in range(3))
    return tiles, shape[0] * tiles[0] * tiles[1] * tiles[2]


def _ndhwc(t: torch.Tensor) -> torch.Tensor:
    """The [N, D, H, W, C] view of a channels-last NCDHW tensor (no copy)."""
    return t.permute(0, 2, 3, 4, 1)


def _taps_view(w: torch.Tensor) -> torch.Tensor:
    """A channels_last_3d weight (Cout, Cin, kd, kh, kw) as its dense [Cout, taps, Cin] storage: the
    kernels read the weight in place through a 3-D descriptor over this view."""
    co, ci = w.shape[:2]
    return w.permute(0, 2, 3, 4, 1).reshape(co, -1, ci)


def box_supported(tensors: tuple, w_shape, stride: tuple) -> bool:
    """Whether the box kernels take a stride-1 conv of weight shape w_shape whose operands (x, w,
    dy: what the direction reads) are `tensors`. A pure function of device, dtype, layout, shape.

    Requirements: CUDA device with tensor descriptors (or the interpreter), stride 1, x (or dy)
    channels-last dense, output channels a multiple of 8 (16-byte rows of dy, what the copy engine
    needs), and a channels-last weight. Narrow inputs (the RGB stem) are rewritten first by
    `fold.box_operands`."""
    if tuple(stride) != (1, 1, 1) or w_shape[0] % 8:  # dy's rows; odd Cin: box_operands
        return False
    return _descriptor_operands(tensors)


def transposed_box_supported(tensors: tuple, w_shape) -> bool:
    """Whether the box kernels take a backward pass of a transposed conv with kernel = stride
    (weight (Cin, Cout, k…)) whose operands are `tensors`, dy first: Cin a multiple of 8, Cout of 16
    (a step through dy's subsampled view stays within one tap), at least 16 input voxels per (d)
    plane (the box is one plane). A pure function of device, dtype, layout, shape."""
    cin, cout, kd, kh, kw = w_shape
    dy = tensors[0]
    plane = (next_pow2(dy.shape[3] // kh) * next_pow2(dy.shape[4] // kw))
    voxels = dy.shape[2] * dy.shape[3] * dy.shape[4] // (kd * kh * kw)
    return (cin % 8 == 0 and cout % 16 == 0 and plane >= 16
            and voxels >= TRANSPOSED_BOX_MIN_VOXELS and _descriptor_operands(tensors))


# Input voxels per sample from which the transposed convs' backward passes take the box kernels:
# below it their one-plane boxes leave few, short programs and the gather kernels are faster
# (H200 timings in docs/kernels.md).
TRANSPOSED_BOX_MIN_VOXELS = 64 ** 3


def _descriptor_operands(tensors: tuple) -> bool:
    """Tensor descriptors here (Hopper, or the interpreter) and operands they can read: one dtype,
    16-bit on the GPU, channels-last dense."""
    if TensorDescriptor is None:
        return False
    t0 = tensors[0]
    if t0.is_cuda:
        # Tensor descriptors are Hopper's copy engine; fp32 boxes of 64 channels exceed its
        # 128-byte swizzled rows, so fp32 keeps the gather kernels on the GPU.
        if cuda_major(t0.device) < 9 or t0.dtype == torch.float32:
            return False
    return all(t.dtype == t0.dtype and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
               and t.is_contiguous(memory_format=torch.channels_last_3d) for t in tensors)


def conv_box(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bias, padding: tuple,
             dilation: tuple, mirror: bool, tile, allow_tf32: bool = False,
             sub: bool = False) -> torch.Tensor:
    """Forward (mirror=False: x is the input, out is y) or backward-data (mirror=True: x is dy,
    out is dx) of a stride-1 conv with weight w (Cout, Cin, kd, kh, kw), channels-last.
    sub=True: backward-data of a transposed conv with kernel = stride (x is its dy, w its weight
    (Cin, Cout, k…), out is dx), each tap a box of dy's subsampled view (`subsampled_desc`)."""
    k = tuple(w.shape[2:])
    # reduction channels (the weight's, zero-padded ones included), output channels (out's)
    c, co = w.shape[0 if mirror else 1], out.shape[1]
    box, block_k, tiles, num_boxes, programs, s, per_split = _box_launch(
        tuple(out.shape), c, co, k, tile, sub, x.device)
    bd, bh, bw = box
    x_desc = _operand_box_desc(x, box, block_k, k, sub)
    w_block = [block_k, 1, tile.block_n] if mirror else [tile.block_n, 1, block_k]
    w_desc = TensorDescriptor.from_tensor(_taps_view(w), w_block)
    n, _, d, h, wd = out.shape
    if s == 1:
        target, split_stride = out, 0
    else:  # fp32 partials [S, N, D, H, W, C], summed in order into a dense channels-last result
        target = torch.empty((s, n, d, h, wd, co), device=x.device, dtype=torch.float32)
        target = target.permute(0, 1, 5, 2, 3, 4)
        split_stride = target.stride(0)
    _conv_box_kernel[(programs, s)](
        x_desc, w_desc, bias if bias is not None else w, target,
        c, co, d, h, wd, *tiles, num_boxes, per_split, split_stride, *target.stride()[-5:],
        *padding, *dilation, *k,
        MIRROR=mirror, SUB=sub, HAS_BIAS=bias is not None, **dot_mode(x, allow_tf32),
        BD=bd, BH=bh, BW=bw, BLOCK_N=tile.block_n, BLOCK_K=block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if s > 1:
        dense = out.is_contiguous(memory_format=torch.channels_last_3d)
        result = out if dense else torch.empty_like(out, memory_format=torch.channels_last_3d)
        sum_splits(target.permute(0, 1, 3, 4, 5, 2).reshape(s, -1),
                   result.permute(0, 2, 3, 4, 1).view(-1))
        if not dense:
            out.copy_(result)
    return out


def programs_per_sm(stage_bytes: int, stages: int, warps: int, acc_elems: int) -> int:
    """Programs one multiprocessor holds at once (Hopper: 228 KiB of shared memory, 1 KiB reserved
    per block; 64 K registers), estimated from a tile's pipeline stages and its fp32 accumulators
    plus ~64 registers a thread."""
    smem = stages * stage_bytes + 1024
    threads = warps * 32
    regs = threads * (acc_elems // threads + 64)
    return max(1, min(228 * 1024 // smem, 65536 // regs))


def taps_per_program(kw: int, tile) -> int:
    """kw taps one wgrad program owns: the tile's (1-3) where it divides the kernel's kw."""
    t = max(1, min(3, tile.taps))
    return t if kw % t == 0 else 1


@functools.lru_cache(maxsize=1024)
def _boxw_launch(g_shape: tuple, r: int, c: int, kernel: tuple, tile, sub: bool, elem_bytes: int,
                 device: torch.device) -> tuple:
    """Launch geometry of `conv_box_weight_grad`, computed once per key (see `_box_launch`): (box,
    channel block, box tiles per dim, boxes, kw taps per program, programs, splits, boxes per split)."""
    size = tuple(g_shape[2:])
    box = flat_box_shape(size, tile.block_k) if sub else box_shape(size, tile.block_k)
    block_q = sub_block_k(c, tile.block_n) if sub else tile.block_n
    tiles, num_boxes = _box_grid(g_shape, box)
    taps = kernel[0] * kernel[1] * kernel[2]
    tw = taps_per_program(kernel[2], tile)
    programs = cdiv(r, tile.block_m) * cdiv(c, block_q) * (taps // tw)
    # a stage holds one dy box and tw x boxes (the tile's sizes); tw fp32 accumulators
    per_sm = programs_per_sm(tile.block_k * (tile.block_m + tw * tile.block_n) * elem_bytes,
                             tile.num_stages, tile.num_warps, tile.block_m * tile.block_n * tw)
    s, per_split = wave_split_plan(device, programs, num_boxes, r * c * taps,
                                   2 * box[0] * box[1] * box[2] * tile.block_m * block_q * tw, per_sm)
    return box, block_q, tiles, num_boxes, tw, programs, s, per_split


def conv_box_weight_grad(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, kernel: tuple,
                         padding: tuple, dilation: tuple, tile,
                         allow_tf32: bool = False, sub: bool = False) -> torch.Tensor:
    """dW (R, C, kd, kh, kw), channels_last_3d, of the stride-1 conv x -> g (g: output gradient).
    sub=True: dW (Cin, Cout, k…) of a transposed conv with kernel = stride, g its input x and x its
    dy (read through the subsampled view, `subsampled_desc`), padding 0, dilation 1.

    Tile fields: block_m = output channels R per program, block_n = input channels C per program,
    block_k = voxels per box, taps = kw taps per program (1-3)."""
    assert out.is_contiguous(memory_format=torch.channels_last_3d), "out must be channels_last_3d"
    r = out.shape[0]  # g's channels, or fewer where g (dy) was zero-padded (the head)
    taps = kernel[0] * kernel[1] * kernel[2]
    # Input channels per tap as `out` stores them: x's, or fewer where x was zero-padded, or
    # KH·KW·Cin for a folded x (box_operands); the masks keep the padding out of `out`.
    c = out.numel() // (r * taps)
    box, block_q, tiles, num_boxes, tw, programs, s, per_split = _boxw_launch(
        tuple(g.shape), r, c, kernel, tile, sub, g.element_size(), g.device)
    bd, bh, bw = box
    x_desc = _operand_box_desc(x, box, block_q, kernel, sub)
    g_desc = TensorDescriptor.from_tensor(_ndhwc(g), [1, bd, bh, bw, tile.block_m])
    partials = out if s == 1 else torch.empty((s, r * c * taps), device=g.device,
                                              dtype=torch.float32)
    _conv_box_wgrad_kernel[(programs, s)](
        g_desc, x_desc, partials, r, c, g.shape[2], *tiles, num_boxes, per_split, *padding,
        *dilation, *kernel, TW=tw, SUB=sub, **dot_mode(x, allow_tf32), BD=bd, BH=bh, BW=bw,
        BLOCK_R=tile.block_m, BLOCK_Q=block_q,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if s > 1:
        sum_splits(partials, out.permute(0, 2, 3, 4, 1).view(-1))
    return out
