"""The configuration schema: every knob, its default and what it means, and nothing else.

Hydra validates types and rejects unknown keys against these dataclasses; `check` adds the checks each
field can make on its own (a value among a field's choices, a number in its range), and
`validate_data` those of the keys that define a dataset. Checks that need the whole run (the model's
shape, the registered ladder rungs, the dataset's size, the memory model) are scaffold.plan's, which
also decides every `auto`. This module imports nothing of scaffold: everything may import it.

Defaults follow upstream ScaFFold's benchmark (its chaos game and class rule, classes judged at its
scale 7), except: `scale` (4, small enough that a plain `python -m scaffold.train` reaches the target Dice
on a 2-core CPU in a few minutes; upstream's and the GPU benchmark's is 7), `epochs` (a cap of 50;
upstream runs until the target), `checkpoint_interval` (every epoch, and `best`; upstream writes none),
`warmup_steps` (2; upstream 64), `data.ce_weight_sample_fraction` (all masks; upstream 10%) and the soft
Dice of an absent class (1; upstream's about 0). `benchmark=scaffold` sets upstream's values
(docs/scaffold-compat.md).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""


RETIRED_MORE_DETERMINISM = (
    "more_determinism is retired: runs are now deterministic by default, and determinism=strict "
    "raises on any nondeterministic op"
)
# Keys kept in the schema only so that setting one fails with a message saying what replaced it; they
# are left out of the --help pages.
RETIRED = {"more_determinism": RETIRED_MORE_DETERMINISM}


def choice(*options: str) -> Any:
    """A string field whose value is one of `options` (the first is the default). OmegaConf 2.3 cannot
    type a field as a `Literal`, so the set lives in the field's metadata: `check` enforces it and
    `--help` lists it."""
    return field(default=options[0], metadata={"choices": options})


def choices(cls: type, name: str) -> tuple[str, ...]:
    """The values a `choice` field of a schema dataclass accepts."""
    return next(f.metadata["choices"] for f in fields(cls) if f.name == name)


@dataclass
class DataConfig:
    n_categories: int = 5
    """Number of fractal classes drawn from the shipped library (labels are these plus background)."""
    n_instances: int = 145
    """Instances (affine variants) per class; rounded down to a multiple of `fractals_per_volume`."""
    fractals_per_volume: int = 3
    """Fractal instances overlaid in one volume; later ones overwrite earlier ones."""
    val_fraction: float = 0.3
    """Share of the volumes held out for validation."""
    variance_threshold: float = 0.15
    """A class is accepted when its normalized point cloud has more than this variance on every axis."""
    class_rule: str = choice("upstream", "rms")
    """How a class candidate's cloud is normalized before that test: upstream (upstream ScaFFold's rule:
    each axis mean-centred and min-max scaled to a range of 2; our contraction test kept as a guard) |
    rms (this project's earlier rule: centred and divided by the RMS radius, so the three variances sum
    to 1; datasets made with it stay reproducible)."""
    sampler: str = choice("upstream", "chains")
    """The chaos game that draws every point cloud: upstream (upstream ScaFFold's: one chain per cloud
    from the origin, no burn-in, edge³/256 points, runaway beyond 1e10; instances keep their class's map
    probabilities and attenuate a diverging variant) | chains (this project's earlier sampler: 1,024
    chains from uniform starts, 20 burn-in steps, 4,096 points judge a class; its datasets stay
    reproducible byte for byte)."""
    class_scale: int = 7
    """Upstream sampler: the scale whose point count ((2^class_scale)³/256, 8,192 at 7) judges a class,
    so one class library serves every scale. The shipped library is judged at 7."""
    ce_weight_sample_fraction: float = 1.0
    """Share of the training masks, evenly spaced, whose voxel counts set the cross-entropy class
    weights (1 = all of them; upstream ScaFFold samples 0.1). Does not change the dataset."""
    cache_dir: str = "auto"
    """Folder holding generated datasets (one HDF5 file per data-defining config). auto = one cache per
    user, shared by every working directory: $SCAFFOLD_CACHE if set, else $XDG_CACHE_HOME/scaffold, else
    ~/.cache/scaffold. Any other value is that folder (a relative one from the working directory)."""
    workers: int = 0
    """Processes generating the dataset; 0 = one per CPU core. The bytes do not depend on it."""


@dataclass
class ModelConfig:
    bottleneck: int = 3
    """log2 of the bottleneck edge: levels = scale - bottleneck (2³ voxels at the bottom by default)."""
    base_width: int = 64
    """Channels after the stem; doubles at every level."""
    groups: int = 8
    """GroupNorm groups; must divide every width."""
    recompute: str = choice("auto", "off", "blocks")
    """Activation recompute, trading compute for memory with the same bits: off (keep every activation
    for the backward) | blocks (keep only each block's inputs and recompute the rest in the backward:
    about two thirds of the peak, for 1.3x the step time at scale 8) | auto (blocks only where the
    memory model, scaffold/model/memory.py, says the run would not fit in the device's free memory;
    never on the CPU). A start-up line gives the prediction and the choice."""


@dataclass
class OptimConfig:
    weight_decay: float = 0.0
    """Adam weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    t0: int = 10
    """CosineAnnealingWarmRestarts T_0, in epochs."""
    t_mult: int = 2
    """CosineAnnealingWarmRestarts T_mult."""
    eta_min: float = 1e-4
    """CosineAnnealingWarmRestarts eta_min."""


