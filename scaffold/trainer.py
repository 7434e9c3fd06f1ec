"""The training loop, read top to bottom: step, epoch, evaluation, statistics, checkpoints.

Why it looks the way it does:
- A step never blocks the host. Volumes already sit on the device as uint8 masks; the batch order for an
  epoch travels to the device once (pinned, non-blocking); the input is built on the device as
  palette[mask]; losses, Dice sums and step timings (CUDA events) stay on the device and are read once, at
  the end of the epoch. `torch.cuda.set_sync_debug_mode("error")` around an epoch proves it.
- On one CUDA device the step's forward, loss and backward are captured once as a CUDA graph and
  replayed (`cuda_graph`, scaffold/graphs.py): the same kernels and bits, one launch instead of
  hundreds, so the host no longer sets the step time. Clip and Adam stay eager.
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
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from scaffold import checkpoint, determinism, distributed
from scaffold.data.loader import make_input
from scaffold.metrics import hard_dice, per_sample_loss
from scaffold.stats import StatsFile

log = logging.getLogger("scaffold")


class Diverged(RuntimeError):
    """A non-finite loss at the end of an epoch; the last good checkpoint is kept."""


@dataclass
class Progress:
    """The run's bookkeeping, saved in every checkpoint."""

    epoch: int = 0  # last finished epoch
    total_steps: int = 0
    best_val_loss: float = math.inf
    best_epoch: int = 0
    train_time: float = 0.0  # summed epoch durations (seconds)
    time_to_target: Optional[float] = None
    target_epoch: Optional[int] = None
    last_val_dice: float = 0.0


@dataclass
class Volumes:
    """What the loop trains on, already on the device."""

    train: torch.Tensor  # uint8 (n_train, E, E, E)
    val: torch.Tensor  # uint8 (n_val, E, E, E)
    palette: torch.Tensor  # float32 (classes, 3)


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


