"""One process's whole job, in phases: join, plan, claim, data, build, records, start, fit, result.

`run(cfg, run_dir)` takes a plain config object (scaffold.config.Config or an OmegaConf node of it) and a
run directory; it knows nothing of Hydra. Every check that can fail on bad input runs before the dataset
is generated or the model is built; every decision about how the run runs is scaffold.plan's, made once
(`RunPlan.lines()` logs them), and the phases below only build what the plan says.
"""
from __future__ import annotations

import datetime as _dt
import gc
import json
import logging
import math
import os
import platform
import tempfile
import time
from functools import partial
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

import scaffold
from scaffold import checkpoint, determinism, distributed, fsdp, report, rundir, spatial
from scaffold.config import ConfigError
from scaffold.files import write_json
from scaffold.plan import RunPlan, device_kind, resolve, roomy_allocator, validate
from scaffold.rundir import CENSUS_FILE, CHECKPOINT_DIR, RESULT_FILE, RUN_FILE, STATS_FILE
from scaffold.stats import StatsFile, load_average
from scaffold.tracking import NullTracker, make_tracker
from scaffold.trainer import STOP_SIGNALS, Interrupted, Progress, StopRequest, Trainer, Volumes

log = logging.getLogger("scaffold")


def device_name(device: torch.device) -> str:
    """The device a run used, by name: the GPU's model, or the CPU's (not the platform's) model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # Linux: platform.processor() is often empty or just the architecture there
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def place_masks(plan: RunPlan, train: torch.Tensor, val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks where the plan puts them: the device, or pinned host memory (each step then copies
    its volumes over asynchronously)."""
    if plan.masks_on_host:
        return train.pin_memory(), val.pin_memory()
    return train.to(plan.device), val.to(plan.device)