@dataclass
class LadderConfig:
    conv: str = "auto"
    """Rung for Conv3d sites: auto | gluon | routed | triton | vendor (auto on CUDA = routed: each
    direction on Triton, on the Gluon kernel (sm_90) or on deterministic cuDNN per measured shape, see
    scaffold/model/routes.py; gluon: the Gluon kernel wherever it takes a 3×3×3 conv)."""
    conv_transpose: str = "auto"
    """Rung for ConvTranspose3d sites: auto | routed | triton | vendor."""
    group_norm: str = "auto"
    """Rung for GroupNorm(+ReLU) sites: auto | triton | vendor."""
    concat: str = "auto"
    """Rung for the U-Net's skip concat: auto | triton | vendor."""
    pool: str = "auto"
    """Rung for the 2×2×2 max pool: auto (Triton on CUDA) | triton | vendor (same bits on every rung)."""
    loss: str = "auto"
    """Rung for the CE + Dice loss head: auto (fused Triton kernel on CUDA) | triton | vendor (eager)."""


@dataclass
class ParallelConfig:
    timeout_s: float = 300.0
    """Seconds a collective (an all-reduce, a barrier) waits for the other ranks before the job fails
    with an error instead of hanging: bounds how long the survivors of a dead rank wait. Multi-process
    runs only (torchrun / Slurm)."""
    spatial_shards: int = 1
    """Split each volume's depth (D) over this many ranks (a power of two; world = data-parallel ranks
    × spatial_shards, consecutive ranks share a volume). Convolutions exchange one-voxel halos with
    their neighbours, GroupNorm, the loss and the metrics reduce over the shard group in rank order,
    and each rank reads only its slab of every volume. For volumes one device cannot hold."""
    fsdp: str = choice("auto", "on", "off")
    """Shard the parameters, their gradients and Adam's state over every rank (FSDP2, each U-Net block
    and the root a unit, all-gathered for its forward and backward, gradients reduce-scattered) instead
    of replicating them under DDP: auto (on where the memory model, scaffold/model/memory.py, says the
    replicated parameters, gradients and Adam state leave the run no room on the device at this world
    size; off in one process) | on (whenever there are several ranks) | off (DDP). Checkpoints hold the
    unsharded state either way: a run resumes at any world size, with FSDP on or off."""


