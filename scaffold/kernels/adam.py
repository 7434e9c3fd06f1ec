"""Adam with the gradient clip and bf16 working copies, in three launches over every parameter.

What the step paid around torch's fused Adam at scale 7 on the H200 (90.3 M parameters): the clip's
norm (0.11 ms), Adam (1.04 ms), and two casts per convolution weight that autocast adds, fp32 → bf16 in
the forward (0.17 ms) and the bf16 weight gradient → fp32 in the backward (0.29 ms). Here a convolution
reads a bf16 *working copy* of its weight (scaffold.model.ladder.attach_working_copies), its gradient
stays bf16 (the same values the cast gave: bf16 → fp32 is exact), and the optimizer writes the new
working copy as it writes the fp32 parameter, so both casts are gone:

1. `_sq_partials_kernel`: each program sums the squares of one chunk of one gradient (in fp32);
2. `_clip_kernel` (one program): adds the partials in index order, norm = sqrt of the sum, and the clip
   divisor max(1, (norm + 1e-6) / max_norm), clip_grad_norm_'s factor inverted;
3. `_adam_kernel`: each program updates one chunk of one parameter, its two moments and, where it has
   one, its working copy: 30 bytes a parameter with a bf16 gradient and a copy, 28 without.

Chunks are BLOCK elements of one tensor; which tensor and where is a plan built once per parameter
list, and the tensors' addresses are read from int64 tables on the device, so one launch covers every
tensor whatever its size. An address read from a table carries no alignment the compiler can see, and
without it no load is vectorized (a first version ran at ~1.4 TB/s): every tensor is checked to start
on 16 bytes when its table is built, the kernels say so (`tl.multiple_of`), and a whole chunk is loaded
unmasked, so loads and stores are 16-byte vectors. The address table is rebuilt only when an address
changed (new gradients in eager steps, state loaded from a checkpoint); every table a CUDA graph
captured stays alive with the optimizer. The order of every sum is fixed by the shapes alone: same
inputs, same bits; a parameter's update does not depend on whether its gradient came bf16 or fp32
(the same values), so the norm and the update are the same with and without working copies. For that
the kernels compile without floating-point contraction (`enable_fp_fusion=False`): each branch (bf16 or
fp32 gradient, whole or partial chunk) is its own code, and a multiply-add fused in one branch and not
in another gave different bits on the H200; without contraction every branch rounds each operation.

The update is torch's Adam (L2 weight decay added to the gradient, bias corrections from the step
count), in fp32, with the learning rate and the step count read on the device (capturable): the same
formula as torch's fused kernel, not its bits (the bias corrections are computed in fp32 here). The
working copy is the new parameter rounded to bf16 to nearest even, as `.to(torch.bfloat16)` rounds.

`Adam` subclasses torch.optim.Adam, so its state dict (step, exp_avg, exp_avg_sq per parameter) and its
param groups are torch's, and checkpoints of either load into the other. Working copies are not state:
they are made again from the parameters (`refresh_working`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from scaffold.kernels.lib.rounding import cast_rne, to_f32
from scaffold.kernels.lib.launch import launched

BLOCK = 2048  # elements of one tensor per program
WARPS = 8  # of the update (BLOCK and WARPS: the fastest of an H200 sweep, docs/performance-log.md)
ALIGN = 16  # bytes: every tensor's start, so that whole chunks load as 16-byte vectors
_TABLES_KEPT = 16  # address tables kept besides those a CUDA graph captured


@triton.jit
def _sq_sum(g_ptr, offs, n, MASKED: tl.constexpr):
    if MASKED:
        g = to_f32(tl.load(g_ptr + offs, mask=offs < n, other=0.0))
    else:
        g = to_f32(tl.load(g_ptr + offs))
    return tl.sum(g * g, axis=0)


@launched
@triton.jit
def _sq_partials_kernel(g_tab, kind_tab, chunk_t, chunk_s, numel, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_t + pid)
    s = tl.multiple_of(tl.load(chunk_s + pid), BLOCK)
    n = tl.load(numel + t)
    offs = s + tl.arange(0, BLOCK)
    address = tl.load(g_tab + t)
    if tl.load(kind_tab + t) != 0:  # a bf16 gradient (of a working copy)
        g16 = tl.multiple_of(address.to(tl.pointer_type(tl.bfloat16)), 16)
        if s + BLOCK <= n:
            acc = _sq_sum(g16, offs, n, False)
        else:
            acc = _sq_sum(g16, offs, n, True)
    else:
        g32 = tl.multiple_of(address.to(tl.pointer_type(tl.float32)), 16)
        if s + BLOCK <= n:
            acc = _sq_sum(g32, offs, n, False)
        else:
            acc = _sq_sum(g32, offs, n, True)
    tl.store(out_ptr + pid, acc)


@launched
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
def _update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, n, div, lr_c, bias2_sqrt, beta1, beta2, eps,
            weight_decay, CLIP: tl.constexpr, DECAY: tl.constexpr, WORK: tl.constexpr,
            MASKED: tl.constexpr):
    if MASKED:
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = to_f32(tl.load(g_ptr + offs, mask=mask, other=0.0))
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    else:
        p = tl.load(p_ptr + offs)
        g = to_f32(tl.load(g_ptr + offs))
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
    if CLIP:
        g = g / div
    if DECAY:
        g = g + p * weight_decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - lr_c * m / (tl.sqrt(v) / bias2_sqrt + eps)
    if MASKED:
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if WORK:
            tl.store(w_ptr + offs, cast_rne(p, tl.bfloat16), mask=mask)
    else:
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        if WORK:
            tl.store(w_ptr + offs, cast_rne(p, tl.bfloat16))


@launched
@triton.jit
def _adam_kernel(p_tab, g_tab, m_tab, v_tab, w_tab, kind_tab, chunk_t, chunk_s, numel, lr_ptr, step_ptr,
                 div_ptr, beta1, beta2, eps, weight_decay,
                 CLIP: tl.constexpr, DECAY: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_t + pid)
    s = tl.multiple_of(tl.load(chunk_s + pid), BLOCK)
    n = tl.load(numel + t)
    offs = s + tl.arange(0, BLOCK)
    p_ptr = tl.multiple_of(tl.load(p_tab + t).to(tl.pointer_type(tl.float32)), 16)
    m_ptr = tl.multiple_of(tl.load(m_tab + t).to(tl.pointer_type(tl.float32)), 16)
    v_ptr = tl.multiple_of(tl.load(v_tab + t).to(tl.pointer_type(tl.float32)), 16)
    g_address = tl.load(g_tab + t)
    step = tl.load(step_ptr)
    bias1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    lr_c = tl.load(lr_ptr) / bias1
    div = 1.0
    if CLIP:
        div = tl.load(div_ptr + 1)
    full = s + BLOCK <= n
    if tl.load(kind_tab + t) != 0:  # a bf16 gradient, and the working copy to write
        g16 = tl.multiple_of(g_address.to(tl.pointer_type(tl.bfloat16)), 16)
        w16 = tl.multiple_of(tl.load(w_tab + t).to(tl.pointer_type(tl.bfloat16)), 16)
        if full:
            _update(p_ptr, g16, m_ptr, v_ptr, w16, offs, n, div, lr_c, bias2_sqrt, beta1, beta2, eps,
                    weight_decay, CLIP, DECAY, True, False)
        else:
            _update(p_ptr, g16, m_ptr, v_ptr, w16, offs, n, div, lr_c, bias2_sqrt, beta1, beta2, eps,
                    weight_decay, CLIP, DECAY, True, True)
    else:
        g32 = tl.multiple_of(g_address.to(tl.pointer_type(tl.float32)), 16)
        if full:
            _update(p_ptr, g32, m_ptr, v_ptr, p_ptr, offs, n, div, lr_c, bias2_sqrt, beta1, beta2, eps,
                    weight_decay, CLIP, DECAY, False, False)
        else:
            _update(p_ptr, g32, m_ptr, v_ptr, p_ptr, offs, n, div, lr_c, bias2_sqrt, beta1, beta2, eps,
                    weight_decay, CLIP, DECAY, False, True)


# ------------------------------------------------------------------------------------------ host side

def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly numel() consecutive slots from its data pointer (any order
    of dims: contiguous, channels-last, ...)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0


def supported(params: list) -> bool:
    """Whether these parameters can run here: dense fp32 tensors of one device starting on 16 bytes,
    each under 2^31 elements, none overlapping itself (a view's strides must cover it exactly)."""
    if not params:
        return False
    device = params[0].device
    return all(p.dtype == torch.float32 and p.device == device and not p.is_sparse
               and p.numel() < 2**31 and _dense(p) and _aligned(p) for p in params)


def _like(p: torch.Tensor, t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """t, or a copy of it in p's memory layout (and `dtype`) where its strides, dtype or start differ."""
    dtype = t.dtype if dtype is None else dtype
    if t.stride() == p.stride() and _dense(t) and _aligned(t) and t.dtype == dtype:
        return t
    return torch.empty_like(p, dtype=dtype).copy_(t)


class Adam(torch.optim.Adam):
    """torch.optim.Adam (amsgrad and maximize off) whose step is the three launches above, with the
    gradient clip folded in: `max_norm` > 0 clips by the total gradient norm (clip_grad_norm_'s rule),
    computed on the device; `last_norm` is then that norm, a device tensor (no host sync).

    `working` maps a parameter to its bf16 working copy, a leaf tensor that the forward reads in its
    place: the backward leaves the parameter's gradient in the copy's `.grad` (bf16), and each step
    writes the copy anew from the updated parameter. `grad_leaves()` lists, per parameter, the tensor
    whose `.grad` holds its gradient; `zero_grad` clears those."""

    def __init__(self, params, lr, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 max_norm: float = 0.0, working: Optional[dict] = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False, capturable=True)
        self.max_norm = float(max_norm)
        self.last_norm: Optional[torch.Tensor] = None
        self.working: dict = dict(working or {})
        for p, w in self.working.items():
            if w.dtype != torch.bfloat16 or w.shape != p.shape or w.stride() != p.stride() or not _aligned(w):
                raise ValueError(f"scaffold.kernels.adam.Adam: a working copy must be a bf16 tensor in its "
                                 f"parameter's layout on 16 bytes; got {w.dtype} {tuple(w.shape)} "
                                 f"strides {w.stride()} for {tuple(p.shape)} strides {p.stride()}")
        self._plans: dict = {}
        self._tables: dict = {}  # addresses -> (host copy, device table, captured)
        self._spares: dict = {}  # table length -> host buffers pinned ahead of a capture

    # ---------------------------------------------------------------------------- working copies
    def grad_leaves(self) -> list[torch.Tensor]:
        """Per parameter, the tensor whose `.grad` the backward writes: its working copy or itself."""
        return [self.working.get(p, p) for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.grad_leaves():
            if t.grad is None:
                continue
            if set_to_none:
                t.grad = None
                continue
            g = t.grad  # as torch.optim.Optimizer.zero_grad: under DDP a gradient is a view of its
            if g.grad_fn is not None:  # bucket (gradient_as_bucket_view), which detach_() refuses
                g.detach_()
            else:
                g.requires_grad_(False)
            g.zero_()

    @torch.no_grad()
    def refresh_working(self) -> None:
        """Each working copy made again from its parameter (after the parameters were written outside
        a step: a checkpoint loaded, a warm-up rolled back)."""
        if self.working:
            torch._foreach_copy_(list(self.working.values()), list(self.working.keys()))

    # ----------------------------------------------------------------------------------- tables
    def _plan(self, params: list, kinds: tuple) -> tuple:
        """(chunk tensor index, chunk start, numel and kind per tensor, programs) on the device."""
        key = (params[0].device, tuple(p.numel() for p in params), kinds)
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
                                torch.tensor(kinds, dtype=torch.int32, device=dev),
                                len(tensor))
        return self._plans[key]

    def _table(self, tensors: list) -> torch.Tensor:
        """The addresses of `tensors` (0 for None) as an int64 device tensor, copied (host to device,
        asynchronously) only where these addresses have not been seen. Under a CUDA graph's capture the
        copy is a node of the graph that reads its host buffer at every replay: that buffer was pinned
        before the capture (a capture may not allocate it) and lives as long as the optimizer."""
        key = tuple(0 if t is None else t.data_ptr() for t in tensors)
        if any(a % ALIGN for a in key):
            raise ValueError("scaffold.kernels.adam.Adam: a tensor does not start on 16 bytes")
        hit = self._tables.get(key)
        if hit is not None:
            if hit[2] and not torch.cuda.is_current_stream_capturing():
                hit[1].copy_(hit[0], non_blocking=True)  # a captured table is written by its replays only
            return hit[1]
        dev = next(t for t in tensors if t is not None).device
        captured = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        spares = self._spares.setdefault(len(key), [])
        if captured and not spares:
            raise RuntimeError("scaffold.kernels.adam.Adam: run one step before capturing it")
        host = spares.pop() if captured else torch.empty(len(key), dtype=torch.int64,
                                                          pin_memory=dev.type == "cuda")
        host.copy_(torch.tensor(key, dtype=torch.int64))
        table = torch.empty(len(key), dtype=torch.int64, device=dev)
        table.copy_(host, non_blocking=True)
        if not captured and len(spares) < 5:  # for a capture to come: one per table of a step
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
            params, grads, copies = [], [], []
            for p in group["params"]:
                w = self.working.get(p)
                g = (w if w is not None else p).grad
                if g is None:
                    continue
                params.append(p)
                copies.append(w)
                # One index walks a parameter, its gradient, moments and copy alike: each in the
                # parameter's layout (a gradient in another one is copied; a moment, e.g. loaded from a
                # checkpoint, is put in it for good).
                grads.append(_like(p, g, torch.bfloat16 if w is not None else torch.float32))
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
            for p, st in zip(params, states):
                st["exp_avg"], st["exp_avg_sq"] = _like(p, st["exp_avg"]), _like(p, st["exp_avg_sq"])
            kinds = tuple(0 if w is None else 1 for w in copies)
            chunk_t, chunk_s, numel, kind, programs = self._plan(params, kinds)
            g_tab = self._table(grads)
            p_tab = self._table(params)
            # No working copy in this group: the kernel never reads the copies' table.
            w_tab = self._table(copies) if any(w is not None for w in copies) else p_tab
            tabs = [p_tab, g_tab, self._table([s["exp_avg"] for s in states]),
                    self._table([s["exp_avg_sq"] for s in states]), w_tab]
            lr = group["lr"]
            if not torch.is_tensor(lr):
                lr = torch.tensor(float(lr), dtype=torch.float32, device=params[0].device)
            clip = self.max_norm > 0
            norm = torch.empty(2, dtype=torch.float32, device=params[0].device)  # (norm, divisor)
            if clip:
                partials = torch.empty(programs, dtype=torch.float32, device=params[0].device)
                _sq_partials_kernel[(programs,)](g_tab, kind, chunk_t, chunk_s, numel, partials, BLOCK=BLOCK,
                                                 num_warps=8, enable_fp_fusion=False)
                _clip_kernel[(1,)](partials, programs, norm, self.max_norm, BLOCK=1024, num_warps=4)
                self.last_norm = norm[0]
            beta1, beta2 = group["betas"]
            wd = float(group["weight_decay"])
            _adam_kernel[(programs,)](*tabs, kind, chunk_t, chunk_s, numel, lr, steps[0], norm,
                                      float(beta1), float(beta2), float(group["eps"]), wd,
                                      CLIP=clip, DECAY=wd != 0.0, BLOCK=BLOCK, num_warps=WARPS,
                                      enable_fp_fusion=False)
        return loss
