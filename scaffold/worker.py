"""One process's whole job: determinism, place in the job, data, model, loop, results, teardown.

`run(cfg, run_dir)` takes a plain config object (scaffold.config.Config or an OmegaConf node of it) and a
run directory; it knows nothing of Hydra. Every check that can fail on bad input runs before the dataset
is generated or the model is built.
"""
from __future__ import annotations

import datetime as _dt
import gc
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

import scaffold
from scaffold import checkpoint, determinism, distributed, report, rundir, spatial
from scaffold.config import ConfigError, dataset_sizes, validate
from scaffold.files import write_json
from scaffold.stats import StatsFile, load_average
from scaffold.step import wants_graph
from scaffold.tracking import NullTracker, make_tracker
from scaffold.trainer import StopRequest, Trainer, Volumes

log = logging.getLogger("scaffold")

RUN_FILE = "run.json"  # marks a scaffold run directory; holds the resolved config for resume
RESULT_FILE = "result.json"
CENSUS_FILE = "census.json"
STATS_FILE = "train_stats.csv"


def pick_device(name: str, place: distributed.Place) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name!r}: no CUDA device is available here (use device=cpu)")
        if name == "cuda":
            return torch.device("cuda", place.local_rank)
    return torch.device(name)


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


def place_masks(setting: str, train: torch.Tensor, val: torch.Tensor, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks where `data_placement` puts them: the device, or pinned host memory (CUDA only)."""
    host = False
    if device.type == "cuda" and setting != "device":
        total = torch.cuda.get_device_properties(device).total_memory
        host = setting == "host" or (train.numel() + val.numel()) > total // 10
    if host:
        log.info("dataset masks in pinned host memory (%.1f GiB; data_placement=%s): each step copies its "
                 "volumes to the device asynchronously", (train.numel() + val.numel()) / 2**30, setting)
        return train.pin_memory(), val.pin_memory()
    return train.to(device), val.to(device)


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


def record_resume(run_dir: Path, at_epoch: int, checkpoint_name: str, overrides: list[str]
                  ) -> tuple[list[str], list[dict]]:
    """Append this resume to run.json's history; returns the run's original overrides and its resumes.

    The original overrides stay what identifies the run (a sweep's summary lists a job by them); each
    resume's own (epochs=..., device=...) go into the history. It lives in run.json, written before any
    training, so a resume that is killed before its result.json still counts in the next one's."""
    run_file = run_dir / RUN_FILE
    record = json.loads(run_file.read_text())
    record["resumes"] = list(record.get("resumes", [])) + [{
        "at_epoch": at_epoch,
        "checkpoint": checkpoint_name,
        "overrides": list(overrides),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }]
    write_json(run_file, record)
    return list(record.get("overrides", [])), record["resumes"]


def config_dict(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def claim(run_dir: Path, resume: bool) -> rundir.RunLock:
    """This process's exclusive hold on the run directory (rank 0 only): a second live process on the
    run, or a new run in a directory that already holds one, is refused in one line."""
    try:
        lock = rundir.RunLock(run_dir)
    except rundir.RunDirBusy as e:
        raise ConfigError(str(e)) from None
    if not resume and (run_dir / RUN_FILE).exists():
        lock.release()
        raise ConfigError(f"run directory {run_dir} already holds a run (resume={run_dir} continues it; "
                          "a new run needs another directory)")
    return lock


def run(cfg: Any, run_dir: Path, resume: bool = False, overrides: Optional[list[str]] = None) -> dict:
    """Train one model; returns the result summary (also written to run_dir/result.json).

    SIGTERM and SIGINT stop training at a step boundary with the position checkpointed (scaffold.trainer.
    StopRequest), raising scaffold.trainer.Interrupted; the handlers and the run directory's lock are
    given back when this returns or raises."""
    import signal

    stop, held = StopRequest(), []
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop.install()
    try:
        return _run(cfg, Path(run_dir), resume, overrides, stop, held)
    finally:
        for lock in held:
            lock.release()
        if stop.installed:
            for s, handler in saved.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _run(cfg: Any, run_dir: Path, resume: bool, overrides: Optional[list[str]], stop: StopRequest,
         held: list) -> dict:
    started = time.perf_counter()
    validate(cfg)
    load_at_start = load_average()  # with the end's, tells a run slowed by other work on the machine
    determinism.configure(cfg.determinism)  # before anything touches CUDA
    place = distributed.init("cuda" if str(cfg.device) != "cpu" and torch.cuda.is_available() else "cpu",
                             cfg.parallel.timeout_s)
    device = pick_device(str(cfg.device), place)
    use_graph = wants_graph(cfg.cuda_graph, device, place.world, place.joined)
    # Only rank 0 touches the run directory; the others learn its path and whether it works.
    run_dir = Path(distributed.broadcast_object(str(run_dir), place))
    distributed.agree(_attempt(check_writable, run_dir)[1] if place.is_main else None, place)
    if place.is_main:
        lock, error = _attempt(claim, run_dir, resume)
        held += [lock] if lock else []
    distributed.agree(error if place.is_main else None, place)

    shards = int(cfg.parallel.spatial_shards)
    if shards > 1 and not place.joined:
        raise ConfigError(f"parallel.spatial_shards={shards}: one process cannot split a volume; launch "
                          f"{shards} ranks per volume (torchrun --nproc-per-node={shards} -m scaffold.train ...)")
    mesh = spatial.make_mesh(place.rank, place.world, shards, device.type, cfg.parallel.timeout_s)
    sg = mesh.shards
    n_train, _ = dataset_sizes(cfg.data)
    if mesh.data_world > n_train:
        raise ConfigError(f"world size {place.world}: more data-parallel ranks ({mesh.data_world}) than the "
                          f"{n_train} training volumes")
    state = None
    original_overrides, resumes = list(overrides or []), []
    if resume:
        try:
            state, ckpt_path = checkpoint.load_latest(run_dir / "checkpoints")
            log.info("resuming from %s (epoch %d)", ckpt_path, state["epoch"])
        except checkpoint.NoCheckpoint as e:
            # Stopped before its first checkpoint reached the disk (written in the background): every
            # random stream is seeded, so starting over gives the bits of a run that never stopped.
            log.warning("%s: the run starts over from epoch 1", e)

    # ---- data: one rank per node generates (or reuses, verified; or repairs) the dataset, the others
    # then read it, verified too
    from scaffold.data import store

    t0 = time.perf_counter()
    leader = place.local_rank == 0
    slab = (sg.index, sg.count) if sg is not None else None  # a sharded rank reads only its planes
    data, error = _attempt(store.load, cfg.data, cfg.scale, cfg.seed, progress=cfg.progress and place.is_main,
                           slab=slab) if leader else (None, None)
    distributed.agree(error, place)
    if not leader:
        data = store.load(cfg.data, cfg.scale, cfg.seed, progress=False, repair=False, slab=slab)
    path, info, train_masks, val_masks = data
    del data
    data_seconds = time.perf_counter() - t0
    log.info("dataset %s: %d train + %d validation volumes of %d³, %d classes (%.1f s)", path,
             info.n_train, info.n_val, info.edge, info.n_classes, data_seconds)

    # Triton's compiled kernels beside the datasets: one folder to keep (or mount into a container)
    # makes a later run on the machine start warm. A TRITON_CACHE_DIR of the user's wins.
    os.environ.setdefault("TRITON_CACHE_DIR", str(store.cache_dir(cfg.data.cache_dir) / "triton"))

    # ---- model, loss, volumes on the device
    t_model = time.perf_counter()
    from scaffold.loss import SegmentationLoss, check_labels, class_weights, sampled_counts
    from scaffold.model.ladder import census, format_census
    from scaffold.model.unet import UNet3d

    determinism.seed_all(cfg.seed)
    model = UNet3d.from_config(cfg, info.n_classes)  # initialised on the CPU: same start on any device
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last_3d)
    spatial.shard_model(model, sg)
    fraction = float(cfg.data.ce_weight_sample_fraction)
    counts = info.class_counts if fraction >= 1 else sampled_counts(train_masks, fraction, info.n_classes)
    if fraction < 1 and sg is not None:  # each rank counted its slab: the volumes' counts are the sum
        counts = spatial.all_sum(torch.from_numpy(counts).to(device), sg).cpu().numpy()
    loss_fn = SegmentationLoss(class_weights(counts), rung=cfg.ladder.loss).to(device)
    train, val = torch.from_numpy(train_masks), torch.from_numpy(val_masks)
    check_labels(train, info.n_classes)  # once per dataset, never inside the step
    check_labels(val, info.n_classes)
    volumes = Volumes(*place_masks(cfg.data_placement, train, val, device),
                      torch.from_numpy(info.palette).to(device))
    ddp = None
    if place.joined:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    step_loss = spatial.ShardedLoss(loss_fn, sg) if sg is not None else loss_fn
    trainer = Trainer(cfg, model, step_loss, volumes, device, run_dir, place, ddp, mesh=mesh)
    trainer.stop = stop
    n_params = sum(p.numel() for p in model.parameters())

    def on_first_step():
        c = census(model, loss_fn)
        log.info("kernel census after the first step:\n%s", format_census(c))
        if place.is_main:
            write_json(run_dir / CENSUS_FILE, c)

    trainer.on_first_step = on_first_step

    # What a resume can find wrong (another model's checkpoint, a stale `best`, a lost or damaged CSV)
    # is found and settled before the resume is recorded.
    stats = None  # only rank 0 writes the CSV and feeds the tracker
    if state:
        trainer.load_state(state, source=str(ckpt_path))
        if place.is_main:
            note = checkpoint.repair_best(run_dir / "checkpoints", state, Path(ckpt_path))
            if note:
                log.warning("%s", note)
    if place.is_main:
        stats = StatsFile(run_dir / STATS_FILE, keep_through_epoch=state["epoch"] if state else 0,
                          known=state.get("rows") if state else None)
    if place.is_main and not resume:
        write_json(run_dir / RUN_FILE, {
            "config": config_dict(cfg),
            "overrides": overrides or [],
            "scaffold": scaffold.__version__,
            "torch": torch.__version__,
            "device": device_name(device),
            "world_size": place.world,
            "spatial_shards": shards,
            "dataset": str(path),
            "parameters": n_params,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        })
    elif place.is_main:  # recorded once the resume has passed every check, before it trains
        original_overrides, resumes = record_resume(run_dir, int(state["epoch"]) if state else 0,
                                                    Path(ckpt_path).name if state else None, overrides or [])
    tracker = NullTracker()
    if place.is_main:
        tracker = make_tracker(cfg, run_dir, resume_epoch=state["epoch"] if state else 0)
        stats.tracker = tracker
    del state
    # Every rank starts from the same parameters (DDP also broadcasts rank 0's at construction).
    start = distributed.fingerprint(model.parameters()) if place.world > 1 else None
    if start is not None:
        log.debug("rank %d: parameter fingerprint at start %s", place.rank, start)
        distributed.check_same(start, "the parameter fingerprint at start", place)

    model_seconds = time.perf_counter() - t_model
    log.info("model: UNet3d scale %d, %s parameters, on %s (%s, determinism=%s)", cfg.scale,
             f"{n_params:,}", device, "bf16 autocast" if trainer.amp_dtype else "fp32", cfg.determinism)
    if use_graph and cfg.cuda_graph == "auto":
        from scaffold.model.memory import graph_plan

        use_graph, line = graph_plan(cfg, device, info.n_classes, getattr(model, "recompute", "off"))
        if not use_graph:
            log.info("%s", line)
    warm = trainer.warmup(cfg.warmup_steps)
    if cfg.warmup_steps:
        log.info("warm-up: %d untimed steps on a copy of the model, %.1f s", cfg.warmup_steps, warm)
    captured = trainer.capture(required=cfg.cuda_graph == "on") if use_graph else 0.0
    if trainer.train_step.graph is not None:
        log.info("step captured as a CUDA graph (forward, loss, backward, clip, Adam), %.1f s", captured)
    startup = {"dataset_s": data_seconds, "model_s": model_seconds, "warmup_s": warm, "capture_s": captured}
    startup_s = time.perf_counter() - started
    log.info("start-up %.1f s: dataset %.1f, model %.1f, warm-up %.1f, capture %.1f", startup_s,
             data_seconds, model_seconds, warm, captured)

    try:
        progress = trainer.fit(stats, profile=cfg.profile)
    finally:
        if place.is_main:
            try:
                tracker.log_figures(report.plot_run(run_dir, target_dice=cfg.target_dice))
            finally:
                tracker.close()
    result = {
        "epochs": progress.epoch,
        "optimizer_steps": progress.total_steps,
        "best_epoch": progress.best_epoch,  # lowest val_loss_avg: the CSV's last row with is_best = 1
        "best_val_loss": progress.best_val_loss,
        "final_val_dice": progress.last_val_dice,
        "best_val_dice": progress.best_val_dice,
        "target_dice": cfg.target_dice,
        # Wall clock from the first training step to the end of the epoch that reached the target,
        # everything included (evaluation, checkpoints, logging); start-up is beside it.
        "time_to_target_s": progress.time_to_target,
        "target_epoch": progress.target_epoch,
        "startup_s": startup_s,
        "startup": startup,
        "wall_time_s": progress.wall_time,
        "train_time_s": progress.train_time,  # summed epoch_duration: training + evaluation only
        "checkpoint_wait_s": trainer.writer.waited_s,  # host time spent waiting for background writes
        "checkpoint_final_wait_s": trainer.final_wait_s,  # of which at the target epoch, for the last writes
        # host time the epochs spent handing checkpoints over (state, snapshot enqueue, waits): with the
        # final wait, what checkpoints cost the wall clock up to the target (like the two waits above,
        # counted by this process: a resumed run's figure covers the epochs since the resume)
        "checkpoint_submit_s": trainer.submit_s,
        # CPU time and machine load beside the wall times: a slow run starved of cores (CPU well
        # below threads x wall, high load) reads differently from one that is slow on its own.
        "train_cpu_s": progress.cpu_time,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_start": load_at_start,
        "load_avg_end": load_average(),
        "dataset_s": data_seconds,
        "warmup_s": warm,
        "cuda_graph": trainer.train_step.graph is not None,
        "graph_capture_s": captured,
        "overrides": original_overrides,  # those the run was started with; a resume's are in `resumes`
        "resumes": resumes,
    }
    if place.is_main:
        write_json(run_dir / RESULT_FILE, result)
        if resume:  # a resumed sweep job: its sweep's summary.md would otherwise show the old results
            report.refresh_summary(run_dir)
    if progress.time_to_target is not None:
        log.info("time to target: %.2f s (val dice %.4f >= %.2f at epoch %d, %d optimizer steps; wall clock "
                 "from the first step, checkpoints included; start-up %.1f s before it); results in %s",
                 progress.time_to_target, progress.last_val_dice, cfg.target_dice, progress.target_epoch,
                 progress.total_steps, startup_s, run_dir)
    else:
        log.info("target val dice %.2f not reached in %d epochs (last %.4f, best val loss at epoch %d, "
                 "%d optimizer steps, %.1f s); results in %s", cfg.target_dice, progress.epoch,
                 progress.last_val_dice, progress.best_epoch, progress.total_steps, progress.train_time,
                 run_dir)
    # DDP's reducer must go before its process group: destroyed afterwards (when this frame's locals
    # are freed), it could wait forever on a group that no longer exists.
    del trainer, ddp
    gc.collect()
    distributed.shutdown(place)
    return result