@dataclass
class Config:
    scale: int = 4
    """log2 of the volume edge: 4 = 16³ (CPU quickstart), 7 = 128³ (GPU benchmark)."""
    seed: int = 42
    """Seeds the data, the model initialisation and the sampler."""
    epochs: int = 50
    """Epoch cap; -1 trains until `target_dice` is reached."""
    batch_size: int = 1
    """Volumes per optimizer step."""
    lr: float = 1e-3
    """Adam learning rate (the cosine schedule's peak)."""
    target_dice: float = 0.95
    """Stop once the validation Dice reaches this."""
    target_metric: str = choice("val_dice", "train_dice")
    """The Dice `target_dice` is checked against: val_dice (the benchmark's) | train_dice (the epoch's
    mean training Dice: `debug=overfit` stops on it)."""
    objective: str = choice("best_val_loss", "best_val_dice", "final_val_dice", "time_to_target")
    """What a run returns to a Hydra sweeper (Optuna's, see conf/hparams_search/), and in which direction
    it is optimized: best_val_loss (minimize) | best_val_dice (maximize) | final_val_dice (maximize) |
    time_to_target (seconds, minimize; +inf when the target is missed). The default is best_val_loss: it
    is defined for every trial that trains an epoch, it moves smoothly with the hyperparameters, it is
    bitwise reproducible, and it is what the `best` checkpoint is chosen by. Time to target is the
    benchmark's own number, but it is wall clock (noisy) and a flat +inf for every trial that misses the
    target, which tells a sampler nothing. A failed trial returns the worst value (+inf, or -inf)."""
    determinism: str = choice("default", "strict", "off")
    """default (bitwise reproducible) | strict (also torch.use_deterministic_algorithms, raising) |
    off (vendor autotuning allowed; bits may differ between runs)."""
    device: str = "auto"
    """auto (CUDA when present) | cpu | cuda | cuda:N."""
    precision: str = choice("auto", "bf16", "fp32")
    """auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32."""
    cuda_graph: str = choice("auto", "on", "off")
    """auto (on a CUDA device, in one process or under DDP with the all-reduce captured too, volumes not
    split over ranks: capture the whole step once as a CUDA graph and replay it: the same bits as eager,
    without the host's per-kernel launch cost) | on
    (the same, and an error where it cannot run) | off (eager steps)."""
    data_placement: str = choice("auto", "device", "host")
    """Where the dataset's masks live during training: auto (on the device when they take at most a
    tenth of its memory, else host) | device (indexed there: no copy per step) | host (pinned host
    memory; each step copies its volumes over asynchronously, without waiting for the device)."""
    checkpoint_interval: int = 1
    """Write the `last` checkpoint every this many epochs (0 = never; `best` is always kept; -1 = no
    checkpoint at all, not even `best` or the final epoch's, as upstream ScaFFold's -1: such a run
    cannot be resumed)."""
    warmup_steps: int = 2
    """Untimed steps before the first epoch (compilation, allocation), on distinct training batches,
    then up to as many validation batches, on a copy of the model: the run's state is untouched."""
    resume: Optional[str] = None
    """A run directory to continue bit for bit from its last checkpoint; auto (with a fixed
    hydra.run.dir): continue the run in that directory if it holds one, else start it there (a
    requeued Slurm job continues instead of being refused)."""
    profile: bool = False
    """Write a torch profiler trace of a few steps of the first epoch to the run directory."""
    progress: bool = True
    """Show a progress bar per epoch, and while the dataset is generated (plain lines when not on a
    terminal)."""
    logger: str = "none"
    """Experiment tracker fed the CSV's epoch rows and the figures: none | tensorboard (event files in
    <run_dir>/tensorboard/; needs `pip install 'scaffold-unet[tensorboard]'`). See scaffold/tracking.py,
    which also says how an MLflow or W&B tracker would plug in."""
    more_determinism: Optional[Any] = None
    """Retired. Setting it is an error that says what replaced it (`determinism`)."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# objective -> the direction a sweeper optimizes it in (conf/hparams_search/ reads it through the
# `scaffold.direction` resolver, so choosing an objective cannot leave the sweeper going the wrong way).
OBJECTIVES = {"best_val_loss": "minimize", "best_val_dice": "maximize", "final_val_dice": "maximize",
              "time_to_target": "minimize"}


def expect(ok: bool, key: str, expected: str, value: Any) -> None:
    """ConfigError `key=value: expected ...` unless `ok`: the one-line form of every config error."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


_need = expect