def check_writable(run_dir: Path) -> None:
    """The run directory exists and takes a new file (a probe under a name unique to this process)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"run directory {run_dir}: not writable ({e.strerror or e})") from None


def _attempt(fn, *args, **kwargs):
    """(fn's result, None), or (None, the exception) for distributed.agree to share."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - handed to every rank by distributed.agree
        return None, e


def record_resume(run_dir: Path, at_epoch: int, checkpoint_name: str, overrides: list[str],
                  world_size: int = 1) -> tuple[list[str], list[dict]]:
    """Append this resume to run.json's history; returns the run's original overrides and its resumes.

    The original overrides stay what identifies the run (a sweep's summary lists a job by them); each
    resume's own (epochs=..., device=...) go into the history. It lives in run.json, written before any
    training, so a resume that is killed before its result.json still counts in the next one's."""
    run_file = run_dir / RUN_FILE
    record = json.loads(run_file.read_text())
    before = ([r.get("world_size") for r in record.get("resumes", []) if r.get("world_size")]
              or [record.get("world_size", world_size)])[-1]
    if before != world_size:
        log.warning("resume: world size %d -> %d: the run continues, not bitwise as it would have (the "
                    "sampler deals the samples to another number of ranks)", before, world_size)
    record["resumes"] = list(record.get("resumes", [])) + [{
        "at_epoch": at_epoch,
        "checkpoint": checkpoint_name,
        "world_size": world_size,
        "overrides": list(overrides),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }]
    write_json(run_file, record)
    return list(record.get("overrides", [])), record["resumes"]


def config_dict(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def claim(run_dir: Path, resume: bool) -> Optional[rundir.Claim]:
    """This process's exclusive hold on the run directory (rank 0 only): a second live process on the
    run, or a new run in a directory that already holds one, is refused in one line. Returns the claim
    taken here (to release at the end), or None when the process already owned the directory (the
    command line took it before Hydra started, and releases it)."""
    mine = rundir.owned(run_dir)
    try:
        held = mine or rundir.own(run_dir)
    except rundir.RunDirBusy as e:
        raise ConfigError(str(e)) from None
    if not resume and (run_dir / RUN_FILE).exists():
        if mine is None:
            held.release()
        raise ConfigError(f"run directory {run_dir} already holds a run (resume={run_dir} continues it; "
                          "a new run needs another directory)")
    return None if mine else held


def run(cfg: Any, run_dir: Path, resume: bool = False, overrides: Optional[list[str]] = None) -> dict:
    """Train one model; returns the result summary (also written to run_dir/result.json).

    SIGTERM, SIGUSR1 and SIGINT stop training at a step boundary with the position checkpointed
    (scaffold.trainer.StopRequest), raising scaffold.trainer.Interrupted; the handlers and the run
    directory's lock are given back when this returns or raises. A collective that times out raises
    distributed.RankTimeout naming the ranks that did not arrive."""
    import signal

    stop, held = StopRequest(), []
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    stop.install()
    try:
        return _run(cfg, Path(run_dir), resume, overrides, stop, held)
    except Interrupted:
        raise
    except BaseException as e:
        if stop.raised is not None:
            # The handler's exception can surface as another: raised while a lock was being released
            # (a worker pool's condition wait), it leaves "release unlocked lock" in its place.
            raise stop.raised from None
        if not isinstance(e, RuntimeError):
            raise
        # a collective timed out: name the ranks that never arrived (hung)
        named = distributed.roll_call(e, cfg.parallel.timeout_s)
        if named is None:
            raise
        raise named from None
    finally:
        for lock in held:
            lock.release()
        if stop.installed:
            for s, handler in saved.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)


@dataclass
class Job:
    """What the phases hand on: the place in the job, the plan, the run directory and what each phase
    built."""

    cfg: Any
    run_dir: Path
    resume: bool
    overrides: list[str]
    started: float = field(default_factory=time.perf_counter)
    load_at_start: Any = None
    place: distributed.Place = distributed.Place()
    plan: Optional[RunPlan] = None
    mesh: Any = None
    state: Optional[dict] = None  # the checkpoint a resume continues from
    ckpt_path: Optional[Path] = None
    data: Any = None  # (dataset path, info, train masks, val masks)
    trainer: Optional[Trainer] = None
    model: Any = None
    ddp: Any = None
    n_params: int = 0
    fingerprint: str = ""  # FSDP: of the whole parameters this rank sharded
    stats: Optional[StatsFile] = None
    tracker: Any = None
    original_overrides: list[str] = field(default_factory=list)
    resumes: list[dict] = field(default_factory=list)
    startup: dict = field(default_factory=dict)
    startup_s: float = 0.0


@dataclass
class Result:
    """The run's outcome: result.json's fields (see README's figure of merit)."""

    epochs: int
    optimizer_steps: int
    best_epoch: int  # lowest val_loss_avg: the CSV's last row with is_best = 1
    best_val_loss: float
    final_val_dice: float
    best_val_dice: float
    target_dice: float
    # Wall clock from the first training step to the end of the epoch that reached the target,
    # everything included (evaluation, checkpoints, logging); start-up is beside it.
    time_to_target_s: Optional[float]
    # Upstream ScaFFold's figure of merit, beside ours: the summed epoch_duration up to the target epoch
    # (training and evaluation; checkpoints, logging and the epochs' seams excluded) and its inverse,
    # in 1/s (higher is better).
    epoch_time_to_target_s: Optional[float]
    upstream_fom: Optional[float]
    target_epoch: Optional[int]
    startup_s: float
    startup: dict
    wall_time_s: float
    train_time_s: float  # summed epoch_duration: training + evaluation only
    checkpoint_wait_s: float  # host time spent waiting for background writes
    checkpoint_final_wait_s: float  # of which at the target epoch, for the last writes
    # host time the epochs spent handing checkpoints over (state, snapshot enqueue, waits): with the
    # final wait, what checkpoints cost the wall clock up to the target (like the two waits above,
    # counted by this process: a resumed run's figure covers the epochs since the resume)
    checkpoint_submit_s: float
    # CPU time and machine load beside the wall times: a slow run starved of cores (CPU well below
    # threads x wall, high load) reads differently from one that is slow on its own.
    train_cpu_s: float
    cpu_count: Optional[int]
    torch_threads: int
    load_avg_start: Any
    load_avg_end: Any
    dataset_s: float
    warmup_s: float
    cuda_graph: bool
    graph_capture_s: float
    # FLOP rate: the model's FLOPs per step on this device (convolutions, forward and backward:
    # scaffold/model/flops.py), over the median of the epochs' median step times; the fraction of the
    # device's dense bf16 peak (None on a CPU or an unlisted device).
    step_tflop: float
    step_tflops: Optional[float]
    bf16_peak_tflops: Optional[float]
    peak_fraction: Optional[float]
    overrides: list[str]  # those the run was started with; a resume's are in `resumes`
    resumes: list[dict]
    plan: dict  # the run's decisions (scaffold.plan.RunPlan.record)
    # On CUDA: the memory model's GiB for a rank, every rank's measured peak (max_memory_allocated over
    # the run, rank order) and the largest over the prediction; None on the CPU.
    memory: Optional[dict]


def _run(cfg: Any, run_dir: Path, resume: bool, overrides: Optional[list[str]], stop: StopRequest,
         held: list) -> dict:
    job = Job(cfg, run_dir, resume, list(overrides or []))
    _join(job)
    _plan(job)
    _claim(job, held)
    _load_data(job)
    _build(job, stop)
    _records(job)
    _start(job)
    progress = _fit(job)
    return _result(job, progress)


def _join(job: Job) -> None:
    """Check the config, set the determinism mode, join the process group (under torchrun)."""
    cfg = job.cfg
    validate(cfg)
    job.load_at_start = load_average()  # with the end's, tells a run slowed by other work on the machine
    determinism.configure(cfg.determinism)  # before anything touches CUDA
    job.place = distributed.init(device_kind(cfg), cfg.parallel.timeout_s)
    try:  # every rank runs the same config (a rank launched with other overrides would train apart)
        distributed.check_same(rundir.config_hash(config_dict(cfg)), "the config's hash", job.place)
    except RuntimeError as e:
        raise ConfigError(f"{e}: launch every rank with the same overrides") from None


def _plan(job: Job) -> None:
    """Every decision of the run, once, logged with its reason."""
    job.plan = resolve(job.cfg, job.place)
    if job.plan.expandable_segments and roomy_allocator():
        log.info("memory: expandable allocator segments (PYTORCH_CUDA_ALLOC_CONF unset)")
    for line in job.plan.lines():
        log.info("%s", line)


def _claim(job: Job, held: list) -> None:
    """Only rank 0 touches the run directory; the others learn its path and whether it works. Then the
    shard mesh, and the checkpoint a resume continues from."""
    cfg, place = job.cfg, job.place
    job.run_dir = Path(distributed.broadcast_object(str(job.run_dir), place))
    distributed.agree(_attempt(check_writable, job.run_dir)[1] if place.is_main else None, place)
    error = None
    if place.is_main:
        lock, error = _attempt(claim, job.run_dir, job.resume)
        held += [lock] if lock else []
    distributed.agree(error if place.is_main else None, place)
    job.mesh = spatial.make_mesh(place.rank, place.world, job.plan.spatial_shards, job.plan.device.type,
                                 cfg.parallel.timeout_s)
    if job.resume:
        note = checkpoint.remove_stale_temporaries(job.run_dir) if place.is_main else None  # holds the lock
        if note:
            log.warning("%s", note)
        try:
            job.state, job.ckpt_path = checkpoint.load_latest(job.run_dir / CHECKPOINT_DIR)
            log.info("resuming from %s (epoch %d)", job.ckpt_path, job.state["epoch"])
        except checkpoint.NoCheckpoint as e:
            # Stopped before its first checkpoint reached the disk (written in the background): every
            # random stream is seeded, so starting over gives the bits of a run that never stopped.
            log.warning("%s: the run starts over from epoch 1", e)


def _load_data(job: Job) -> None:
    """One rank per node generates (or reuses, verified; or repairs) the dataset, the others then read
    it, verified too; a sharded rank reads only its slab."""
    from scaffold.data import store

    cfg, place, sg = job.cfg, job.place, job.mesh.shards
    t0 = time.perf_counter()
    leader = place.local_rank == 0
    slab = (sg.index, sg.count) if sg is not None else None
    data, error = _attempt(store.load, cfg.data, cfg.scale, cfg.seed, progress=cfg.progress and place.is_main,
                           slab=slab) if leader else (None, None)
    distributed.agree(error, place)
    if not leader:
        data = store.load(cfg.data, cfg.scale, cfg.seed, progress=False, repair=False, slab=slab)
    job.data = data
    path, info = data[0], data[1]
    job.startup["dataset_s"] = time.perf_counter() - t0
    log.info("dataset %s: %d train + %d validation volumes of %d³, %d classes (%.1f s)", path,
             info.n_train, info.n_val, info.edge, info.n_classes, job.startup["dataset_s"])
    # Triton's compiled kernels beside the datasets: one folder to keep (or mount into a container)
    # makes a later run on the machine start warm. A TRITON_CACHE_DIR of the user's wins.
    os.environ.setdefault("TRITON_CACHE_DIR", str(store.cache_dir(cfg.data.cache_dir) / "triton"))


def _build(job: Job, stop: StopRequest) -> None:
    """The model (initialised on the CPU: the same start on any device), the loss, the volumes on the
    device and the trainer, as the plan says."""
    from scaffold.loss import SegmentationLoss, check_labels, class_weights, sampled_counts
    from scaffold.model.unet import UNet3d

    cfg, plan, sg = job.cfg, job.plan, job.mesh.shards
    t0 = time.perf_counter()
    path, info, train_masks, val_masks = job.data
    job.data = (path, info)
    determinism.seed_all(cfg.seed)
    model = UNet3d.from_config(cfg, info.n_classes, plan).to_device(plan.device)
    spatial.shard_model(model, sg)
    fraction = float(cfg.data.ce_weight_sample_fraction)
    counts = info.class_counts if fraction >= 1 else sampled_counts(train_masks, fraction, info.n_classes)
    if fraction < 1 and sg is not None:  # each rank counted its slab: the volumes' counts are the sum
        counts = spatial.all_sum(torch.from_numpy(counts).to(plan.device), sg).cpu().numpy()
    loss_fn = SegmentationLoss(class_weights(counts), rung=cfg.ladder.loss).to(plan.device)
    train, val = torch.from_numpy(train_masks), torch.from_numpy(val_masks)
    del train_masks, val_masks
    check_labels(train, info.n_classes)  # once per dataset, never inside the step
    check_labels(val, info.n_classes)
    volumes = Volumes(*place_masks(plan, train, val), torch.from_numpy(info.palette).to(plan.device))
    job.model, job.n_params = model, sum(p.numel() for p in model.parameters())
    _trainer(job, loss_fn, volumes, stop)
    job.startup["model_s"] = time.perf_counter() - t0


def _trainer(job: Job, loss_fn: Any, volumes: Volumes, stop: StopRequest) -> None:
    """DDP or FSDP where the plan says, the loss over a split volume, the trainer, and the census after
    the first step."""
    from scaffold.model.flops import config_step_flops

    cfg, place, plan, sg, model = job.cfg, job.place, job.plan, job.mesh.shards, job.model
    ddp = None
    if plan.fsdp:  # parameters, gradients and Adam state sharded over the ranks: no DDP
        job.fingerprint = distributed.fingerprint(model.parameters())  # what this rank shards (_records)
        fsdp.shard_model(model, plan.device.type)
    elif plan.data_parallel:
        ddp = data_parallel(model, plan)
    step_loss = loss_fn.split(partial(spatial.all_sum, sg=sg)) if sg is not None else loss_fn
    trainer = Trainer(cfg, model, step_loss, volumes, plan.device, job.run_dir, place, ddp, mesh=job.mesh,
                      plan=plan)
    trainer.stop = stop
    # This device's share of the step: a spatially sharded volume splits the FLOPs over its shards.
    trainer.step_flops = config_step_flops(cfg, job.data[1].n_classes) / plan.spatial_shards
    job.ddp, job.trainer = ddp, trainer

    def on_first_step():
        from scaffold.model.ladder import census, format_census

        c = census(model, loss_fn)
        c["plan"] = plan.record()
        log.info("kernel census after the first step:\n%s", format_census(c))
        if place.is_main:
            write_json(job.run_dir / CENSUS_FILE, c)

    trainer.on_first_step = on_first_step


def data_parallel(model: torch.nn.Module, plan: RunPlan) -> torch.nn.parallel.DistributedDataParallel:
    """The DDP wrapper. Each parameter's `.grad` is a view of its gradient bucket
    (gradient_as_bucket_view): the all-reduced bucket is the gradient, with no copy back and no second
    copy of the gradients kept (the same sums in the same order: the same bits). Where the step will be
    captured it is built on a side stream, as torch's notes on CUDA graphs ask of a DDP whose backward
    is captured (its reducer keeps the stream it was built on); the stream we return to waits for it."""
    device = plan.device
    if not (plan.cuda_graph and device.type == "cuda"):
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index],
                                                        gradient_as_bucket_view=True)
    torch.cuda.current_stream(device).wait_stream(side)
    return ddp


