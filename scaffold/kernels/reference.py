"""Float64 references for the kernel tests: plain torch ops on upcast copies, on the CPU.

Add functions here; each returns float64 tensors computed without any Triton code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401


def f64(t: torch.Tensor) -> torch.Tensor:
    """A detached float64 CPU copy."""
    return t.detach().to(device="cpu", dtype=torch.float64)


def group_norm_relu(x, num_groups, weight, bias, eps, relu):
    """F.group_norm (then F.relu when `relu`) in float64."""
    w = None if weight is None else f64(weight)
    b = None if bias is None else f64(bias)
    y = F.group_norm(f64(x), num_groups, w, b, eps)
    return F.relu(y) if relu else y


def group_norm_relu_grads(x, num_groups, weight, bias, eps, relu, dy):
    """(dx, dweight, dbias) of `group_norm_relu` for the output gradient dy, in float64 (None where
    the parameter is None)."""
    xs = f64(x).requires_grad_()
    w = None if weight is None else f64(weight).requires_grad_()
    b = None if bias is None else f64(bias).requires_grad_()
    y = F.group_norm(xs, num_groups, w, b, eps)
    y = F.relu(y) if relu else y
    leaves = [t for t in (xs, w, b) if t is not None]
    grads = iter(torch.autograd.grad(y, leaves, f64(dy)))
    return tuple(next(grads) if t is not None else None for t in (xs, w, b))


def concat_channels(a, b):
    """cat([a, b], dim=1) in float64."""
    return torch.cat([f64(a), f64(b)], dim=1)


def conv3d_ref(x, w, b, stride, padding, dilation, grad_out=None):
    """Float64 conv3d and, given grad_out, its gradients: (y, dx, dw, db) (db None without bias)."""
    x64, w64 = f64(x).requires_grad_(), f64(w).requires_grad_()
    b64 = None if b is None else f64(b).requires_grad_()
    y = F.conv3d(x64, w64, b64, stride, padding, dilation)
    if grad_out is None:
        return y.detach(), None, None, None
    y.backward(f64(grad_out))
    return y.detach(), x64.grad, w64.grad, None if b64 is None else b64.grad


def conv_transpose3d_ref(x, w, b, stride, grad_out=None):
    """Float64 conv_transpose3d (padding 0) and, given grad_out, its gradients: (y, dx, dw, db)."""
    x64, w64 = f64(x).requires_grad_(), f64(w).requires_grad_()
    b64 = None if b is None else f64(b).requires_grad_()
    y = F.conv_transpose3d(x64, w64, b64, stride)
    if grad_out is None:
        return y.detach(), None, None, None
    y.backward(f64(grad_out))
    return y.detach(), x64.grad, w64.grad, None if b64 is None else b64.grad


def seg_loss_terms(logits, labels, weight, eps, grads=None):
    """The CE + soft Dice loss head (scaffold.loss.SegmentationLoss.terms) in float64: (loss, ce, dice (N,)),
    and, given grads = (g_loss, g_ce, g_dice), also dL/dlogits of g_loss·loss + g_ce·ce + Σ g_dice·dice
    as a fourth element."""
    z = f64(logits).requires_grad_(grads is not None)
    y = labels.detach().cpu().long()
    c = z.shape[1]
    logp = torch.log_softmax(z, dim=1)
    target = (y.unsqueeze(1) == torch.arange(c).view(1, -1, 1, 1, 1)).to(torch.float64)
    wy = f64(weight)[y]
    ce = -(wy * (target * logp).sum(1)).sum() / wy.sum()
    p, g = logp[:, 1:].exp(), target[:, 1:]
    dims = (2, 3, 4)
    present = g.sum(dims)
    dice = (2 * (p * g).sum(dims) + eps) / (p.sum(dims) + present + eps)
    dice = torch.where(present > 0, dice, torch.ones_like(dice)).mean(1)
    loss = ce + (1 - dice.mean())
    if grads is None:
        return loss, ce, dice
    g_loss, g_ce, g_dice = (f64(torch.as_tensor(t)) for t in grads)
    total = g_loss * loss + g_ce * ce + (g_dice * dice).sum()
    (dz,) = torch.autograd.grad(total, z)
    return loss.detach(), ce.detach(), dice.detach(), dz
