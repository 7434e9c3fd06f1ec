"""The directions of the Triton convolutions, each a launcher: conv3d forward, backward-data and
backward-weight, the same for the transposed conv with kernel = stride, and whether a call is supported.

Stride-1 convs on channels-last 16-bit tensors with output channels divisible by 8 (every 3×3×3 site of
the U-Net, the RGB stem with its taps folded into channels: fold.py) run on the box kernels (box.py:
tensor-descriptor loads of shifted voxel boxes), and so do the head's backward-weight (dy padded to 16
channels) and the backward passes of transposed convs from 64³ input voxels (dy read through a
subsampled view); the rest on the gather kernels: forward and backward-data as a gather GEMM
(gather.py), backward-weight as a split-K GEMM (weight_grad.py), the transposed forward as a scatter
(transpose.py), bias gradients as a split reduction (bias_grad.py). Tiles come from tiles.py.
Launchers take channels-last operands and write NDHWC outputs; fp32 operands multiply in IEEE fp32.
"""
from __future__ import annotations

import torch

from ..lib.device import triton_usable
from .box import box_supported, conv_box, conv_box_weight_grad, transposed_box_supported
from .fold import box_channels, box_operands, pad_channels
from .gather import conv_gather
from .tiles import conv_tile
from .transpose import conv_transpose_scatter
from .weight_grad import conv_weight_grad

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CL = torch.channels_last_3d


