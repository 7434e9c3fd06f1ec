"""The training step's forward, loss and backward captured once as a CUDA graph and replayed.

Why: at 128³ a step launches hundreds of kernels (the Triton rungs, cuDNN, ATen's elementwise ops)
through Python and the autograd engine. On an H200 host that could cost more time per step than the
device needs to run them, so the step time was the host's. A replayed graph is one launch.

What is captured, and why the bits are the eager step's:
- The capture records the step up to and including `loss.backward()`: the input built from a static
  mask buffer, the forward under autocast, the loss and the backward. Each run copies the batch into
  that buffer and replays. Clip and Adam stay eager: they read the gradients where the graph wrote them.
- The gradients are set to None before the capture. The captured backward then allocates them from the
  graph's own memory, as the eager step allocates them on each step. Each replay writes them again in
  place; nothing accumulates from one step to the next, so the optimizer must not set them to None
  again (`Trainer.step` only zeroes them in place when it runs a batch of another shape eagerly).
- A replay runs the kernels the eager step runs, with the same arguments, in the same order: same bits
  (`tests/test_gpu_training.py` trains both ways and compares every parameter).
- Before the capture, `warmup` eager forward + backward passes run on a side stream (what CUDA-graph
  capture needs: kernels compiled and loaded, cuDNN plans made, the allocator warm). They write
  gradients only, which are then dropped; no optimizer step runs, so the parameters do not change.

Limits:
- No autograd graph of the model may be alive at the capture: a kept loss keeps its gradient
  accumulators on the stream they were made on, and the capture then fails.
- One CUDA device, one process: under DDP the backward's all-reduce would have to be captured too.
- One batch shape per graph.
- The loss and Dice returned by `run` are the graph's own output tensors, overwritten by the next
  replay: read (or add) them before the next step, as the trainer does.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

FwdBwd = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


class StepGraph:
    """`fwd_bwd(masks) -> (loss, ...)` (forward, loss, backward; no optimizer) captured for batches
    shaped like `example`; `run` returns the same tuple, as the graph's own tensors."""

    def __init__(self, fwd_bwd: FwdBwd, params: Iterable[torch.nn.Parameter], example: torch.Tensor,
                 warmup: int = 2):
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

    def run(self, masks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Forward, loss and backward of `masks`: the gradients land in the parameters' `.grad`."""
        self.masks.copy_(masks)
        self.graph.replay()
        return self.outputs
