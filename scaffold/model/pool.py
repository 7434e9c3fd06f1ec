"""2×2×2 max pooling with a deterministic backward.

Under `torch.use_deterministic_algorithms(True)` PyTorch refuses the CUDA backward of max_pool3d (it
scatters with atomics). Here each window's 8 voxels are gathered into a trailing dimension and reduced
with `torch.max(dim=-1)`, which returns the FIRST maximal element in window order (d, h, w) — the one
max_pool3d picks, so the forward is bitwise the same and the gradient goes to exactly one element per
window, as max_pool's does. The backward is elementwise (a one-hot of the saved index times the
incoming gradient): no scatter, no atomics, deterministic on every device.

The gather works in the tensor's physical layout, so channels-last (NDHWC) input stays channels-last
and the window copy reads memory in order. This is the pool's `vendor` rung (every device, every
layout); on CUDA the ladder's `triton` rung (scaffold.kernels.pool) gives the same bits in one pass
each way.
"""
from __future__ import annotations

import torch


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()


def _windows(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """(N, C, D, H, W) -> windows (..., 8) with the window offsets (d, h, w) in row-major order; the
    leading dims are (N, D/2, H/2, W/2, C) for channels-last input, (N, C, D/2, H/2, W/2) otherwise."""
    n, c, d, h, w = x.shape
    if channels_last:
        v = x.permute(0, 2, 3, 4, 1).reshape(n, d // 2, 2, h // 2, 2, w // 2, 2, c)
        v = v.permute(0, 1, 3, 5, 7, 2, 4, 6)
    else:
        v = x.reshape(n, c, d // 2, 2, h // 2, 2, w // 2, 2).permute(0, 1, 2, 4, 6, 3, 5, 7)
    return v.reshape(*v.shape[:5], 8)


def _to_ncdhw(y: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """Pooled values in window-leading layout back to a logical (N, C, D', H', W') view."""
    return y.permute(0, 4, 1, 2, 3) if channels_last else y


class _MaxPool2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        channels_last = _channels_last(x)
        values, index = _windows(x, channels_last).max(dim=-1)
        ctx.save_for_backward(index.to(torch.uint8))
        ctx.channels_last = channels_last
        ctx.input_shape = x.shape
        return _to_ncdhw(values, channels_last)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (index,) = ctx.saved_tensors
        channels_last = ctx.channels_last
        n, c, d, h, w = ctx.input_shape
        g = grad.permute(0, 2, 3, 4, 1) if channels_last else grad  # window-leading layout
        offsets = torch.arange(8, device=grad.device, dtype=torch.uint8)
        hit = index.unsqueeze(-1) == offsets
        gw = torch.where(hit, g.unsqueeze(-1), 0.0)
        if channels_last:
            gw = gw.reshape(n, d // 2, h // 2, w // 2, c, 2, 2, 2).permute(0, 1, 5, 2, 6, 3, 7, 4)
            return gw.reshape(n, d, h, w, c).permute(0, 4, 1, 2, 3)
        gw = gw.reshape(n, c, d // 2, h // 2, w // 2, 2, 2, 2).permute(0, 1, 2, 5, 3, 6, 4, 7)
        return gw.reshape(n, c, d, h, w)


def max_pool2(x: torch.Tensor) -> torch.Tensor:
    """F.max_pool3d(x, 2) for (N, C, D, H, W) input with even D, H, W; deterministic backward."""
    if x.dim() != 5 or any(s % 2 for s in x.shape[2:]):
        raise ValueError(f"max_pool2: expected (N, C, D, H, W) with even D, H, W, got {tuple(x.shape)}")
    return _MaxPool2.apply(x)