def run_record(job: Job) -> dict:
    """run.json of a new run: the resolved config and its hash, the overrides, versions, the device,
    the plan."""
    config = config_dict(job.cfg)
    return {
        "config": config,
        "config_sha256": rundir.config_hash(config),  # checked on resume: an edit is refused
        "overrides": job.overrides,
        "scaffold": scaffold.__version__,
        "torch": torch.__version__,
        "device": device_name(job.plan.device),
        "world_size": job.place.world,
        "spatial_shards": job.plan.spatial_shards,
        "dataset": str(job.data[0]),
        "parameters": job.n_params,
        "plan": job.plan.record(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _records(job: Job) -> None:
    """What a resume can find wrong (another model's checkpoint, a stale `best`, a lost or damaged CSV)
    is found and settled before the resume is recorded; then run.json (new run) or its resume history,
    the CSV and the tracker (rank 0 only), and the check that every rank starts from the same
    parameters."""
    cfg, place, state = job.cfg, job.place, job.state
    if state:
        job.trainer.load_state(state, source=str(job.ckpt_path))
        if place.is_main:
            note = checkpoint.repair_best(job.run_dir / CHECKPOINT_DIR, state, Path(job.ckpt_path))
            if note:
                log.warning("%s", note)
    job.tracker = NullTracker()
    job.original_overrides = list(job.overrides)
    if place.is_main:
        job.stats = StatsFile(job.run_dir / STATS_FILE, keep_through_epoch=state["epoch"] if state else 0,
                              known=state.get("rows") if state else None)
        if not job.resume:
            write_json(job.run_dir / RUN_FILE, run_record(job))
        else:  # recorded once the resume has passed every check, before it trains
            job.original_overrides, job.resumes = record_resume(
                job.run_dir, int(state["epoch"]) if state else 0, Path(job.ckpt_path).name if state else None,
                job.overrides, place.world)
        job.tracker = make_tracker(cfg, job.run_dir, resume_epoch=state["epoch"] if state else 0)
        job.stats.tracker = job.tracker
    job.state = None
    # Every rank starts from the same parameters (DDP also broadcasts rank 0's at construction).
    if place.world > 1:
        if job.plan.fsdp:  # each rank's shards are cut from its own whole tensors: compare those (its
            # initialization, or the checkpoint it read); gathered ones would agree whatever they were
            start = distributed.fingerprint(state["model"].values()) if state else job.fingerprint
        else:
            start = distributed.fingerprint(job.model.parameters())
        log.debug("rank %d: parameter fingerprint at start %s", place.rank, start)
        distributed.check_same(start, "the parameter fingerprint at start", place)


def _start(job: Job) -> None:
    """Warm-up on a copy of the model, then the graph capture where the plan says."""
    cfg, plan, trainer = job.cfg, job.plan, job.trainer
    log.info("model: UNet3d scale %d, %s parameters, on %s (%s, determinism=%s)", cfg.scale,
             f"{job.n_params:,}", plan.device, "bf16 autocast" if plan.amp_dtype else "fp32", cfg.determinism)
    buckets = trainer.settle_buckets()  # DDP's gradient buckets in one order on every launch
    warm = trainer.warmup(cfg.warmup_steps)
    if cfg.warmup_steps:
        log.info("warm-up: up to %d training and %d validation batches on %s, %.1f s", cfg.warmup_steps,
                 cfg.warmup_steps, "the model itself, no optimizer step (FSDP)" if plan.fsdp else
                 "a copy of the model", warm)
    captured = trainer.capture(required=plan.graph_required) if plan.cuda_graph else 0.0
    if trainer.train_step.graph is not None:
        log.info("step captured as a CUDA graph (forward, loss, backward, clip, Adam), %.1f s", captured)
    job.startup.update(warmup_s=warm, capture_s=captured, buckets_s=buckets)
    job.startup = {k: job.startup.get(k, 0.0) for k in ("dataset_s", "model_s", "warmup_s", "capture_s",
                                                         "buckets_s")}
    job.startup_s = time.perf_counter() - job.started
    log.info("start-up %.1f s: dataset %.1f, model %.1f, warm-up %.1f, capture %.1f, DDP buckets %.1f",
             job.startup_s, *job.startup.values())


def _fit(job: Job) -> Progress:
    """The epochs; the figures and the tracker's end whatever happens."""
    try:
        return job.trainer.fit(job.stats, profile=job.cfg.profile)
    finally:
        if job.place.is_main:
            try:
                job.tracker.log_figures(report.plot_run(job.run_dir, target_dice=job.cfg.target_dice))
            finally:
                job.tracker.close()


def _result(job: Job, progress: Progress) -> dict:
    """result.json, the final line, and the teardown of the process group."""
    result = result_of(job, progress)
    if job.place.is_main:
        write_json(job.run_dir / RESULT_FILE, result)
        if job.resume:  # a resumed sweep job: its sweep's summary.md would otherwise show the old results
            report.refresh_summary(job.run_dir)
    _final_line(job, progress, result)
    # DDP's reducer must go before its process group: destroyed afterwards (when these references are
    # dropped), it could wait forever on a group that no longer exists.
    job.trainer = job.ddp = job.model = None
    gc.collect()
    distributed.shutdown(job.place)
    return result


def result_of(job: Job, progress: Progress) -> dict:
    """The run's Result, as result.json's dict."""
    from scaffold.model.flops import bf16_peak_tflops

    cfg, trainer = job.cfg, job.trainer
    rates = sorted(r["step_tflops"] for r in trainer.rows if r["step_tflops"] == r["step_tflops"])
    step_tflops = rates[len(rates) // 2] if rates else None
    device = job.plan.device
    peak = bf16_peak_tflops(device_name(device)) if device.type == "cuda" else None
    reached = progress.time_to_target is not None
    result = asdict(Result(
        epochs=progress.epoch, optimizer_steps=progress.total_steps, best_epoch=progress.best_epoch,
        best_val_loss=progress.best_val_loss, final_val_dice=progress.last_val_dice,
        best_val_dice=progress.best_val_dice, target_dice=cfg.target_dice,
        time_to_target_s=progress.time_to_target, target_epoch=progress.target_epoch,
        epoch_time_to_target_s=progress.train_time if reached else None,
        upstream_fom=1.0 / progress.train_time if reached and progress.train_time > 0 else None,
        step_tflop=trainer.step_flops / 1e12, step_tflops=step_tflops, bf16_peak_tflops=peak,
        peak_fraction=step_tflops / peak if peak and step_tflops else None,
        startup_s=job.startup_s, startup=job.startup, wall_time_s=progress.wall_time,
        train_time_s=progress.train_time, checkpoint_wait_s=trainer.writer.waited_s,
        checkpoint_final_wait_s=trainer.final_wait_s, checkpoint_submit_s=trainer.submit_s,
        train_cpu_s=progress.cpu_time, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
        load_avg_start=job.load_at_start, load_avg_end=load_average(), dataset_s=job.startup["dataset_s"],
        warmup_s=job.startup["warmup_s"], cuda_graph=trainer.train_step.graph is not None,
        graph_capture_s=job.startup["capture_s"], overrides=job.original_overrides, resumes=job.resumes,
        plan=job.plan.record(), memory=memory_record(job)))
    return result


def memory_record(job: Job) -> Optional[dict]:
    """The memory model's prediction for a rank beside every rank's measured peak, or None off CUDA
    (where the plan predicts nothing). A collective on more than one rank: every rank calls it, at the
    end of the run."""
    from scaffold.model.memory import GiB

    if job.plan.predicted_bytes is None:
        return None
    peaks = distributed.gather_objects(torch.cuda.max_memory_allocated(job.plan.device) / GiB, job.place)
    predicted = job.plan.predicted_bytes / GiB
    return {"predicted_gib": round(predicted, 3), "peak_gib": [round(p, 3) for p in peaks],
            "peak_over_predicted": round(max(peaks) / predicted, 4)}


def _final_line(job: Job, progress: Progress, result: dict) -> None:
    cfg = job.cfg
    if progress.time_to_target is not None:
        watched = ("train dice" if getattr(cfg, "target_metric", "val_dice") == "train_dice"
                   else f"val dice {progress.last_val_dice:.4f}")
        log.info("time to target: %.2f s (%s >= %.2f at epoch %d, %d optimizer steps; wall clock "
                 "from the first step, checkpoints included; start-up %.1f s before it); upstream's figure "
                 "of merit: sum of epoch_duration %.2f s, 1/sum %.5f /s%s; results in %s",
                 progress.time_to_target, watched, cfg.target_dice, progress.target_epoch,
                 progress.total_steps, job.startup_s, progress.train_time, result["upstream_fom"] or math.nan,
                 _flop_note(result), job.run_dir)
    else:
        log.info("target val dice %.2f not reached in %d epochs (last %.4f, best val loss at epoch %d, "
                 "%d optimizer steps, %.1f s); results in %s", cfg.target_dice, progress.epoch,
                 progress.last_val_dice, progress.best_epoch, progress.total_steps, progress.train_time,
                 job.run_dir)
    memory = result.get("memory")
    if memory:
        log.info("device memory: peak %.2f GiB (the largest of %d rank(s)) against ~%.2f GiB predicted by the "
                 "memory model (%.2fx)", max(memory["peak_gib"]), len(memory["peak_gib"]),
                 memory["predicted_gib"], memory["peak_over_predicted"])


def _flop_note(result: dict) -> str:
    """The final line's FLOP rate: achieved TFLOP/s, and the share of the bf16 peak where known."""
    rate = result.get("step_tflops")
    if rate is None:
        return ""
    share = result.get("peak_fraction")
    if share is None:
        return f"; {rate:.1f} TFLOP/s"
    return f"; {rate:.1f} TFLOP/s ({100 * share:.0f}% of the {result['bf16_peak_tflops']:.0f} TFLOP/s bf16 peak)"
