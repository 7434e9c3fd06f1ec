"""The training step, once: forward under autocast → loss → backward → clip → optimizer → grads reset.

`TrainStep` is the step the trainer runs, the warm-up runs on its copy of the model, and the step
benchmark times (`python -m scaffold.bench.minibatch`): the same calls, the same uint8 labels.

It never reads the device: it returns the batch loss and the per-sample soft Dice as device tensors.

On one CUDA device the whole step can be captured once as a CUDA graph and replayed (`capture`); every
rule of the graph lives here:
- Why: at 128³ a step launches hundreds of kernels through Python and the autograd engine, which can
  cost the host more time than the device needs to run them. A replay is one launch.
- What: the input built from a static mask buffer, the forward, the loss, the backward, the gradient
  clip (sync-free: the norm and the clip factor stay on the device) and Adam. On CUDA, Adam is ours
  (scaffold.kernels.adam: the clip's norm and the update in three launches over all parameters, and the
  convolutions' bf16 working copies written with the update; torch's fused, capturable Adam where
  Triton is missing), its step count and learning rate on the device: the scheduler writes the new rate
  into that tensor in place between epochs, and the graph reads it there. Its state must exist before
  the capture (a lazy initialization captured in the graph would zero it on every replay), so the
  warm-up passes run whole steps and the parameters, state and working copies are restored afterwards,
  bit for bit.
- Same bits as eager: a replay runs the same kernels with the same arguments in the same order.
- The gradients are set to None before the capture, so the captured backward allocates them from the
  graph's pool and each replay writes them afresh: nothing accumulates, and the optimizer must not set
  them to None again. A batch of another shape (an epoch's short last batch) runs eagerly into the same
  tensors, zeroed in place first.
- Before the capture, eager whole steps run on a side stream (kernels compiled, cuDNN plans made, the
  allocator warm, Adam's state created); parameters and optimizer state are then put back as they were.
- Under DDP (torchrun) the gradient all-reduce is captured with the step: DDP's bucket copies, the
  division by the world size and the NCCL all-reduce are kernels like the others, in the bucket order
  settled before the first step (scaffold.trainer), so a replay is the eager DDP step's bits. As torch's
  notes on graphs and DDP ask, the DDP wrapper is built on a side stream and runs DDP_EAGER_STEPS whole
  steps eagerly before the capture; every rank captures (a failure on one is a failure on all: whether
  a collective is captured must be the same on every rank). A replayed all-reduce is not watched by the
  process group's timeout, but the epoch's reductions and the stop vote, which are eager, still are: a
  dead rank still ends the job within the bound.
Limits: no autograd graph of the model may be alive at the capture (a kept loss holds its gradient
accumulators on another stream and the capture fails); volumes not split over ranks (a sharded step's
halo exchanges run eagerly); one batch shape per graph; the returned loss and Dice are the graph's own tensors,
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


OPTIMIZERS = ("scaffold", "torch-fused", "torch")  # scaffold.kernels.adam | torch's fused | torch's foreach


def optimizer_kind(device: torch.device, sharded: bool = False) -> tuple[str, str]:
    """(the optimizer's implementation, why), one of OPTIMIZERS: ours on CUDA where Triton compiles (not
    its interpreter), torch's fused and capturable Adam on CUDA otherwise, torch's default on the CPU.
    `sharded` (FSDP: each parameter a DTensor holding this rank's shard): torch's Adam, which runs on
    DTensors (ours reads raw addresses, and its clip would need the norm's all-reduce between its
    launches)."""
    if sharded:
        if device.type == "cuda":
            return "torch-fused", ("torch's fused Adam over the parameter shards (FSDP: DTensors, which ours "
                                   "cannot take; the clip's norm all-reduced by DTensor)")
        return "torch", "torch's Adam over the parameter shards, one tensor at a time: on the CPU (FSDP)"
    if device.type != "cuda":
        return "torch", "torch's Adam (foreach): on the CPU"
    from scaffold.kernels.lib.device import interpreting, triton_importable

    if triton_importable() and not interpreting():
        return "scaffold", "scaffold.kernels.adam: the clip's norm and Adam in three launches, capturable"
    return "torch-fused", "torch's fused, capturable Adam: Triton cannot compile here"


def make_optimizer(model: torch.nn.Module, cfg: Any, working: bool = False,
                   kind: Optional[str] = None) -> torch.optim.Optimizer:
    """Adam over `model`'s parameters as the config says (lr, optim.weight_decay).

    On CUDA: ours (scaffold.kernels.adam: the clip's norm and Adam in three launches over all
    parameters; TrainStep hands it the clip), else torch's fused Adam; either capturable, its learning
    rate a device tensor, so a CUDA graph can hold the whole step (eager CUDA steps use the same
    kernels, so graphed and eager runs keep the same bits). With `working` and bf16 autocast, ours also
    gives the convolutions bf16 working copies of their weights (scaffold.model.ladder), written at each
    step, so no cast of a weight or of its gradient runs; for one process whose model is called as it is
    (a DDP wrapper or a sharded model reduces the parameters' own gradients: they keep fp32 ones).
    On the CPU: torch's default (foreach) Adam. `kind` (one of OPTIMIZERS, the run's plan's) picks the
    implementation; by default `optimizer_kind` of the parameters' device."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    kind = kind or optimizer_kind(device)[0]
    if device.type == "cuda":
        lr = torch.tensor(float(cfg.lr), device=device)
        if kind == "scaffold":
            from scaffold.kernels import adam

            if adam.supported(params):
                copies = None
                if working and amp_dtype(cfg.precision, device) == torch.bfloat16:
                    from scaffold.model.ladder import attach_working_copies

                    copies = attach_working_copies(model, torch.bfloat16)
                return adam.Adam(params, lr=lr, weight_decay=cfg.optim.weight_decay, working=copies)
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.optim.weight_decay, fused=True,
                                capturable=True)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.optim.weight_decay)