def _out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def channels_last_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight with a unit-stride channel dim, copied (once per call; weights are small next to
    the activations) only when neither channel dim has unit stride: the kernels read the weight in
    place, and a contiguous (Cout, Cin, k, k, k) weight has stride 27 on Cin, which no tile can
    load coalesced. channels_last_3d weights (what autocast keeps for an NDHWC model) pass as is."""
    if w.stride(0) == 1 or w.stride(1) == 1:
        return w
    return w.contiguous(memory_format=_CL)


def _taps(w: torch.Tensor) -> int:
    return w.shape[2] * w.shape[3] * w.shape[4]


def _voxels(t: torch.Tensor) -> int:
    """Voxels of one sample: what sets how many box tiles a launch has."""
    return t.shape[2] * t.shape[3] * t.shape[4]


def conv3d_forward(x, w, bias, stride, padding, dilation, out=None):
    """y = conv3d(x, w, bias) as NDHWC; `out` (any strides, e.g. NaN-poisoned) is written if given."""
    n, _, *size = x.shape
    co, ci, *k = w.shape
    osize = [_out_size(size[i], k[i], stride[i], padding[i], dilation[i]) for i in range(3)]
    if out is None:
        out = torch.empty((n, co, *osize), device=x.device, dtype=x.dtype, memory_format=_CL)
    if box_supported((x, w), w.shape, stride):
        tile = conv_tile(x.device, x.dtype, "box", ci, co, _taps(w), _voxels(out))
        xb, wb, _, pb, db = box_operands(x, w, tuple(k), padding, dilation)
        return conv_box(xb, wb, out, bias, pb, db, False, tile)
    tile = conv_tile(x.device, x.dtype, "gather", ci, co, _taps(w))
    # Forward: K-channel = Cin (weight dim 1), N-channel = Cout (weight dim 0).
    w_view = (w, w.stride(1), w.stride(0), *w.stride()[2:])
    return conv_gather(x, w_view, out, bias, tuple(k), stride, padding, dilation, False, tile)


def conv3d_backward_data(dy, w, x_shape, stride, padding, dilation, out=None):
    """dx of conv3d: the transposed gather of dy with the channel-swapped weight."""
    co, ci, *k = w.shape
    if out is None:
        out = torch.empty(x_shape, device=dy.device, dtype=dy.dtype, memory_format=_CL)
    if box_supported((dy, w), w.shape, stride):
        tile = conv_tile(dy.device, dy.dtype, "box", co, ci, _taps(w), _voxels(out))
        wb = pad_channels(w, box_channels(ci))  # dx masked to ci
        return conv_box(dy, wb, out, None, padding, dilation, True, tile)
    tile = conv_tile(dy.device, dy.dtype, "gather", co, ci, _taps(w))
    w_view = (w, w.stride(0), w.stride(1), *w.stride()[2:])
    return conv_gather(dy, w_view, out, None, tuple(k), stride, padding, dilation, True, tile)


def conv3d_backward_weight(dy, x, w_shape, dtype, stride, padding, dilation, out=None):
    """dW of conv3d, shape w_shape, channels_last_3d, in `dtype`."""
    if out is None:
        out = torch.empty(w_shape, device=dy.device, dtype=dtype, memory_format=_CL)
    co, ci, *k = w_shape
    # Cout not a multiple of 8 (the head's 6 classes): dy zero-padded to 16 channels for the copy
    # engine, a few MB, then the same box kernel; the stores keep to the real rows.
    cp = box_channels(co)
    if box_supported((dy, x), (cp, *w_shape[1:]), stride):
        tile = conv_tile(dy.device, dy.dtype, "boxw", ci, co, k[0] * k[1] * k[2], _voxels(dy))
        xb, _, kb, pb, db = box_operands(x, None, tuple(k), padding, dilation)
        return conv_box_weight_grad(pad_channels(dy, cp), xb, out, kb, pb, db, tile)
    tile = conv_tile(dy.device, dy.dtype, "wgrad", ci, co, k[0] * k[1] * k[2])
    return conv_weight_grad(dy, x, out, tuple(k), stride, padding, dilation, tile)


def conv_transpose3d_forward(x, w, bias, out=None):
    """y = conv_transpose3d(x, w, bias, stride = kernel, padding 0) as NDHWC."""
    n, ci, *size = x.shape
    co, k = w.shape[1], w.shape[2:]
    if out is None:
        shape = (n, co, *(size[i] * k[i] for i in range(3)))
        out = torch.empty(shape, device=x.device, dtype=x.dtype, memory_format=_CL)
    tile = conv_tile(x.device, x.dtype, "convT", ci, co, _taps(w))
    return conv_transpose_scatter(x, w, bias, out, tile)


def conv_transpose3d_backward_data(dy, w, x_shape, out=None):
    """dx of the transposed conv: a gather conv of dy, kernel = stride, with weight (Cin, Cout, …)
    read as out-channel = Cin (dim 0), K-channel = Cout (dim 1)."""
    ci, co, *k = w.shape
    if out is None:
        out = torch.empty(x_shape, device=dy.device, dtype=dy.dtype, memory_format=_CL)
    if transposed_box_supported((dy, w), w.shape):
        tile = conv_tile(dy.device, dy.dtype, "box", co, ci, _taps(w), _voxels(out))
        return conv_box(dy, w, out, None, (0, 0, 0), (1, 1, 1), False, tile, sub=True)
    tile = conv_tile(dy.device, dy.dtype, "gather", co, ci, _taps(w))
    w_view = (w, w.stride(1), w.stride(0), *w.stride()[2:])
    k = tuple(k)
    return conv_gather(dy, w_view, out, None, k, k, (0, 0, 0), (1, 1, 1), False, tile)


def conv_transpose3d_backward_weight(dy, x, w_shape, dtype, out=None):
    """dW (Cin, Cout, kd, kh, kw) of the transposed conv: the conv weight gradient with G = x, X = dy."""
    if out is None:
        out = torch.empty(w_shape, device=dy.device, dtype=dtype, memory_format=_CL)
    ci, co, *k = w_shape
    k = tuple(k)
    if transposed_box_supported((dy, x), w_shape):  # rows: Cin (x), columns: Cout (dy)
        tile = conv_tile(dy.device, dy.dtype, "boxw", co, ci, k[0] * k[1] * k[2], _voxels(x))
        return conv_box_weight_grad(x, dy, out, k, (0, 0, 0), (1, 1, 1), tile, sub=True)
    tile = conv_tile(dy.device, dy.dtype, "wgrad", co, ci, k[0] * k[1] * k[2])
    return conv_weight_grad(x, dy, out, k, k, (0, 0, 0), (1, 1, 1), tile)


def _common_ok(x, weight, bias, groups) -> bool:
    if groups != 1 or x.dim() != 5 or weight.dim() != 5:
        return False
    if not triton_usable(x) or weight.device != x.device:
        return False
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        return False
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        return False
    if bias is not None and (bias.dim() != 1 or bias.device != x.device or bias.dtype not in _DTYPES):
        return False
    return x.numel() > 0 and x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4] < 2**31


def conv3d_supported(x, weight, bias, stride, padding, dilation, groups) -> bool:
    """True when conv3d(...) runs on Triton here: a pure function of device, dtype and shape."""
    if not _common_ok(x, weight, bias, groups) or weight.shape[1] != x.shape[1]:
        return False
    if bias is not None and bias.shape[0] != weight.shape[0]:
        return False
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        return False
    k = weight.shape[2:]
    out = [_out_size(x.shape[2 + i], k[i], stride[i], padding[i], dilation[i]) for i in range(3)]
    return min(out) > 0


def conv_transpose3d_supported(x, weight, bias, stride, padding, output_padding, groups,
                               dilation) -> bool:
    """True when conv_transpose3d(...) runs on Triton: kernel == stride, no padding, dilation 1."""
    if not _common_ok(x, weight, bias, groups) or weight.shape[0] != x.shape[1]:
        return False
    if bias is not None and bias.shape[0] != weight.shape[1]:
        return False
    return (tuple(weight.shape[2:]) == tuple(stride) and tuple(padding) == (0, 0, 0)
            and tuple(output_padding) == (0, 0, 0) and tuple(dilation) == (1, 1, 1))
