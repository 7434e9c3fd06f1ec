"""Adam with the gradient clip, in three launches over every parameter: deterministic, sync-free.

torch's fused Adam (one multi-tensor kernel) took 1.05 ms of the scale-7 step on the H200 for 90.3 M
parameters, and the clip's norm (a multi-tensor norm, then a norm of the norms) 0.11 ms more: it reads
and writes the gradients as well as the parameters and both moments (it stores the clip-divided
gradient back), 32 bytes a parameter. Here:

1. `_sq_partials_kernel`: each program sums the squares of one chunk of one gradient (fp32);
2. `_clip_kernel` (one program): adds the partials in index order, norm = sqrt of the sum, and the clip
   divisor max(1, (norm + 1e-6) / max_norm), clip_grad_norm_'s factor inverted;
3. `_adam_kernel`: each program updates one chunk of one parameter and its two moments: 28 bytes a
   parameter (the gradient is read, never written).

Chunks are BLOCK elements of one tensor; which tensor and where is a table built once per parameter
list, and the tensors' addresses are read from a table of pointers (int64) on the device, so one launch
covers every tensor whatever its size. The address table is rebuilt only when an address changed (new
gradients in eager steps, state loaded from a checkpoint); every table a CUDA graph captured stays alive
with the optimizer. The order of every sum is fixed by the shapes alone: same inputs, same bits.

The update is torch's Adam (L2 weight decay added to the gradient, bias corrections from the step
count), in fp32, with the learning rate and the step count read on the device (capturable): the same
formula as torch's fused kernel, not its bits (the bias corrections are computed in fp32 here).

`Adam` subclasses torch.optim.Adam, so its state dict (step, exp_avg, exp_avg_sq per parameter) and its
param groups are torch's, and checkpoints of either load into the other.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 4096
_TABLES_KEPT = 16  # address tables kept besides those a CUDA graph captured


@triton.jit
def _sq_partials_kernel(g_tab, chunk_t, chunk_s, numel, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_t + pid)
    offs = tl.load(chunk_s + pid) + tl.arange(0, BLOCK)
    g_ptr = tl.load(g_tab + t).to(tl.pointer_type(tl.float32))
    g = tl.load(g_ptr + offs, mask=offs < tl.load(numel + t), other=0.0)
    tl.store(out_ptr + pid, tl.sum(g * g, axis=0))


@triton.jit
def _clip_kernel(partials, n, out_ptr, max_norm, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, n, BLOCK):  # fixed order
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(partials + offs, mask=offs < n, other=0.0)
    norm = tl.sqrt(tl.sum(acc, axis=0))
    tl.store(out_ptr, norm)
    tl.store(out_ptr + 1, tl.maximum((norm + 1e-6) / max_norm, 1.0))


@triton.jit
def _adam_kernel(p_tab, g_tab, m_tab, v_tab, chunk_t, chunk_s, numel, lr_ptr, step_ptr, div_ptr,
                 beta1, beta2, eps, weight_decay,
                 CLIP: tl.constexpr, DECAY: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_t + pid)
    offs = tl.load(chunk_s + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numel + t)
    p_ptr = tl.load(p_tab + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(g_tab + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_tab + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_tab + t).to(tl.pointer_type(tl.float32))
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if CLIP:
        g = g / tl.load(div_ptr + 1)
    if DECAY:
        g = g + p * weight_decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    step = tl.load(step_ptr)
    bias1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    lr = tl.load(lr_ptr)
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly numel() consecutive slots from its data pointer (any order
    of dims: contiguous, channels-last, ...)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def supported(params: list) -> bool:
    """Whether these parameters can run here: dense fp32 tensors of one device, each under 2^31
    elements, none overlapping itself (a view's strides must cover it exactly)."""
    if not params:
        return False
    device = params[0].device
    return all(p.dtype == torch.float32 and p.device == device and not p.is_sparse
               and p.numel() < 2**31 and _dense(p) for p in params)


def _like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it in p's memory layout where its strides differ."""
    return t if t.stride() == p.stride() and _dense(t) else torch.empty_like(p, dtype=t.dtype).copy_(t)


class Adam(torch.optim.Adam):
    """torch.optim.Adam (amsgrad and maximize off) whose step is the three launches above, with the
    gradient clip folded in: `max_norm` > 0 clips by the total gradient norm (clip_grad_norm_'s rule),
    computed on the device; `last_norm` is then that norm, a device tensor (no host sync)."""

    def __init__(self, params, lr, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 max_norm: float = 0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False, capturable=True)
        self.max_norm = float(max_norm)
        self.last_norm: Optional[torch.Tensor] = None
        self._plans: dict = {}
        self._tables: dict = {}  # addresses -> (host copy, device table, captured)
        self._spares: dict = {}  # table length -> host buffers pinned ahead of a capture

    # ----------------------------------------------------------------------------------- tables
    def _plan(self, params: list) -> tuple:
        """(chunk tensor index, chunk start, numel per tensor, programs) for these sizes, on the device."""
        key = (params[0].device, tuple(p.numel() for p in params))
        if key not in self._plans:
            tensor, start = [], []
            for i, p in enumerate(params):
                for s in range(0, p.numel(), BLOCK):
                    tensor.append(i)
                    start.append(s)
            dev = params[0].device
            self._plans[key] = (torch.tensor(tensor, dtype=torch.int32, device=dev),
                                torch.tensor(start, dtype=torch.int32, device=dev),
                                torch.tensor([p.numel() for p in params], dtype=torch.int32, device=dev),
                                len(tensor))
        return self._plans[key]

    def _table(self, tensors: list) -> torch.Tensor:
        """The addresses of `tensors` as an int64 device tensor, copied (host to device, asynchronously)
        only where these addresses have not been seen. Under a CUDA graph's capture the copy is a node
        of the graph that reads its host buffer at every replay: that buffer was pinned before the
        capture (a capture may not allocate it) and lives as long as the optimizer."""
        key = tuple(t.data_ptr() for t in tensors)
        hit = self._tables.get(key)
        if hit is not None:
            if hit[2] and not torch.cuda.is_current_stream_capturing():
                hit[1].copy_(hit[0], non_blocking=True)  # a captured table is written by its replays only
            return hit[1]
        dev = tensors[0].device
        captured = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        spares = self._spares.setdefault(len(key), [])
        if captured and not spares:
            raise RuntimeError("scaffold.kernels.adam.Adam: run one step before capturing it")
        host = spares.pop() if captured else torch.empty(len(key), dtype=torch.int64,
                                                          pin_memory=dev.type == "cuda")
        host.copy_(torch.tensor(key, dtype=torch.int64))
        table = torch.empty(len(key), dtype=torch.int64, device=dev)
        table.copy_(host, non_blocking=True)
        if not captured and len(spares) < 4:  # for a capture to come: one per table of a step
            spares.append(torch.empty(len(key), dtype=torch.int64, pin_memory=dev.type == "cuda"))
        loose = [k for k, v in self._tables.items() if not v[2]]
        if len(loose) >= _TABLES_KEPT:  # a captured graph's table is never dropped: its copy replays
            del self._tables[loose[0]]
        self._tables[key] = (host, table, captured)
        return table

    # ------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("scaffold.kernels.adam.Adam: amsgrad and maximize are not supported")
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [self.state[p] for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)  # equal for every parameter: the kernel reads the first
            # One index walks a parameter, its gradient and its moments alike: each in the parameter's
            # layout (a gradient in another one is copied; a moment, e.g. loaded from a checkpoint,
            # is put in it for good).
            grads = [_like(p, p.grad) for p in params]
            for p, st in zip(params, states):
                st["exp_avg"], st["exp_avg_sq"] = _like(p, st["exp_avg"]), _like(p, st["exp_avg_sq"])
            chunk_t, chunk_s, numel, programs = self._plan(params)
            tabs = [self._table(params), self._table(grads), self._table([s["exp_avg"] for s in states]),
                    self._table([s["exp_avg_sq"] for s in states])]
            lr = group["lr"]
            if not torch.is_tensor(lr):
                lr = torch.tensor(float(lr), dtype=torch.float32, device=params[0].device)
            clip = self.max_norm > 0
            norm = torch.empty(2, dtype=torch.float32, device=params[0].device)  # (norm, divisor)
            if clip:
                partials = torch.empty(programs, dtype=torch.float32, device=params[0].device)
                _sq_partials_kernel[(programs,)](tabs[1], chunk_t, chunk_s, numel, partials, BLOCK=BLOCK,
                                                 num_warps=8)
                _clip_kernel[(1,)](partials, programs, norm, self.max_norm, BLOCK=1024, num_warps=4)
                self.last_norm = norm[0]
            beta1, beta2 = group["betas"]
            wd = float(group["weight_decay"])
            _adam_kernel[(programs,)](*tabs, chunk_t, chunk_s, numel, lr, steps[0], norm,
                                      float(beta1), float(beta2), float(group["eps"]), wd,
                                      CLIP=clip, DECAY=wd != 0.0, BLOCK=BLOCK, num_warps=8)
        return loss