def keep_lr_on_device(optimizer: torch.optim.Optimizer) -> None:
    """After `load_state_dict`, which may bring the rate back as a float or a CPU tensor and the state
    in another memory layout than the parameters' (a checkpoint stores contiguous tensors; the model
    runs channels-last on CUDA): a fused capturable optimizer's learning rate as a tensor on its
    parameters' device again, and each state tensor in its parameter's layout (fused Adam requires it;
    the values, and so the bits, are the same)."""
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == p.shape and v.stride() != p.stride():
                st[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)
    for group in optimizer.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            continue
        device = group["params"][0].device
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device):
            group["lr"] = torch.tensor(float(lr), device=device)


def wants_graph(mode: str, device: torch.device, shards: int = 1, fsdp: bool = False) -> bool:
    """Whether a run captures its step (`cuda_graph`): auto/on on a CUDA device, in one process or under
    DDP (whose gradient all-reduce is captured with the step), with volumes not split over ranks (a
    sharded step's halo exchanges run eagerly) and parameters not sharded (FSDP's all-gathers free and
    refill the parameters' storage around each unit, eagerly). `on` where that cannot be is a
    ConfigError, raised before any work."""
    possible = device.type == "cuda" and shards == 1 and not fsdp
    if mode == "on" and fsdp and device.type == "cuda" and shards == 1:
        raise ConfigError("cuda_graph='on': expected parameters not sharded, got FSDP (parallel.fsdp; its "
                          "all-gathers run eagerly): use cuda_graph=auto or off, or parallel.fsdp=off")
    if mode == "on" and not possible:
        where = f"{shards} spatial shards" if shards > 1 else f"device {device}"
        raise ConfigError(f"cuda_graph='on': expected a CUDA device and volumes not split over ranks, got "
                          f"{where} (use cuda_graph=auto or off)")
    return mode != "off" and possible


