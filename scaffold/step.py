"""The training step, once: forward under autocast → loss → backward → clip → optimizer → grads reset.

`TrainStep` is the step the trainer runs, the warm-up runs on its copy of the model, and the step
benchmark times (`python -m scaffold.bench.minibatch`): the same calls, the same uint8 labels.

It never reads the device: it returns the batch loss and the per-sample soft Dice as device tensors.

On one CUDA device its forward, loss and backward can be captured once as a CUDA graph and replayed
(`capture`); every rule of the graph lives here:
- Why: at 128³ a step launches hundreds of kernels through Python and the autograd engine, which can
  cost the host more time than the device needs to run them. A replay is one launch.
- What: the input built from a static mask buffer, the forward, the loss and the backward. Clip and the
  optimizer stay eager and read the gradients where the graph wrote them.
- Same bits as eager: a replay runs the same kernels with the same arguments in the same order.
- The gradients are set to None before the capture, so the captured backward allocates them from the
  graph's pool and each replay writes them afresh: nothing accumulates, and the optimizer must not set
  them to None again. A batch of another shape (an epoch's short last batch) runs eagerly into the same
  tensors, zeroed in place first.
- Before the capture, eager forward + backward passes run on a side stream (kernels compiled, cuDNN
  plans made, the allocator warm); they write gradients only, which are dropped: parameters do not move.
Limits: no autograd graph of the model may be alive at the capture (a kept loss holds its gradient
accumulators on another stream and the capture fails); one process (under DDP the all-reduce would have
to be captured too); one batch shape per graph; the returned loss and Dice are the graph's own tensors,
overwritten by the next replay: read or add them before the next step.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from scaffold import determinism
from scaffold.config import ConfigError
from scaffold.data.loader import make_input

log = logging.getLogger("scaffold")


def amp_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype of a `precision` setting on a device (None: fp32, no autocast)."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def make_optimizer(params, cfg: Any) -> torch.optim.Optimizer:
    """Adam as the config says (lr, optim.weight_decay)."""
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.optim.weight_decay)


def wants_graph(mode: str, device: torch.device, world: int, data_parallel: bool = False) -> bool:
    """Whether a run captures its step (`cuda_graph`): auto/on on one CUDA device in one process outside
    a process group (DDP's all-reduce is not captured). `on` where that cannot be is a ConfigError,
    raised before any work."""
    possible = device.type == "cuda" and world == 1 and not data_parallel
    if mode == "on" and not possible:
        where = (f"{world} processes" if world > 1 else "a data-parallel process group" if data_parallel
                 else f"device {device}")
        raise ConfigError(f"cuda_graph='on': expected one CUDA device in one process, got {where} "
                          "(use cuda_graph=auto or off)")
    return mode != "off" and possible


class TrainStep:
    """`step(masks) -> (loss, dice)`: one optimizer step on a batch of uint8 masks (N, D, H, W).

    `net` is what the forward calls (the model, its DDP wrapper or a compiled model); the optimizer
    holds the parameters. The input is built on the device as palette[mask]."""

    def __init__(self, net: Callable[[torch.Tensor], torch.Tensor], loss_fn: Any,
                 optimizer: torch.optim.Optimizer, palette: torch.Tensor,
                 autocast: Optional[torch.dtype] = None, grad_clip: float = 1.0):
        self.net, self.loss_fn, self.optimizer, self.palette = net, loss_fn, optimizer, palette
        self.autocast, self.grad_clip = autocast, grad_clip
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.graph: Optional[_StepGraph] = None

    def autocast_context(self, device: torch.device):
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)

    def forward_backward(self, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss and backward of one batch: the part of the step a CUDA graph captures."""
        x = make_input(masks, self.palette)
        with self.autocast_context(masks.device):
            logits = self.net(x)
        # The uint8 masks are the labels: the loss reads them as they are (no int64 copy per step).
        loss, _, dice = self.loss_fn.terms(logits, masks)  # fp32, outside autocast
        loss.backward()
        return loss, dice

    def __call__(self, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        graph = self.graph
        if graph is not None and graph.fits(masks):
            loss, dice = graph.run(masks)
        else:
            if graph is not None:  # another batch shape: eager, into the graph's gradient tensors
                self.optimizer.zero_grad(set_to_none=False)
            loss, dice = self.forward_backward(masks)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        self.optimizer.step()
        if graph is None:  # a graph writes the same gradient tensors again on its next replay
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), dice.detach()

    def capture(self, example: torch.Tensor, required: bool = False) -> float:
        """Captures forward, loss and backward for batches shaped like `example` (outside any epoch:
        the capture synchronizes the device); returns the seconds it took. The RNG streams are left as
        they were. A failed capture raises when `required`, else logs one warning and the step stays
        eager."""
        t0 = time.perf_counter()
        rng = determinism.rng_state()
        if isinstance(self.net, torch.nn.Module):
            self.net.train()
        try:
            self.graph = _StepGraph(self.forward_backward, self.params, example)
        except Exception as e:  # noqa: BLE001 - `auto` keeps training, eagerly; `on` promised a graph
            if required:
                raise
            self.graph = None
            self.optimizer.zero_grad(set_to_none=True)  # whatever a half-done capture left
            log.warning("cuda_graph=auto: the step could not be captured (%s); running it eagerly",
                        f"{type(e).__name__}: {e}".splitlines()[0])
        determinism.set_rng_state(rng)
        torch.cuda.synchronize(example.device)
        return time.perf_counter() - t0


class _StepGraph:
    """`fwd_bwd(masks) -> (loss, ...)` captured for batches shaped like `example`; `run` replays it and
    returns the graph's own output tensors (see the module docstring for the rules)."""

    def __init__(self, fwd_bwd: Callable[[torch.Tensor], tuple], params: list[torch.nn.Parameter],
                 example: torch.Tensor, warmup: int = 2):
        if example.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA tensor, got one on {example.device}")
        self.params = [p for p in params if p.requires_grad]
        self.masks = example.clone()
        device = example.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fwd_bwd(self.masks)
                self._drop_grads()
        torch.cuda.current_stream(device).wait_stream(side)
        self._drop_grads()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            outputs = fwd_bwd(self.masks)
        self.outputs = tuple(t.detach() for t in outputs)

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def fits(self, masks: torch.Tensor) -> bool:
        """Whether `masks` can be replayed: the captured shape, dtype and device."""
        m = self.masks
        return masks.shape == m.shape and masks.dtype == m.dtype and masks.device == m.device

    def run(self, masks: torch.Tensor) -> tuple:
        """Forward, loss and backward of `masks`: the gradients land in the parameters' `.grad`."""
        self.masks.copy_(masks)
        self.graph.replay()
        return self.outputs
