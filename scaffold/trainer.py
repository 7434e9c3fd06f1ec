"""The training loop, read top to bottom: step, epoch, evaluation, statistics, checkpoints.

Why it looks the way it does:
- A step never blocks the host. Volumes already sit on the device as uint8 masks (or, when they would
  crowd it, in pinned host memory, each step's volumes copied over without waiting); the batch order for an
  epoch travels to the device once (pinned, non-blocking); the input is built on the device as
  palette[mask]; losses, Dice sums and step timings (CUDA events) stay on the device and are read once, at
  the end of the epoch. `torch.cuda.set_sync_debug_mode("error")` around an epoch proves it.
- The step itself is scaffold.step.TrainStep (shared with the warm-up and the step benchmark); on one
  CUDA device it is replayed from a CUDA graph (`cuda_graph`): the same kernels and bits, one launch
  instead of hundreds, so the host no longer sets the step time.
- The batch order of epoch e is a pure function of (seed, e), so a resumed run only needs the epoch number
  to continue the sampler exactly where it stood.
- Warm-up steps (compilation, allocation) run on a throw-away copy of the model and optimizer, so they
  cost time before the first epoch but cannot change the trajectory.
The trainer knows nothing of Hydra: it takes any config object with the attributes of scaffold.config.Config.
"""
from __future__ import annotations

import copy
import logging
import math
import signal
import statistics
import sys
import time
from contextlib import nullcontext
from functools import partial
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from scaffold import checkpoint, determinism, distributed, fsdp, spatial
from scaffold.data.loader import make_input
from scaffold.files import atomic_path
from scaffold.kernels.lib.ahead import compile_ahead
from scaffold.metrics import hard_dice, per_sample_loss
from scaffold.stats import StatsFile, load_average
from scaffold.plan import RunPlan, asks_working_copies
from scaffold.step import EvalGraph, TrainStep, amp_dtype, keep_lr_on_device, make_optimizer, optimizer_kind

log = logging.getLogger("scaffold")


class Diverged(RuntimeError):
    """A non-finite loss at the end of an epoch; the last good checkpoint is kept."""