def _finite(value: Any) -> bool:
    """A real number that is neither infinite nor NaN (the comparisons below are False for NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# A learning rate above this is a typo (Adam's steps are ~lr per parameter): it diverges in one step.
MAX_LR = 10.0


def validate_data(data: Any, scale: int) -> None:
    """Checks of what defines a dataset (shared by the trainer and `python -m scaffold.data`)."""
    _need(isinstance(scale, int) and scale > 0, "scale", "a positive integer", scale)
    # Whether a scale trains on its devices is the memory model's call (`validate`); here only that one
    # volume of masks, which a data worker renders whole, fits in this host's memory.
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    _need(8**scale <= ram, "scale", f"a volume that fits in this host's {ram / 2**30:.0f} GiB of memory "
          f"(one volume of masks is {8**scale / 2**30:.0f} GiB)", scale)
    _need(data.n_categories > 0, "data.n_categories", "a positive integer", data.n_categories)
    _need(data.n_categories <= 255, "data.n_categories", "at most 255 (masks are uint8: 255 classes and the "
          "background)", data.n_categories)
    _need(data.fractals_per_volume > 0, "data.fractals_per_volume", "a positive integer",
          data.fractals_per_volume)
    _need(data.n_instances >= data.fractals_per_volume, "data.n_instances",
          f"at least data.fractals_per_volume ({data.fractals_per_volume})", data.n_instances)
    _need(data.n_instances <= 145, "data.n_instances", "at most 145 (12 positions x 12 factors + 1)",
          data.n_instances)
    _need(0.0 < data.val_fraction < 1.0, "data.val_fraction", "a number in (0, 1)", data.val_fraction)
    rule = getattr(data, "class_rule", "upstream")
    _need(rule in ("upstream", "rms"), "data.class_rule", "upstream | rms", rule)
    # upstream: each scaled axis spans 2, so its variance is at most 1; rms: the three normalized
    # variances sum to 1, so no class can pass 1/3 on every axis.
    top, shown = (1.0, "1") if rule == "upstream" else (1 / 3, "1/3")
    _need(0 < data.variance_threshold < top, "data.variance_threshold",
          f"a number in (0, {shown}) under data.class_rule={rule}", data.variance_threshold)
    sampler = getattr(data, "sampler", "upstream")
    samplers = choices(DataConfig, "sampler")
    _need(sampler in samplers, "data.sampler", " | ".join(samplers), sampler)
    class_scale = getattr(data, "class_scale", 7)
    _need(isinstance(class_scale, int) and 4 <= class_scale <= 9, "data.class_scale", "an integer in [4, 9]",
          class_scale)
    fraction = getattr(data, "ce_weight_sample_fraction", 1.0)
    _need(_finite(fraction) and 0 < fraction <= 1, "data.ce_weight_sample_fraction", "a number in (0, 1]",
          fraction)
    _need(data.workers >= 0, "data.workers", "an integer >= 0 (0 = one per core)", data.workers)


def check(cfg: Any) -> None:
    """The checks each key of a training config can make on its own; ConfigError, one line naming the
    key. scaffold.plan.validate runs these first, then those of the whole run."""
    for key, why in RETIRED.items():
        if getattr(cfg, key, None) is not None:
            raise ConfigError(why)
    for name, cls in (("", Config), ("data.", DataConfig), ("model.", ModelConfig),
                      ("parallel.", ParallelConfig)):
        node = cfg if not name else getattr(cfg, name[:-1])
        for f in fields(cls):
            value = getattr(node, f.name, None)
            if "choices" in f.metadata and value is not None:
                _need(value in f.metadata["choices"], name + f.name, " | ".join(f.metadata["choices"]), value)
    _need(cfg.epochs == -1 or cfg.epochs > 0, "epochs", "a positive integer or -1 (until converged)",
          cfg.epochs)
    _need(cfg.batch_size > 0, "batch_size", "a positive integer", cfg.batch_size)
    _need(_finite(cfg.lr) and 0 < cfg.lr <= MAX_LR, "lr", f"a number in (0, {MAX_LR:g}]", cfg.lr)
    _need(0 < cfg.target_dice <= 1, "target_dice", "a number in (0, 1]", cfg.target_dice)
    dev = str(cfg.device)
    _need(dev in ("auto", "cpu", "cuda") or dev.startswith("cuda:"), "device",
          "auto | cpu | cuda | cuda:N", cfg.device)
    _need(cfg.checkpoint_interval >= -1, "checkpoint_interval", "an integer >= -1 (-1 = no checkpoint at all)",
          cfg.checkpoint_interval)
    _need(cfg.warmup_steps >= 0, "warmup_steps", "an integer >= 0", cfg.warmup_steps)
    _need(_finite(cfg.parallel.timeout_s) and cfg.parallel.timeout_s > 0, "parallel.timeout_s",
          "a finite number of seconds > 0", cfg.parallel.timeout_s)
    shards = cfg.parallel.spatial_shards
    _need(isinstance(shards, int) and shards >= 1 and shards & (shards - 1) == 0, "parallel.spatial_shards",
          "a power of two >= 1", shards)
    _need(shards <= 2 ** cfg.scale, "parallel.spatial_shards",
          f"at most {2 ** cfg.scale} (one plane of the {2 ** cfg.scale}-plane volume per rank)", shards)
    o = cfg.optim
    # Adam raises on a negative weight decay only at its first step, after the dataset is built.
    _need(_finite(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay", "a finite number >= 0",
          o.weight_decay)
    _need(_finite(o.grad_clip) and o.grad_clip >= 0, "optim.grad_clip", "a finite number >= 0 (0 disables)",
          o.grad_clip)
    _need(o.t0 > 0, "optim.t0", "a positive integer", o.t0)
    _need(o.t_mult >= 1, "optim.t_mult", "an integer >= 1", o.t_mult)
    _need(_finite(o.eta_min) and 0 <= o.eta_min <= cfg.lr, "optim.eta_min",
          f"a number in [0, lr] (lr={cfg.lr!r})", o.eta_min)
