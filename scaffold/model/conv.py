"""The convolution rungs' autograd: each direction on our kernels or on ATen, as a route says.

A conv site has three directions per step: forward, backward-data and backward-weight. A route
(three entries, from scaffold.model.policy) sends each to our Triton launchers (True;
scaffold.kernels.conv), to our Gluon kernels for Hopper (GLUON, the three directions of 3×3×3 convs;
scaffold.kernels.conv.gluon and .gluon_wgrad; where one cannot take a call, or has failed, the Triton
launcher does) or to ATen (False: cuDNN on CUDA, under the process's determinism flags); the `triton`
rung is the route (True, True, True). The bias gradient is our split reduction (`bias_grad`) whatever the route: it
reads dy once, faster than ATen's sum at every size the model has (H200: 0.85 against 0.89 ms at
64@256³, 0.046 against 0.146 ms at 128@64³; docs/performance-log.md). Both sides are deterministic,
so a mixed route gives bits that depend only on (device, dtype, shape).

Entry points mirror F.conv3d / F.conv_transpose3d, autocast included: under autocast x, weight and
bias are cast to the autocast dtype (differentiably, so gradients reach fp32 master weights) and the
op runs with autocast off, returning the autocast dtype as the vendor op does. Outputs are
channels_last_3d (NDHWC); gradients come back in each input's dtype.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from scaffold.kernels import conv as K
from scaffold.kernels.conv import gluon as G
from scaffold.kernels.conv import gluon_wgrad as GW

ALL_TRITON = (True, True, True)
GLUON = "gluon"  # a route entry: our Gluon kernel (truthy: ours, not ATen)
_NO_PAD, _NO_DIL = (0, 0, 0), (1, 1, 1)


# Directions whose Gluon kernel failed (a compile error, or a kernel bug that raised), with the first
# error in one line: that direction runs the Triton launchers from then on, in every site (the census
# lists them: `gluon_failures`). Out-of-memory errors are not failures of the kernel and propagate.
_GLUON_FAILED: dict[str, str] = {}


def gluon_failures() -> dict[str, str]:
    """{direction: first error} of the Gluon kernels that failed in this process."""
    return dict(_GLUON_FAILED)


def _gluon_or_triton(direction: str, gluon_call, triton_call):
    if direction not in _GLUON_FAILED:
        try:
            return gluon_call()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the kernel: fall back, say so once
            from scaffold.model.policy import LadderWarning

            _GLUON_FAILED[direction] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            warnings.warn(f"Gluon conv {direction} failed, running the Triton launchers for it from now "
                          f"on: {_GLUON_FAILED[direction]}", LadderWarning, stacklevel=2)
    return triton_call()


def _forward(x, w, bias, stride, padding, dilation, on):
    triton = lambda: K.conv3d_forward(x, w, bias, stride, padding, dilation)  # noqa: E731
    if on == GLUON and G.supported(x, w, stride, padding, dilation):
        return _gluon_or_triton("forward", lambda: G.conv3d_forward(x, w, bias=bias), triton)
    return triton()


def _backward_data(dy, w, x_shape, stride, padding, dilation, on):
    triton = lambda: K.conv3d_backward_data(dy, w, x_shape, stride, padding, dilation)  # noqa: E731
    if on == GLUON and G.supported(dy, w.transpose(0, 1), stride, padding, dilation):
        return _gluon_or_triton("backward-data", lambda: G.conv3d_backward_data(dy, w), triton)
    return triton()


def _backward_weight(dy, x, w, stride, padding, dilation, on):
    triton = lambda: K.conv3d_backward_weight(dy, x, w.shape, w.dtype, stride, padding, dilation)  # noqa: E731
    if on == GLUON and GW.supported(dy, x, w.shape, stride, padding, dilation):
        return _gluon_or_triton("backward-weight",
                                lambda: GW.conv3d_backward_weight(dy, x, dtype=w.dtype), triton)
    return triton()


class _ConvFn(torch.autograd.Function):
    """conv3d (transposed=False) or conv_transpose3d with kernel = stride (transposed=True)."""

    @staticmethod
    def forward(ctx, x, w, bias, stride, padding, dilation, transposed, route, out=None):
        w = K.channels_last_weight(w)
        if transposed:  # a Triton forward writes into `out` when given (any strides); ATen ignores it
            y = (K.conv_transpose3d_forward(x, w, bias, out=out) if route[0]
                 else F.conv_transpose3d(x, w, bias, stride))
        elif route[0]:
            y = _forward(x, w, bias, stride, padding, dilation, route[0])
        else:
            y = F.conv3d(x, w, bias, stride, padding, dilation)
        ctx.save_for_backward(x, w)
        ctx.geometry, ctx.transposed, ctx.route = (stride, padding, dilation), transposed, route
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        g, transposed, route = ctx.geometry, ctx.transposed, ctx.route
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        # The directions routed to ATen, in one call of its convolution backward.
        mask = [need_dx and not route[1], need_dw and not route[2], False]
        dx = dw = db = None
        if any(mask):
            dx, dw, _ = torch.ops.aten.convolution_backward(dy, x, w, None, *g, transposed, _NO_PAD,
                                                            1, mask)
        if need_dx and route[1]:
            dx = (K.conv_transpose3d_backward_data(dy, w, x.shape) if transposed
                  else _backward_data(dy, w, x.shape, *g, route[1]))
        if need_dw and route[2]:
            dw = (K.conv_transpose3d_backward_weight(dy, x, w.shape, w.dtype) if transposed
                  else _backward_weight(dy, x, w, *g, route[2]))
        if need_db:  # ours whatever the route: faster than ATen's sum at every measured size
            db = K.bias_grad(dy, ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None


def _apply(x, weight, bias, stride, padding, dilation, transposed, route, out=None) -> torch.Tensor:
    kind = x.device.type
    args = (tuple(stride), tuple(padding), tuple(dilation), transposed, tuple(route))
    if not torch.is_autocast_enabled(kind):
        return _ConvFn.apply(x, weight, bias, *args, out)
    dt = torch.get_autocast_dtype(kind)  # cast as autocast casts F.conv3d's inputs
    cast = (lambda t: t if t is None or not t.is_floating_point() else t.to(dt))
    with torch.autocast(kind, enabled=False):
        return _ConvFn.apply(cast(x), cast(weight), cast(bias), *args, out)


def conv3d(x, weight, bias, stride, padding, dilation, route=ALL_TRITON) -> torch.Tensor:
    """F.conv3d(x, weight, bias, stride, padding, dilation) (groups = 1) with each direction where
    `route` says (forward, backward-data, backward-weight: True = Triton, GLUON, False = ATen)."""
    return _apply(x, weight, bias, stride, padding, dilation, False, route)


def conv_transpose3d(x, weight, bias, stride, route=ALL_TRITON, out=None) -> torch.Tensor:
    """F.conv_transpose3d(x, weight, bias, stride) for kernel == stride, padding 0, output_padding 0.
    `out`: where a Triton forward writes the output (then returned as a view of it); a forward on ATen
    returns a tensor of its own. Its dtype must be the one the op returns (the caller checks)."""
    if tuple(weight.shape[2:]) != tuple(stride):
        raise ValueError(f"conv_transpose3d: kernel {tuple(weight.shape[2:])} must equal stride "
                         f"{tuple(stride)}")
    return _apply(x, weight, bias, stride, _NO_PAD, _NO_DIL, True, route, out)