class Trainer:
    def __init__(self, cfg: Any, model: torch.nn.Module, loss_fn: torch.nn.Module, volumes: Volumes,
                 device: torch.device, run_dir: Path, place: distributed.Place = distributed.Place(),
                 ddp_model: Optional[torch.nn.Module] = None):
        self.cfg, self.model, self.loss_fn, self.vol = cfg, model, loss_fn, volumes
        self.net = ddp_model if ddp_model is not None else model  # what the step calls
        self.device, self.run_dir, self.place = device, Path(run_dir), place
        self.n_classes = volumes.palette.shape[0]
        self.amp_dtype = _amp_dtype(cfg.precision, device)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr,
                                          weight_decay=cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
            self.optimizer, T_0=cfg.optim.t0, T_mult=cfg.optim.t_mult, eta_min=cfg.optim.eta_min)
        self.progress = Progress()
        self.census_done = False
        self.graph = None  # scaffold.graphs.StepGraph once prepare_graph has captured the step
        self.graph_tried = False
        self.on_first_step = None  # callback(model) after the first real step (the census)

    # ----------------------------------------------------------------------------------- the step
    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def step(self, masks: torch.Tensor, net=None, optimizer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on a batch of masks; returns (batch loss, per-sample soft Dice), on device.
        The real model's forward, loss and backward replay the captured graph where there is one
        (`prepare_graph`); the returned tensors are then the graph's, valid until the next step."""
        net = net or self.net
        optimizer = optimizer or self.optimizer
        graphed = self.graph is not None and net is self.net and optimizer is self.optimizer
        if graphed and self.graph.fits(masks):
            loss, dice = self.graph.run(masks)
        else:
            if graphed:  # another batch shape (an epoch's short last batch): eager, into the graph's grads
                optimizer.zero_grad(set_to_none=False)
            loss, dice = self.forward_backward(masks, net)
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), self.cfg.optim.grad_clip, foreach=True)
        optimizer.step()
        if not graphed:  # the graph writes the same gradient tensors again on its next replay
            optimizer.zero_grad(set_to_none=True)
        return loss.detach(), dice.detach()

    def forward_backward(self, masks: torch.Tensor, net=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss and backward of one batch (the part of the step a CUDA graph captures)."""
        net = net or self.net
        x = make_input(masks, self.vol.palette)
        with self._autocast():
            logits = net(x)
        # The uint8 masks are the labels: the loss reads them as they are (no int64 copy per step).
        loss, _, dice = self.loss_fn.terms(logits, masks)  # fp32, outside autocast
        loss.backward()
        return loss, dice

    def use_graph(self) -> bool:
        """Whether this run captures its step as a CUDA graph (`cuda_graph`: auto/on on one CUDA device
        in one process; `worker.run` rejects `on` elsewhere before any work)."""
        mode = getattr(self.cfg, "cuda_graph", "off")
        return mode != "off" and self.device.type == "cuda" and self.place.world == 1

    def prepare_graph(self) -> float:
        """Captures the real model's forward, loss and backward (once; outside any epoch, since the
        capture synchronizes the device); returns the seconds it took (0 when not used)."""
        if self.graph_tried or not self.use_graph():
            return 0.0
        self.graph_tried = True
        from scaffold.graphs import StepGraph

        t0 = time.perf_counter()
        rng = determinism.rng_state()
        self.model.train()
        try:  # StepGraph sets the gradients to None itself before it captures
            self.graph = StepGraph(self.forward_backward, self.model.parameters(),
                                   self.vol.train[: self.cfg.batch_size])
        except Exception as e:  # noqa: BLE001 - `auto` keeps training, eagerly; `on` promised a graph
            if self.cfg.cuda_graph == "on":
                raise
            self.graph = None
            self.optimizer.zero_grad(set_to_none=True)  # whatever a half-done capture left
            log.warning("cuda_graph=auto: the step could not be captured (%s); running it eagerly",
                        f"{type(e).__name__}: {e}".splitlines()[0])
        determinism.set_rng_state(rng)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def batch_order(self, epoch: int) -> torch.Tensor:
        """This rank's sample order for an epoch, on the device: a pure function of (seed, epoch)."""
        g = torch.Generator().manual_seed(determinism.derive_seed(self.cfg.seed, "sampler", epoch))
        order = torch.randperm(self.vol.train.shape[0], generator=g)[self.place.rank::self.place.world]
        if self.device.type == "cuda":
            return order.pin_memory().to(self.device, non_blocking=True)
        return order

    def train_epoch(self, epoch: int, profiler=None) -> dict[str, Any]:
        order = self.batch_order(epoch)
        bs = self.cfg.batch_size
        loss_sum = torch.zeros((), device=self.device)
        dice_sum = torch.zeros((), device=self.device)
        timer = StepTimer(self.device)
        bar = EpochBar(self.cfg.progress and self.place.is_main, len(order), f"epoch {epoch}")
        steps = 0
        self.net.train()
        for i in range(0, len(order), bs):
            masks = self.vol.train.index_select(0, order[i:i + bs])
            begun = timer.start()
            loss, dice = self.step(masks)
            timer.stop(begun)
            loss_sum += loss * masks.shape[0]
            dice_sum += dice.sum()
            steps += 1
            bar.update(masks.shape[0])
            if profiler is not None:
                profiler.step()
            if not self.census_done and self.on_first_step is not None:
                self.census_done = True
                self.on_first_step(self.model)
        bar.close()
        return {"loss_sum": loss_sum, "dice_sum": dice_sum, "samples": len(order), "steps": steps,
                "timer": timer}

    @torch.no_grad()
    def evaluate(self, net=None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Sums of per-sample validation loss and hard Dice over this rank's share, on the device."""
        net = net or self.net
        net.eval()
        val = self.vol.val[self.place.rank::self.place.world]
        loss_sum = torch.zeros((), device=self.device)
        dice_sum = torch.zeros((), device=self.device)
        for i in range(0, val.shape[0], self.cfg.batch_size):
            masks = val[i:i + self.cfg.batch_size]
            with self._autocast():
                logits = net(make_input(masks, self.vol.palette))
            loss_sum += per_sample_loss(self.loss_fn, logits, masks).sum()
            dice_sum += hard_dice(logits, masks, self.n_classes).sum()
        net.train()
        return loss_sum, dice_sum, val.shape[0]

    # --------------------------------------------------------------------------------- warm-up
    def warmup(self, steps: int) -> float:
        """Untimed steps on a copy of the model and optimizer (compilation, allocation); returns seconds.
        The real model, optimizer and RNG streams are untouched, so the trajectory does not change."""
        if steps <= 0:
            return 0.0
        t0 = time.perf_counter()
        rng = determinism.rng_state()
        net = copy.deepcopy(self.model)
        opt = torch.optim.Adam(net.parameters(), lr=self.cfg.lr)
        masks = self.vol.train[: self.cfg.batch_size]
        for _ in range(steps):
            self.step(masks, net=net, optimizer=opt)
        self.evaluate_batch_warmup(net)
        del net, opt
        determinism.set_rng_state(rng)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    @torch.no_grad()
    def evaluate_batch_warmup(self, net) -> None:
        masks = self.vol.val[: self.cfg.batch_size]
        with self._autocast():
            logits = net(make_input(masks, self.vol.palette))
        per_sample_loss(self.loss_fn, logits, masks)
        hard_dice(logits, masks, self.n_classes)

    # ------------------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.progress.epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": determinism.rng_state(),
            "progress": asdict(self.progress),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.progress = Progress(**state["progress"])
        determinism.set_rng_state(state["rng"])

    # ------------------------------------------------------------------------------------- fit
    def fit(self, stats: Optional[StatsFile], profile: bool = False) -> Progress:
        """Epochs until the validation Dice reaches the target or the epoch cap; returns the bookkeeping."""
        cfg, p = self.cfg, self.progress
        ckpt_dir = self.run_dir / "checkpoints"
        self.prepare_graph()  # a no-op where already captured or not used
        first = True  # the profiler window covers the first epoch this invocation runs
        while p.time_to_target is None and (cfg.epochs == -1 or p.epoch < cfg.epochs):
            epoch = p.epoch + 1
            lr = self.optimizer.param_groups[0]["lr"]
            profiler = _profiler(self.run_dir) if profile and first and self.place.is_main else None
            first = False
            t0 = time.perf_counter()
            with profiler or nullcontext():
                tr = self.train_epoch(epoch, profiler)
            vloss, vdice, nval = self.evaluate()
            # The one read of the epoch: every sum, reduced over ranks, in one transfer.
            sums = torch.stack([tr["loss_sum"], tr["dice_sum"], vloss, vdice,
                                torch.tensor(float(tr["samples"]), device=self.device),
                                torch.tensor(float(nval), device=self.device)])
            loss_sum, dice_sum, vloss_sum, vdice_sum, n_train, n_val = \
                distributed.all_reduce_sum(sums, self.place).tolist()
            step_ms = tr["timer"].median_ms()
            self.scheduler.step()
            duration = time.perf_counter() - t0
            p.epoch, p.total_steps = epoch, p.total_steps + tr["steps"]
            p.train_time += duration
            overall, val_avg = loss_sum / n_train, vloss_sum / n_val
            val_dice = vdice_sum / n_val
            finite = math.isfinite(overall) and math.isfinite(val_avg)
            is_best = finite and val_avg < p.best_val_loss
            if is_best:
                p.best_val_loss, p.best_epoch = val_avg, epoch
            p.last_val_dice = val_dice
            if finite and val_dice >= cfg.target_dice:
                p.time_to_target, p.target_epoch = p.train_time, epoch
            row = {
                "epoch": epoch, "epoch_loss": loss_sum, "overall_loss": overall,
                "val_loss_epoch": vloss_sum, "val_loss_avg": val_avg, "train_dice": dice_sum / n_train,
                "val_dice": val_dice, "epoch_duration": duration, "optimizer_steps": tr["steps"],
                "total_optimizer_steps": p.total_steps, "lr": lr, "step_ms_median": step_ms,
                "is_best": is_best, "train_time": p.train_time,
            }
            if stats is not None:
                stats.append(row)
            log.info("epoch %d | loss %.5f | val loss %.5f | train dice %.4f | val dice %.4f | lr %.2e | "
                     "step %.1f ms | %.1f s%s", epoch, overall, val_avg, row["train_dice"], val_dice, lr,
                     step_ms, duration, " | best" if is_best else "")
            if not finite:
                raise Diverged(f"non-finite loss at epoch {epoch} (train {overall}, validation {val_avg}); "
                               f"the last good checkpoint is kept in {ckpt_dir}")
            interval = cfg.checkpoint_interval
            due = (interval > 0 and epoch % interval == 0) or is_best or p.time_to_target is not None \
                or (cfg.epochs != -1 and epoch == cfg.epochs)
            if due and self.place.is_main:
                checkpoint.save(ckpt_dir / checkpoint.LAST, self.state())
                if is_best:
                    checkpoint.mark_best(ckpt_dir)
        return p


def _amp_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _profiler(run_dir: Path):
    """A torch profiler over a bounded window of the first epoch's steps (skip 1, warm 1, record 3)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)

    def save(prof):
        prof.export_chrome_trace(str(Path(run_dir) / "profile_trace.json"))

    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                   on_trace_ready=save)
