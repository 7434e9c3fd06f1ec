"""Triton convolution rung: conv3d and conv_transpose3d (kernel = stride) with autograd.

Entry points mirror F.conv3d / F.conv_transpose3d, including autocast: when autocast is on for the
input's device, x, weight and bias are cast to the autocast dtype (differentiably, so gradients flow
back to fp32 master weights) and the op runs with autocast off, returning the autocast dtype, as the
vendor op does. Outputs are channels_last_3d (NDHWC). Gradients come back in each input's dtype.
fp32 operands multiply in IEEE fp32 (no tf32), so fp32 results match a float64 reference closely.

Stride-1 convs on channels-last 16-bit tensors with output channels divisible by 8 (every 3×3×3
site of the U-Net, the RGB stem with its taps folded into channels) run on the box kernels
(conv_box: tensor-descriptor loads of shifted voxel boxes), and so do the head's backward-weight (dy
padded to 16 channels) and the backward passes of transposed convs from 64³ input voxels (dy read
through a subsampled view); the rest on the gather kernels below.
Backward passes on the gather kernels:
  conv3d:           dx = transposed gather of dy (conv_fwd), dW = split-K GEMM (conv_bwd_weight),
                    db = split reduction (bias_grad)
  conv_transpose3d: dx = strided gather conv of dy (conv_fwd), dW = conv_bwd_weight(G = x, X = dy),
                    db = bias_grad(dy)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .bias_grad import bias_grad
from .common import triton_usable
from .conv_box import (box_channels, box_operands, box_supported, conv_box, conv_box_weight_grad,
                       pad_channels, transposed_box_supported)
from .conv_bwd_weight import conv_weight_grad
from .conv_fwd import conv_gather
from .conv_transpose import conv_transpose_scatter
from .routes import conv_route
from .tiles import conv_tile

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


# Which directions run on Triton: (forward, backward-data, backward-weight). The `triton` rung runs all
# three; the `routed` rung takes a measured route per shape (routes.py), the rest on cuDNN.
ALL_TRITON = (True, True, True)


def _backward(ctx, dy, x, w, geometry, transposed, triton_dx, triton_dw):
    """(dx, dw, db) of a conv or transposed conv: the directions its route sends to Triton through
    `triton_dx()` / `triton_dw()` (and our bias reduction), the others in one call of ATen's
    convolution backward (cuDNN on CUDA, under the process's determinism flags)."""
    route = ctx.route
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    mask = [need_dx and not route[1], need_dw and not route[2], need_db and not route[2]]
    dx = dw = db = None
    if any(mask):
        bias_sizes = [w.shape[1] if transposed else w.shape[0]] if mask[2] else None
        dx, dw, db = torch.ops.aten.convolution_backward(dy, x, w, bias_sizes, *geometry, transposed,
                                                         (0, 0, 0), 1, mask)
        db = None if db is None else db.to(ctx.bias_dtype)
    if need_dx and route[1]:
        dx = triton_dx()
    if need_dw and route[2]:
        dw = triton_dw()
    if need_db and route[2]:
        db = bias_grad(dy, ctx.bias_dtype)
    return dx, dw, db


class _Conv3dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, stride, padding, dilation, route):
        w = channels_last_weight(w)
        if route[0]:
            y = conv3d_forward(x, w, bias, stride, padding, dilation)
        else:
            y = F.conv3d(x, w, bias, stride, padding, dilation)
        ctx.save_for_backward(x, w)
        ctx.geometry = (stride, padding, dilation)
        ctx.route = route
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        g = ctx.geometry
        dx, dw, db = _backward(ctx, dy, x, w, g, False,
                               lambda: conv3d_backward_data(dy, w, x.shape, *g),
                               lambda: conv3d_backward_weight(dy, x, w.shape, w.dtype, *g))
        return dx, dw, db, None, None, None, None