class Interrupted(RuntimeError):
    """SIGTERM or SIGINT stopped the run; the message is one line saying what was saved."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


# SIGUSR2: submitit's warning before a time limit or a preemption (hydra/launcher=slurm).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
                     if hasattr(signal, name))


class StopRequest:
    """SIGTERM (a scheduler's preemption), SIGUSR1 or SIGUSR2 (a scheduler's warning before it, e.g. Slurm's
    `--signal=USR1@120`, submitit's USR2), SIGINT (Ctrl-C) and SIGHUP (a closed terminal or ssh session), turned into a
    stop at a clean point.

    While the training loop runs (`armed`), a signal only sets `signum`: the loop stops at the next
    step boundary and checkpoints its position, never in the middle of a step. Outside the loop (dataset,
    model, warm-up), or on a second signal, it raises Interrupted at once."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.raised: Optional[Interrupted] = None  # what the handler raised outside the loop (see worker.run)
        self.armed = False
        self.installed = False
        self.ranks = 1  # with several, the ranks agree on the step to stop at (distributed.StopVote)

    def __call__(self, signum: int, frame: Any = None) -> None:
        name = signal.Signals(signum).name
        if self.armed and self.signum is None:
            self.signum = signum
            if self.ranks == 1:
                log.warning("%s received: stopping at the next step boundary and saving the position "
                            "(a second one stops at once)", name)
            else:
                log.warning("%s received: every rank stops at a step boundary they agree on (within %d steps) "
                            "and rank 0 saves the position (a second one stops at once)", name,
                            distributed.STOP_LAG)
            return
        self.raised = Interrupted(signum, f"interrupted by {name} before training could save its position; "
                                          "the last checkpoint, if any, is kept")
        raise self.raised

    def install(self) -> None:
        import threading

        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for s in STOP_SIGNALS:
                signal.signal(s, self)
            self.installed = True


@dataclass
class Progress:
    """The run's bookkeeping, saved in every checkpoint."""

    epoch: int = 0  # last finished epoch
    total_steps: int = 0
    best_val_loss: float = math.inf
    best_epoch: int = 0
    train_time: float = 0.0  # summed epoch durations: training + evaluation (seconds)
    wall_time: float = 0.0  # wall clock of the epochs, everything included: checkpoints, logging
    cpu_time: float = 0.0  # summed process CPU seconds of the epochs (checkpoints before it load as 0)
    time_to_target: Optional[float] = None  # wall_time at the end of the target epoch (written out)
    target_epoch: Optional[int] = None
    last_val_dice: float = 0.0
    best_val_dice: float = 0.0  # highest validation Dice so far (checkpoints before it load as 0)


@dataclass
class Volumes:
    """What the loop trains on: the masks on the device, or in pinned host memory when the device
    cannot hold them beside the step (`data_placement`; then each step copies its volumes over
    asynchronously, without waiting for the device); the palette on the device."""

    train: torch.Tensor  # uint8 (n_train, E, E, E)
    val: torch.Tensor  # uint8 (n_val, E, E, E)
    palette: torch.Tensor  # float32 (classes, 3)

    @property
    def on_host(self) -> bool:
        return self.train.device != self.palette.device

    def take(self, masks: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of `masks` (a split) on the device. Host masks: `index` is a CPU tensor, and
        each row is a view of pinned memory copied with non_blocking (the host never waits)."""
        if not self.on_host:
            return masks.index_select(0, index)
        rows = [masks[j:j + 1].to(self.palette.device, non_blocking=True) for j in index.tolist()]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def first(self, masks: torch.Tensor, n: int) -> torch.Tensor:
        return masks[:n].to(self.palette.device, non_blocking=True)


class StepTimer:
    """Per-step wall time: CUDA events on the GPU (read at epoch end), a host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, begun: Any) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((begun, ev))
        else:
            self.marks.append((begun, time.perf_counter()))

    def median_ms(self) -> float:
        """Reads the timings (for CUDA events this waits for the last one: call at epoch end)."""
        if not self.marks:
            return float("nan")
        if self.cuda:
            self.marks[-1][1].synchronize()
            times = [a.elapsed_time(b) for a, b in self.marks]
        else:
            times = [(b - a) * 1e3 for a, b in self.marks]
        return statistics.median(times)


class EpochBar:
    """A progress bar on a terminal (rank 0), a few plain lines otherwise; never reads the device."""

    def __init__(self, enabled: bool, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        self.bar = None
        self.plain = enabled and not sys.stderr.isatty()
        if enabled and not self.plain:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="vol", leave=False, dynamic_ncols=True)
        self.next_mark = 0.25

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.plain and self.done >= self.next_mark * self.total and self.done < self.total:
            print(f"{self.desc}: {self.done}/{self.total} volumes", file=sys.stderr, flush=True)
            while self.next_mark * self.total <= self.done:
                self.next_mark += 0.25

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class EpochSums:
    """One epoch's training sums on the device (read once, at epoch end), and its step count. `samples`
    and `steps` count the whole epoch, a part run before an interruption included; `done` is False when
    a stop request ended the epoch early."""

    loss: torch.Tensor
    dice: torch.Tensor
    samples: int
    steps: int
    timer: StepTimer
    done: bool = True


@dataclass
class Position:
    """Where an interrupted epoch stood: enough to finish it bit for bit after a resume."""

    epoch: int
    samples: int  # this rank's samples of the epoch already trained
    steps: int
    loss: torch.Tensor  # the epoch's partial training sums (on the CPU in a checkpoint)
    dice: torch.Tensor
    seconds: float  # wall and CPU time the epoch had taken (wall-clock columns only)
    cpu_seconds: float


class Trainer:
    def __init__(self, cfg: Any, model: torch.nn.Module, loss_fn: torch.nn.Module, volumes: Volumes,
                 device: torch.device, run_dir: Path, place: distributed.Place = distributed.Place(),
                 ddp_model: Optional[torch.nn.Module] = None, mesh: Optional[spatial.Mesh] = None,
                 plan: Optional[RunPlan] = None):
        self.cfg, self.model, self.loss_fn, self.vol = cfg, model, loss_fn, volumes
        self.net = ddp_model if ddp_model is not None else model  # what the step calls
        self.device, self.run_dir, self.place = device, Path(run_dir), place
        # Data-parallel coordinates: with spatial shards, the ranks of a shard group train the same
        # volumes (each its slab) and count as one data-parallel rank.
        self.mesh = mesh if mesh is not None else spatial.Mesh(None, place.rank, place.world)
        self.shards = self.mesh.shards
        self.n_classes = volumes.palette.shape[0]
        # The run's decisions (scaffold.plan): the autocast dtype, the optimizer's implementation and
        # whether it writes bf16 working copies of the conv weights. Without a plan (tests, tools), the
        # plan's own rules applied to this model and device. FSDP (scaffold.fsdp): the parameters are
        # shards, and every forward and backward runs collectives.
        self.sharded = fsdp.is_sharded(model)
        if plan is not None:
            self.amp_dtype, self.optimizer_kind, self.working = plan.amp_dtype, plan.optimizer, plan.working_copies
        else:
            self.amp_dtype = amp_dtype(cfg.precision, device)
            self.optimizer_kind = optimizer_kind(device, sharded=self.sharded)[0]
            self.working = asks_working_copies(ddp_model is not None or self.sharded,
                                               1 if self.shards is None else self.shards.count,
                                               getattr(model, "recompute", "off"))
        self.optimizer = make_optimizer(model, cfg, working=self.working, kind=self.optimizer_kind)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
            self.optimizer, T_0=cfg.optim.t0, T_mult=cfg.optim.t_mult, eta_min=cfg.optim.eta_min)
        self.train_step = self._train_step(self.net, self.optimizer)
        self.progress = Progress()
        self.rows: list[dict[str, Any]] = []  # the CSV rows so far, kept in checkpoints
        self.position: Optional[Position] = None  # set by a resume from an interrupted epoch
        self.writer = checkpoint.Writer(self.run_dir / "checkpoints", background=True)
        self.final_wait_s = 0.0  # the host's wait, at the target epoch, for the last writes to land
        self.submit_s = 0.0  # host time in checkpoint submits (state, snapshot enqueue, any wait), this process
        self.eval_graph: Optional[EvalGraph] = None
        self.stop = StopRequest()
        self.step_flops = 0  # the model's FLOPs per step on this device (set by the worker; 0: unknown)
        self.on_first_step = None  # callback() after the first real step (the census)

    def _train_step(self, net, optimizer) -> TrainStep:
        return TrainStep(net, self.loss_fn, optimizer, self.vol.palette, self.amp_dtype, self.cfg.optim.grad_clip)

    def step(self, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step of the real model on a batch of masks: (batch loss, per-sample soft Dice),
        on the device (graph-owned tensors when the step is captured: valid until the next step)."""
        return self.train_step(masks)

    def batch_order(self, epoch: int) -> torch.Tensor:
        """This rank's sample order for an epoch, on the device: a pure function of (seed, epoch, rank,
        world). Every rank gets the same number of samples, so every rank takes the same number of
        optimizer steps (DDP's all-reduce never waits for a rank that has run out): the remainder of
        the training set over the world size is dropped for the epoch, the tail of that epoch's
        permutation, so a different few samples sit out each epoch and none is counted twice."""
        g = torch.Generator().manual_seed(determinism.derive_seed(self.cfg.seed, "sampler", epoch))
        n, world = self.vol.train.shape[0], self.mesh.data_world
        order = torch.randperm(n, generator=g)[: n - n % world][self.mesh.data_rank::world]
        if self.device.type == "cuda" and not self.vol.on_host:
            return order.pin_memory().to(self.device, non_blocking=True)
        return order

    def train_epoch(self, epoch: int, profiler=None, start: Optional[Position] = None) -> EpochSums:
        """One epoch of steps, or its rest after `start`. Stops early at a step boundary when a stop is
        requested: the next one in a single process; with several ranks, one every rank agrees on,
        within distributed.STOP_LAG steps of the request (distributed.StopVote)."""
        order = self.batch_order(epoch)
        bs = self.cfg.batch_size
        loss_sum = torch.zeros((), device=self.device)
        dice_sum = torch.zeros((), device=self.device)
        first, steps = 0, 0
        if start is not None:  # with several ranks, the sums of each rank, in rank order
            loss_sum.copy_(start.loss[self.place.rank] if start.loss.dim() else start.loss)
            dice_sum.copy_(start.dice[self.place.rank] if start.dice.dim() else start.dice)
            first, steps = start.samples, start.steps
        timer = StepTimer(self.device)
        bar = EpochBar(self.cfg.progress and self.place.is_main, len(order), f"epoch {epoch}")
        bar.update(first)
        self.net.train()
        vote = distributed.StopVote(self.place, self.device) if self.place.world > 1 else None
        self.stop.ranks = self.place.world
        for i in range(first, len(order), bs):
            stopping = vote.agreed() if vote is not None else self.stop.signum is not None
            if stopping:
                bar.close()
                if vote is not None:
                    vote.drain()
                return EpochSums(loss_sum, dice_sum, i, steps, timer, done=False)
            masks = self.vol.take(self.vol.train, order[i:i + bs])
            begun = timer.start()
            loss, dice = self.step(masks)
            timer.stop(begun)
            loss_sum += loss * masks.shape[0]
            dice_sum += dice.sum()
            steps += 1
            bar.update(masks.shape[0])
            if profiler is not None:
                profiler.step()
            if self.on_first_step is not None:
                self.on_first_step()
                self.on_first_step = None
            if vote is not None:
                vote.post(self.stop.signum is not None)
        if vote is not None:
            vote.drain()
        bar.close()
        return EpochSums(loss_sum, dice_sum, len(order), steps, timer)

    @torch.no_grad()
    def eval_batch(self, net, masks: torch.Tensor, keep: Optional[Callable[[torch.Tensor], None]] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample validation loss and hard Dice of one batch, on the device. `keep(logits)`, when
        given, sees the batch's logits first (scaffold.predict: the predicted masks and more metrics)."""
        with self.train_step.autocast_context(self.device):
            logits = net(make_input(masks, self.vol.palette))
        if keep is not None:
            keep(logits)
        return (per_sample_loss(self.loss_fn, logits, masks),
                hard_dice(logits, masks, self.n_classes, shards=self.shards))

    @torch.no_grad()
    def evaluate(self, keep: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = None
                 ) -> torch.Tensor:
        """Per-sample validation loss and hard Dice, (2, n_val) on the device: this rank's samples
        (rank, rank + world, ..., no padding) in their own columns, zeros elsewhere. Summed over ranks
        (`fit`), every rank holds every value bit for bit (each column has one contributor, and
        x + 0 = x), so the epoch's means are summed over the same vector in the same order as in one
        process: exact global means at any world size. `keep(positions, masks, logits)`, when given,
        sees every batch's logits (the batches then run eagerly: the same bits as the graph)."""
        model = self.model  # unwrapped: ranks evaluate different counts, so no collective may run
        model.eval()
        n, bs = self.vol.val.shape[0], self.cfg.batch_size
        out = torch.zeros(2, n, device=self.device)
        mine = torch.arange(self.mesh.data_rank, n, self.mesh.data_world, device=self.device)
        host = torch.arange(self.mesh.data_rank, n, self.mesh.data_world) if self.vol.on_host else mine
        for i in range(0, mine.shape[0], bs):
            positions = mine[i:i + bs]
            masks = self.vol.take(self.vol.val, host[i:i + bs])
            if keep is None and self.eval_graph is not None and self.eval_graph.fits(masks):
                loss, dice = self.eval_graph.run(masks)
            else:
                seen = None if keep is None else (lambda logits, p=positions, m=masks: keep(p, m, logits))
                loss, dice = self.eval_batch(model, masks, seen)
            out.index_copy_(1, positions, torch.stack([loss, dice]).float())
        if self.sharded:  # every forward gathers: each rank runs as many batches as the busiest one
            most = math.ceil(math.ceil(n / self.mesh.data_world) / bs)
            for _ in range(most - math.ceil(mine.shape[0] / bs)):
                self.eval_batch(model, self.vol.first(self.vol.val, 1))  # its values are dropped
        model.train()
        return out

    # ------------------------------------------------------------------------ before the first epoch
    def warmup(self, steps: int) -> float:
        """Untimed steps on up to `steps` distinct training batches, then up to `steps` validation
        batches, as upstream ScaFFold's warm-up (its 64 and 64), on a copy of the model and optimizer
        (compilation, allocation); returns seconds. The real model, optimizer and RNG streams are
        untouched, so the trajectory does not change. A step and an evaluation batch first run with
        their Triton launches turned into compilations on a thread pool (scaffold.kernels.lib.ahead: a
        cold start compiles in parallel); they only prime the caches, and the copy is thrown away."""
        if steps <= 0:
            return 0.0
        if self.sharded:
            return self._warmup_sharded(steps)
        t0 = time.perf_counter()
        rng = determinism.rng_state()
        net = copy.deepcopy(self.model)
        step = self._train_step(net, make_optimizer(net, self.cfg, working=self.working, kind=self.optimizer_kind))
        masks = self.vol.first(self.vol.train, self.cfg.batch_size)
        try:
            with compile_ahead() as ahead:
                if ahead:
                    step(masks)
                    self.eval_batch(net, self.vol.first(self.vol.val, self.cfg.batch_size))
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the kernels then compile at their first launch, as
            # without this pass, where a kernel that cannot compile falls back to its vendor op
            log.warning("compiling the kernels ahead failed (%s); compiling them at first launch instead",
                        f"{type(e).__name__}: {e}".splitlines()[0])
        bs = self.cfg.batch_size
        for split, run in ((self.vol.train, step), (self.vol.val, lambda m: self.eval_batch(net, m))):
            for k in range(min(steps, -(-len(split) // bs))):
                rows = torch.arange(k * bs, min((k + 1) * bs, len(split)))
                run(self.vol.take(split, rows if self.vol.on_host else rows.to(split.device)))
        del net, step
        determinism.set_rng_state(rng)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _warmup_sharded(self, steps: int) -> float:
        """The warm-up under FSDP, on the model itself (a copy of a sharded model would be one more
        set of shards and collectives): forwards and backwards of up to `steps` training batches, their
        gradients dropped and no optimizer step, then up to `steps` validation batches. The parameters,
        the optimizer and the RNG streams are untouched. Every rank runs the same batches (each pass
        gathers); the kernels compile at their first launch."""
        t0 = time.perf_counter()
        rng = determinism.rng_state()
        bs = self.cfg.batch_size
        for split, train in ((self.vol.train, True), (self.vol.val, False)):
            for k in range(min(steps, -(-len(split) // bs))):
                rows = torch.arange(k * bs, min((k + 1) * bs, len(split)))
                masks = self.vol.take(split, rows if self.vol.on_host else rows.to(split.device))
                if train:
                    self.train_step.forward_backward(masks)
                    for p in self.train_step.leaves:
                        p.grad = None
                else:
                    self.eval_batch(self.model, masks)
        determinism.set_rng_state(rng)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def settle_buckets(self) -> float:
        """One throw-away forward and backward through DDP, before the first real step; returns seconds.

        DDP buckets the gradients in the parameters' reverse order at construction and rebuilds the
        buckets once, in the order the gradients became ready in its first backward, before its second
        forward. The buckets' layout decides which rank sums which elements in the all-reduce, so with
        three ranks or more it changes the sums' bits: every launch's first step would reduce in the
        construction order, and a resumed run would differ from an uninterrupted one. After this pass
        every real step of every launch, the first included, reduces in the rebuilt order (the order
        of one graph's backward: the same on every launch). The parameters, the optimizer and the RNG
        streams are untouched and the gradients dropped; it costs one forward and backward of start-up."""
        if not isinstance(self.net, torch.nn.parallel.DistributedDataParallel):
            return 0.0
        t0 = time.perf_counter()
        rng = determinism.rng_state()
        self.train_step.forward_backward(self.vol.first(self.vol.train, self.cfg.batch_size))
        for p in self.train_step.leaves:
            p.grad = None
        determinism.set_rng_state(rng)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def capture(self, required: bool) -> float:
        """Captures the real step, and the evaluation of one batch, as CUDA graphs (see scaffold.step);
        returns the seconds it took."""
        t0 = time.perf_counter()
        # Under DDP every rank captures its all-reduce: all ranks replay graphs, or none does.
        agree = partial(distributed.agree, place=self.place) if self.place.world > 1 else None
        self.train_step.capture(self.vol.first(self.vol.train, self.cfg.batch_size), required, agree)
        if self.train_step.graph is not None:
            self.model.eval()
            try:
                self.eval_graph = EvalGraph(lambda m: self.eval_batch(self.model, m),
                                            self.vol.first(self.vol.val, self.cfg.batch_size))
            except Exception as e:  # noqa: BLE001 - evaluation then runs eagerly, same bits
                if required:
                    raise
                log.warning("cuda_graph=auto: the evaluation could not be captured (%s); running it eagerly",
                            f"{type(e).__name__}: {e}".splitlines()[0])
            finally:
                self.model.train()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------ checkpoints
    def state(self, position: Optional[Position] = None) -> dict[str, Any]:
        """What a checkpoint holds. Under FSDP a collective (every rank calls it): the unsharded model
        and optimizer states are gathered on rank 0, in host memory (the other ranks' are empty)."""
        if self.sharded:
            model_state, optimizer_state = fsdp.full_state(self.model, self.optimizer)
        else:
            model_state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
        state = {
            "epoch": self.progress.epoch,
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "rng": determinism.rng_state(),
            "progress": asdict(self.progress),
            "rows": list(self.rows),
        }
        if position is not None:
            state["position"] = {**asdict(position), "loss": position.loss.cpu(), "dice": position.dice.cpu()}
        return state

    def load_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        try:
            if self.sharded:  # each rank keeps its shard of the unsharded state (a collective)
                fsdp.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
            else:
                self.model.load_state_dict(state["model"])
        except (RuntimeError, KeyError) as e:  # another model's checkpoint: torch lists every mismatch
            raise checkpoint.CheckpointError(f"{source}: holds a different model than this config builds "
                                             f"({_first_mismatch(e)})") from None
        if not self.sharded:
            self.optimizer.load_state_dict(state["optimizer"])
        keep_lr_on_device(self.optimizer)  # the captured step reads the rate from that tensor
        fresh = list(self.scheduler.base_lrs)
        self.scheduler.load_state_dict(state["scheduler"])
        # map_location brought the schedule's base rates to the CPU: compute the schedule where an
        # uninterrupted run does (a device tensor stays one), so the rates keep their bits.
        self.scheduler.base_lrs = [torch.as_tensor(b).to(f.device) if torch.is_tensor(f) else b
                                   for b, f in zip(self.scheduler.base_lrs, fresh)]
        self.progress = Progress(**state["progress"])
        self.rows = list(state.get("rows", []))
        pos = state.get("position")
        self.position = Position(**pos) if pos else None
        if self.position is not None:
            ranks = self.position.loss.shape[0] if self.position.loss.dim() else 1
            if ranks != self.place.world:
                raise checkpoint.CheckpointError(
                    f"{source}: holds a position inside epoch {self.position.epoch} saved by {ranks} "
                    f"rank(s); a mid-epoch position continues only at that world size (resume with "
                    f"{ranks} rank(s))")
        determinism.set_rng_state(state["rng"])

    # ------------------------------------------------------------------------------------- fit
    def fit(self, stats: Optional[StatsFile], profile: bool = False) -> Progress:
        """Epochs until the validation Dice reaches the target or the epoch cap; returns the bookkeeping."""
        self.stop.armed = True
        try:
            self._fit(stats, profile, self.run_dir / "checkpoints")
        except BaseException:
            try:
                self.writer.flush()  # what was submitted reaches the disk before the error surfaces
            except checkpoint.CheckpointError as e:
                log.error("%s", e)
            raise
        finally:
            self.stop.armed = False
        self.writer.flush()
        return self.progress

    def _fit(self, stats: Optional[StatsFile], profile: bool, ckpt_dir: Path) -> None:
        cfg, p = self.cfg, self.progress
        first = True  # the profiler window covers the first epoch this invocation runs
        while p.target_epoch is None and (cfg.epochs == -1 or p.epoch < cfg.epochs):
            wall0 = time.perf_counter()
            epoch = p.epoch + 1
            lr = float(self.optimizer.param_groups[0]["lr"])  # between epochs: the device is idle
            profiler = _profiler(self.run_dir) if profile and first and self.place.is_main else None
            first = False
            start, self.position = self.position, None
            t0, cpu0 = time.perf_counter(), time.process_time()
            if start is not None:  # the epoch was interrupted: count the time it had already taken,
                # in the epoch's timer and in the wall clock (time to target) alike
                t0, cpu0 = t0 - start.seconds, cpu0 - start.cpu_seconds
                wall0 -= start.seconds
            with profiler or nullcontext():
                tr = self.train_epoch(epoch, profiler, start)
            if not tr.done:
                if cfg.checkpoint_interval < 0:  # no checkpoint at all: the run just stops
                    raise Interrupted(self.stop.signum, f"interrupted by {signal.Signals(self.stop.signum).name}"
                                                        f" in epoch {epoch}; checkpoint_interval=-1: nothing saved")
                self._save_position(epoch, tr, t0, cpu0, ckpt_dir)
            val = self.evaluate()
            stop = torch.full((1,), float(self.stop.signum is not None), device=self.device)
            loss_sum, dice_sum, stops, vloss_sum, vdice_sum = self.reduce_epoch(
                torch.stack([tr.loss, tr.dice]), stop, val)
            stop_signum = (self.stop.signum or signal.SIGTERM) if stops else 0
            n_train, n_val = tr.samples * self.mesh.data_world, val.shape[1]
            step_ms = tr.timer.median_ms()
            self.scheduler.step()
            duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            p.epoch, p.total_steps = epoch, p.total_steps + tr.steps
            p.train_time += duration
            p.cpu_time += cpu
            load = load_average()
            overall, val_avg = loss_sum / n_train, vloss_sum / n_val
            val_dice = vdice_sum / n_val
            finite = math.isfinite(overall) and math.isfinite(val_avg)
            is_best = finite and val_avg < p.best_val_loss
            if is_best:
                p.best_val_loss, p.best_epoch = val_avg, epoch
            p.last_val_dice = val_dice
            if finite:
                p.best_val_dice = max(p.best_val_dice, val_dice)
            watched = dice_sum / n_train if getattr(cfg, "target_metric", "val_dice") == "train_dice" else val_dice
            if finite and watched >= cfg.target_dice:
                p.target_epoch = epoch
            row = {
                "epoch": epoch, "epoch_loss": loss_sum, "overall_loss": overall,
                "val_loss_epoch": vloss_sum, "val_loss_avg": val_avg, "train_dice": dice_sum / n_train,
                "val_dice": val_dice, "epoch_duration": duration, "optimizer_steps": tr.steps,
                "total_optimizer_steps": p.total_steps, "lr": lr, "step_ms_median": step_ms,
                "step_tflops": self.step_flops / (step_ms * 1e9) if self.step_flops and step_ms > 0 else math.nan,
                "is_best": is_best, "train_time": p.train_time, "cpu_time": cpu,
                "load_avg": load[0] if load else math.nan,
            }
            self.rows.append(row)
            if stats is not None:
                stats.append(row)
            log.info("epoch %d | loss %.5f | val loss %.5f | train dice %.4f | val dice %.4f | lr %.2e | "
                     "step %.1f ms | %.1f s%s", epoch, overall, val_avg, row["train_dice"], val_dice, lr,
                     step_ms, duration, " | best" if is_best else "")
            if not finite:
                self.writer.flush()
                kept = (f"the last good checkpoint is kept in {ckpt_dir}" if (ckpt_dir / checkpoint.LAST).exists()
                        else "no checkpoint was written before it")
                raise Diverged(f"non-finite loss at epoch {epoch} (train {overall}, validation {val_avg}); {kept}")
            interval = cfg.checkpoint_interval
            due = (interval > 0 and epoch % interval == 0) or is_best or p.target_epoch is not None \
                or (cfg.epochs != -1 and epoch == cfg.epochs) or stop_signum
            due = due and interval >= 0  # -1: no checkpoint at all (upstream's -1)
            # Wall clock of the epoch, everything included: up to here (what the checkpoint records),
            # then the snapshot and any wait for the previous write. The write itself runs in the
            # background during the next epoch.
            p.wall_time += time.perf_counter() - wall0
            if due and (self.place.is_main or self.sharded):  # FSDP: every rank gathers the state
                t0 = time.perf_counter()
                state = self.state()
                if self.place.is_main:
                    self.writer.submit(state, is_best)  # queued behind a write in flight, if any
                del state
                spent = time.perf_counter() - t0
                self.submit_s += spent
                p.wall_time += spent
            if p.target_epoch is not None:
                # The run ends here: the user waits for the last write too, so it counts.
                t0, waited = time.perf_counter(), self.writer.waited_s
                self.writer.flush()
                self.final_wait_s = self.writer.waited_s - waited  # the writer's own count, a part of
                p.wall_time += time.perf_counter() - t0  # checkpoint_wait_s; the wall clock counts it all
                p.time_to_target = p.wall_time
            if stop_signum:
                self.writer.flush()
                saved = (f"saved in {ckpt_dir / checkpoint.LAST}" if interval >= 0
                         else "checkpoint_interval=-1: nothing saved")
                raise Interrupted(stop_signum, f"interrupted by {signal.Signals(stop_signum).name}: stopped at "
                                               f"the end of epoch {epoch}, {saved}")

    def reduce_epoch(self, train: torch.Tensor, stop: torch.Tensor, val: torch.Tensor) -> list[float]:
        """The one reduction and the one read of an epoch: the training sums (loss, Dice) of every rank,
        whether any rank was asked to stop (`stop`, (1,)) and the validation values of every sample
        (`evaluate`'s (2, n_val)), summed over ranks in one all-reduce; returns [training loss sum,
        training Dice sum, stop requests, validation loss sum, validation hard Dice sum]. (Also what
        scaffold.predict sums its values with, so its means are the trainer's bit for bit.)"""
        values = torch.cat([train, val.flatten()])
        if self.shards is not None and not self.shards.leader:
            values = torch.zeros_like(values)  # a shard group's values are one rank's, replicated
        reduced = distributed.all_reduce_sum(torch.cat([values[:2], stop, values[2:]]), self.place)
        return torch.cat([reduced[:3], reduced[3:].view(2, -1).sum(1)]).tolist()

    def _save_position(self, epoch: int, tr: EpochSums, t0: float, cpu0: float, ckpt_dir: Path) -> None:
        """Checkpoint an epoch stopped at a step boundary, then end the run. With several ranks (all
        stopped before the same step) rank 0 saves every rank's partial sums, in rank order."""
        loss, dice = tr.loss, tr.dice
        if self.place.world > 1:
            loss, dice = distributed.gather_rows(torch.stack([tr.loss, tr.dice]), self.place).unbind(1)
        pos = Position(epoch, tr.samples, tr.steps, loss, dice, time.perf_counter() - t0,
                       time.process_time() - cpu0)
        self.writer.flush()
        state = self.state(pos) if self.place.is_main or self.sharded else None  # FSDP: every rank gathers
        if self.place.is_main:
            checkpoint.save(ckpt_dir / checkpoint.LAST, state)
        distributed.barrier(self.place)  # the position is on the disk before any rank reports it
        name = signal.Signals(self.stop.signum).name
        raise Interrupted(self.stop.signum, f"interrupted by {name}: epoch {epoch} stopped after {tr.steps} "
                                            f"steps, position saved in {ckpt_dir / checkpoint.LAST}")


def _first_mismatch(e: RuntimeError) -> str:
    """The first line that names a parameter in load_state_dict's error."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    named = [x for x in lines if x.startswith(("size mismatch", "Missing key", "Unexpected key"))]
    return (named or lines or ["state dict mismatch"])[0].rstrip(".")


def _profiler(run_dir: Path):
    """A torch profiler over a bounded window of the first epoch's steps (skip 1, warm 1, record 3)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)

    def save(prof):
        with atomic_path(Path(run_dir) / "profile_trace.json") as tmp:  # never a torn trace
            prof.export_chrome_trace(str(tmp))

    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                   on_trace_ready=save)