# Whole steps DDP must have run eagerly before its backward can be captured: its reducer times the first
# ten iterations with CUDA events, which a capture cannot hold (torch's CUDA-graph notes ask for 11).
DDP_EAGER_STEPS = 11


def fold_clip(optimizer: torch.optim.Optimizer, params: list, clip: float, no_inf: torch.Tensor) -> None:
    """Clip by the total gradient norm inside fused Adam's next step: clip_grad_norm_'s factor
    min(1, clip / (norm + 1e-6)) handed over as the divisor Adam applies to each gradient as it reads
    it, max(1, (norm + 1e-6) / clip). No host sync; one pass over the gradients (the norm) fewer."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / clip, min=1.0)
    optimizer.found_inf = no_inf


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
        # The tensors whose `.grad` the backward writes: the parameters, or their working copies.
        grad_leaves = getattr(optimizer, "grad_leaves", None)
        self.leaves = grad_leaves() if grad_leaves is not None else self.params
        self.graph: Optional[_StepGraph] = None
        # Ours (scaffold.kernels.adam) computes the norm and the clip factor itself: told the clip, it
        # needs nothing more.
        self.clip_inside = hasattr(optimizer, "max_norm")
        if self.clip_inside:
            optimizer.max_norm = max(0.0, float(grad_clip))
        # With torch's fused Adam the clip is folded into the optimizer: the clip factor goes in as
        # Adam's gradient divisor (its `grad_scale`, the hook AMP's GradScaler uses), so the gradients
        # are not rewritten in a pass of their own.
        self.fold_clip = grad_clip > 0 and not self.clip_inside and \
            all(g.get("fused") for g in optimizer.param_groups)
        if self.fold_clip:
            device = self.params[0].device
            self._no_inf = torch.zeros((), device=device)

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

    def whole_step(self, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss, backward, clip and Adam: what a CUDA graph captures."""
        loss, dice = self.forward_backward(masks)
        if self.fold_clip:
            fold_clip(self.optimizer, self.params, self.grad_clip, self._no_inf)
        elif self.grad_clip > 0 and not self.clip_inside:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        self.optimizer.step()
        return loss, dice

    def __call__(self, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        graph = self.graph
        if graph is not None and graph.fits(masks):
            loss, dice = graph.run(masks)
        else:
            if graph is not None:  # another batch shape: eager, into the graph's gradient tensors
                self.optimizer.zero_grad(set_to_none=False)
            loss, dice = self.whole_step(masks)
            if graph is None:  # a graph writes the same gradient tensors again on its next replay
                self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), dice.detach()

    def capture(self, example: torch.Tensor, required: bool = False,
                agree: Optional[Callable[[Optional[BaseException]], None]] = None) -> float:
        """Captures the whole step for batches shaped like `example` (outside any epoch:
        the capture synchronizes the device); returns the seconds it took. The RNG streams are left as
        they were. A failed capture raises when `required`, else logs one warning and the step stays
        eager. `agree(error)` (under DDP: scaffold.distributed.agree) raises on every rank when any rank
        failed, so that all ranks replay graphs or none does."""
        t0 = time.perf_counter()
        rng = determinism.rng_state()
        if isinstance(self.net, torch.nn.Module):
            self.net.train()
        ddp = isinstance(self.net, torch.nn.parallel.DistributedDataParallel)
        error: Optional[BaseException] = None
        try:
            keep_lr_on_device(self.optimizer)
            with _restored(self.params, self.optimizer):
                self.graph = _StepGraph(self.whole_step, self.leaves, example,
                                        warmup=DDP_EAGER_STEPS if ddp else 2)
        except Exception as e:  # noqa: BLE001 - `auto` keeps training, eagerly; `on` promised a graph
            error = e
        if agree is not None:
            try:
                agree(error)
            except Exception as e:  # noqa: BLE001 - another rank's failure is this rank's too
                error = error or e
        if error is not None:
            if required:
                raise error
            self.graph = None
            self.optimizer.zero_grad(set_to_none=True)  # whatever a half-done capture left
            log.warning("cuda_graph=auto: the step could not be captured (%s); running it eagerly",
                        f"{type(error).__name__}: {error}".splitlines()[0])
        determinism.set_rng_state(rng)
        torch.cuda.synchronize(example.device)
        return time.perf_counter() - t0