class _ConvTranspose3dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, route):
        w = channels_last_weight(w)
        if route[0]:
            y = conv_transpose3d_forward(x, w, bias)
        else:
            y = F.conv_transpose3d(x, w, bias, stride=tuple(w.shape[2:]))
        ctx.save_for_backward(x, w)
        ctx.route = route
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        geometry = (tuple(w.shape[2:]), (0, 0, 0), (1, 1, 1))  # stride = kernel
        dx, dw, db = _backward(ctx, dy, x, w, geometry, True,
                               lambda: conv_transpose3d_backward_data(dy, w, x.shape),
                               lambda: conv_transpose3d_backward_weight(dy, x, w.shape, w.dtype))
        return dx, dw, db, None


def _autocast_inputs(x, w, bias):
    """Cast as autocast casts F.conv3d's inputs; returns (x, w, bias, autocast_was_on)."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x, w, bias, False
    dt = torch.get_autocast_dtype(kind)
    cast = (lambda t: t if t is None or not t.is_floating_point() else t.to(dt))
    return cast(x), cast(w), cast(bias), True


def conv3d(x, weight, bias, stride, padding, dilation, route=ALL_TRITON) -> torch.Tensor:
    """F.conv3d(x, weight, bias, stride, padding, dilation) on the Triton rung (groups = 1); `route`
    says which directions run on Triton (the others on ATen/cuDNN)."""
    x, weight, bias, autocast_on = _autocast_inputs(x, weight, bias)
    geometry = (tuple(stride), tuple(padding), tuple(dilation))
    if not autocast_on:
        return _Conv3dFn.apply(x, weight, bias, *geometry, tuple(route))
    with torch.autocast(x.device.type, enabled=False):
        return _Conv3dFn.apply(x, weight, bias, *geometry, tuple(route))


def conv_transpose3d(x, weight, bias, stride, route=ALL_TRITON) -> torch.Tensor:
    """F.conv_transpose3d(x, weight, bias, stride) for kernel == stride, padding 0, output_padding 0."""
    if tuple(weight.shape[2:]) != tuple(stride):
        raise ValueError(f"conv_transpose3d: kernel {tuple(weight.shape[2:])} must equal stride "
                         f"{tuple(stride)}")
    x, weight, bias, autocast_on = _autocast_inputs(x, weight, bias)
    if not autocast_on:
        return _ConvTranspose3dFn.apply(x, weight, bias, tuple(route))
    with torch.autocast(x.device.type, enabled=False):
        return _ConvTranspose3dFn.apply(x, weight, bias, tuple(route))


def conv3d_routed(x, weight, bias, stride, padding, dilation) -> torch.Tensor:
    """conv3d with each direction on the rung its measured route names (routes.py)."""
    return conv3d(x, weight, bias, stride, padding, dilation,
                  conv_route(x, weight, stride, padding, dilation) or ALL_TRITON)


def conv_transpose3d_routed(x, weight, bias, stride) -> torch.Tensor:
    """conv_transpose3d with each direction on the rung its measured route names (routes.py)."""
    route = conv_route(x, weight, stride, (0, 0, 0), (1, 1, 1), transposed=True)
    return conv_transpose3d(x, weight, bias, stride, route or ALL_TRITON)


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


def conv3d_routed_supported(x, weight, bias, stride, padding, dilation, groups) -> bool:
    """True when the `routed` rung takes this call: Triton supports it and a measured route sends at
    least one of its directions to Triton."""
    route = conv_route(x, weight, stride, padding, dilation)
    return route is not None and any(route) and conv3d_supported(x, weight, bias, stride, padding,
                                                                  dilation, groups)


def conv_transpose3d_routed_supported(x, weight, bias, stride, padding, output_padding, groups,
                                      dilation) -> bool:
    """conv_transpose3d's counterpart of conv3d_routed_supported."""
    route = conv_route(x, weight, stride, padding, dilation, transposed=True)
    return route is not None and any(route) and conv_transpose3d_supported(
        x, weight, bias, stride, padding, output_padding, groups, dilation)