class _restored:
    """Puts the parameters and the optimizer's state back as they were on entry (in place: the graph
    keeps the addresses it captured), creating the state first if the optimizer has none yet."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer):
        self.params, self.optimizer = params, optimizer

    def __enter__(self):
        # Kept in host memory: the capture is the moment of peak device memory.
        self.saved_params = [p.detach().to("cpu", copy=True) for p in self.params]
        self.fresh = not self.optimizer.state
        self.saved_state = {p: {k: v.to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in st.items()}
                            for p, st in self.optimizer.state.items()}
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, self.saved_params):
                p.copy_(saved)
            for p, st in self.optimizer.state.items():
                for k, v in st.items():
                    if not torch.is_tensor(v):
                        continue
                    if self.fresh:
                        v.zero_()  # what a first step would have created: zeros, step 0
                    else:
                        v.copy_(self.saved_state[p][k])
        refresh = getattr(self.optimizer, "refresh_working", None)
        if refresh is not None:  # the working copies of the parameters put back
            refresh()
        self.saved_params = self.saved_state = None


class _Replay:
    """A CUDA graph over a static mask buffer: `run(masks)` copies a batch in, replays, and returns the
    graph's own output tensors (overwritten by the next replay)."""

    masks: torch.Tensor
    graph: torch.cuda.CUDAGraph
    outputs: tuple

    def fits(self, masks: torch.Tensor) -> bool:
        """Whether `masks` can be replayed: the captured shape, dtype and device."""
        m = self.masks
        return masks.shape == m.shape and masks.dtype == m.dtype and masks.device == m.device

    def run(self, masks: torch.Tensor) -> tuple:
        self.masks.copy_(masks)
        self.graph.replay()
        return self.outputs


class _StepGraph(_Replay):
    """`step(masks) -> (loss, ...)` captured for batches shaped like `example`; `run` replays it and
    returns the graph's own output tensors (see the module docstring for the rules). The warm-up runs
    real steps: the caller restores parameters and optimizer state afterwards."""

    def __init__(self, step: Callable[[torch.Tensor], tuple], leaves: list[torch.Tensor],
                 example: torch.Tensor, warmup: int = 2):
        """`leaves`: the tensors whose `.grad` the backward writes (parameters or working copies)."""
        if example.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA tensor, got one on {example.device}")
        self.params = [p for p in leaves if p.requires_grad]
        self.masks = example.clone()
        device = example.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step(self.masks)
                self._drop_grads()
        torch.cuda.current_stream(device).wait_stream(side)
        self._drop_grads()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            outputs = step(self.masks)
        self.outputs = tuple(t.detach() for t in outputs)

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None


class EvalGraph(_Replay):
    """`evaluate(masks) -> (per-sample loss, per-sample hard Dice)` captured as a CUDA graph for batches
    shaped like `example` (no autograd: the forward's activations are freed as it goes, so the graph's
    pool holds about the peak of one no-grad forward). The same kernels as the eager evaluation, so the
    same bits. `run` returns the graph's own tensors, overwritten by the next replay."""

    def __init__(self, evaluate: Callable[[torch.Tensor], tuple], example: torch.Tensor, warmup: int = 1):
        if example.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA tensor, got one on {example.device}")
        device = example.device
        self.masks = example.clone()
        before = torch.cuda.memory_reserved(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                evaluate(self.masks)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.outputs = tuple(t.detach() for t in evaluate(self.masks))
        torch.cuda.synchronize(device)
        self.pool_bytes = torch.cuda.memory_reserved(device) - before  # an upper bound, logged
        log.info("evaluation captured as a CUDA graph (its memory pool: %.2f GiB)", self.pool_bytes / 2**30)
