"""The configuration schema: every knob, its default and what it means.

Hydra validates types and rejects unknown keys against these dataclasses; `validate` adds the semantic
checks (one line naming the key) that must pass before any expensive work starts. The trainer and the
data generator take these objects (or any object with the same attributes); only `scaffold.train` and
`scaffold.data.__main__` know about Hydra.

Defaults follow upstream ScaFFold's benchmark, except `scale`: its default is small enough that a plain
`python -m scaffold.train` reaches the target Dice on a 2-core CPU in a few minutes. The GPU benchmark is
`scale=7` (128³ volumes).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
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
    class_rule: str = "upstream"
    """How a class candidate's cloud is normalized before that test: upstream (upstream ScaFFold's rule:
    each axis mean-centred and min-max scaled to a range of 2; our contraction test kept as a guard) |
    rms (this project's earlier rule: centred and divided by the RMS radius, so the three variances sum
    to 1; datasets made with it stay reproducible)."""
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
    recompute: str = "auto"
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
    """Rung for Conv3d sites: auto | routed | triton | vendor (auto on CUDA = routed: each direction
    on Triton or deterministic cuDNN per measured shape, see scaffold/model/routes.py)."""
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
    objective: str = "best_val_loss"
    """What a run returns to a Hydra sweeper (Optuna's, see conf/hparams_search/), and in which direction
    it is optimized: best_val_loss (minimize) | best_val_dice (maximize) | final_val_dice (maximize) |
    time_to_target (seconds, minimize; +inf when the target is missed). The default is best_val_loss: it
    is defined for every trial that trains an epoch, it moves smoothly with the hyperparameters, it is
    bitwise reproducible, and it is what the `best` checkpoint is chosen by. Time to target is the
    benchmark's own number, but it is wall clock (noisy) and a flat +inf for every trial that misses the
    target, which tells a sampler nothing. A failed trial returns the worst value (+inf, or -inf)."""
    determinism: str = "default"
    """default (bitwise reproducible) | strict (also torch.use_deterministic_algorithms, raising) |
    off (vendor autotuning allowed; bits may differ between runs)."""
    device: str = "auto"
    """auto (CUDA when present) | cpu | cuda | cuda:N."""
    precision: str = "auto"
    """auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32."""
    cuda_graph: str = "auto"
    """auto (on one CUDA device in one process, capture the step's forward, loss and backward once as a
    CUDA graph and replay it: the same bits as eager, without the host's per-kernel launch cost) | on
    (the same, and an error where it cannot run) | off (eager steps)."""
    data_placement: str = "auto"
    """Where the dataset's masks live during training: auto (on the device when they take at most a
    tenth of its memory, else host) | device (indexed there: no copy per step) | host (pinned host
    memory; each step copies its volumes over asynchronously, without waiting for the device)."""
    checkpoint_interval: int = 1
    """Write the `last` checkpoint every this many epochs (0 = never; `best` is always kept)."""
    warmup_steps: int = 2
    """Untimed steps before the first epoch (compilation, allocation); rolled back afterwards."""
    resume: Optional[str] = None
    """A run directory to continue bit for bit from its last checkpoint."""
    profile: bool = False
    """Write a torch profiler trace of a few steps of the first epoch to the run directory."""
    progress: bool = True
    """Show a progress bar per epoch (plain lines when not on a terminal)."""
    logger: str = "none"
    """Experiment tracker fed the CSV's epoch rows and the figures: none | tensorboard (event files in
    <run_dir>/tensorboard/; needs `pip install 'scaffold[tensorboard]'`). See scaffold/tracking.py,
    which also says how an MLflow or W&B tracker would plug in."""
    more_determinism: Optional[Any] = None
    """Retired. Setting it is an error that says what replaced it (`determinism`)."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


DETERMINISM_MODES = ("default", "strict", "off")
PRECISIONS = ("auto", "bf16", "fp32")
CUDA_GRAPH_MODES = ("auto", "on", "off")
RECOMPUTE_MODES = ("auto", "off", "blocks")
DATA_PLACEMENTS = ("auto", "device", "host")
# objective -> the direction a sweeper optimizes it in (conf/hparams_search/ reads it through the
# `scaffold.direction` resolver, so choosing an objective cannot leave the sweeper going the wrong way).
OBJECTIVES = {"best_val_loss": "minimize", "best_val_dice": "maximize", "final_val_dice": "maximize",
              "time_to_target": "minimize"}


def _need(ok: bool, key: str, expected: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


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
    fraction = getattr(data, "ce_weight_sample_fraction", 1.0)
    _need(_finite(fraction) and 0 < fraction <= 1, "data.ce_weight_sample_fraction", "a number in (0, 1]",
          fraction)
    _need(data.workers >= 0, "data.workers", "an integer >= 0 (0 = one per core)", data.workers)


def check_model(scale: int, bottleneck: int, base_width: int, groups: int) -> list[int]:
    """The U-Net's channel widths from the stem down to the bottleneck; ConfigError naming the key
    when the shape keys cannot build one (used by `validate` and by UNet3d itself)."""
    _need(isinstance(bottleneck, int) and bottleneck >= 0, "model.bottleneck", "an integer >= 0",
          bottleneck)
    _need(isinstance(scale, int) and scale > bottleneck, "scale",
          f"greater than model.bottleneck ({bottleneck})", scale)
    _need(isinstance(base_width, int) and base_width > 0, "model.base_width", "a positive integer",
          base_width)
    _need(isinstance(groups, int) and groups > 0, "model.groups", "a positive integer", groups)
    widths = [base_width * 2**i for i in range(scale - bottleneck + 1)]
    _need(all(w % groups == 0 for w in widths), "model.groups", f"a divisor of every width {widths}",
          groups)
    return widths


def dataset_sizes(data: Any) -> tuple[int, int]:
    """(n_train, n_val) that a data config will produce, without generating anything."""
    from scaffold.data.volumes import split_sizes

    n_volumes = data.n_categories * (data.n_instances // data.fractals_per_volume)
    return split_sizes(n_volumes, float(data.val_fraction))


def validate(cfg: Any) -> None:
    """Semantic checks of a whole training config; raises ConfigError with one line naming the key."""
    for key, why in RETIRED.items():
        if getattr(cfg, key, None) is not None:
            raise ConfigError(why)
    validate_data(cfg.data, cfg.scale)
    m = cfg.model
    check_model(cfg.scale, m.bottleneck, m.base_width, m.groups)
    _need(getattr(m, "recompute", "auto") in RECOMPUTE_MODES, "model.recompute", " | ".join(RECOMPUTE_MODES),
          getattr(m, "recompute", "auto"))
    _need(cfg.epochs == -1 or cfg.epochs > 0, "epochs", "a positive integer or -1 (until converged)",
          cfg.epochs)
    _need(cfg.batch_size > 0, "batch_size", "a positive integer", cfg.batch_size)
    _need(cfg.data_placement in DATA_PLACEMENTS, "data_placement", " | ".join(DATA_PLACEMENTS), cfg.data_placement)
    _need(_finite(cfg.lr) and 0 < cfg.lr <= MAX_LR, "lr", f"a number in (0, {MAX_LR:g}]", cfg.lr)
    _need(0 < cfg.target_dice <= 1, "target_dice", "a number in (0, 1]", cfg.target_dice)
    _need(cfg.determinism in DETERMINISM_MODES, "determinism", " | ".join(DETERMINISM_MODES),
          cfg.determinism)
    _need(cfg.precision in PRECISIONS, "precision", " | ".join(PRECISIONS), cfg.precision)
    dev = str(cfg.device)
    _need(dev in ("auto", "cpu", "cuda") or dev.startswith("cuda:"), "device",
          "auto | cpu | cuda | cuda:N", cfg.device)
    _need(cfg.cuda_graph in CUDA_GRAPH_MODES, "cuda_graph", " | ".join(CUDA_GRAPH_MODES), cfg.cuda_graph)
    _need(cfg.objective in OBJECTIVES, "objective", " | ".join(OBJECTIVES), cfg.objective)
    if dev == "cpu":  # known before any work: the step's own rule says whether a graph can run
        import torch

        from scaffold.step import wants_graph

        wants_graph(cfg.cuda_graph, torch.device("cpu"), 1)
    _need(cfg.checkpoint_interval >= 0, "checkpoint_interval", "an integer >= 0",
          cfg.checkpoint_interval)
    _need(cfg.warmup_steps >= 0, "warmup_steps", "an integer >= 0", cfg.warmup_steps)
    from scaffold.model.policy import OPS, settings  # the allowed rungs are the registered ones

    for key in OPS:
        value = getattr(cfg.ladder, key)
        _need(value in settings(key), f"ladder.{key}", " | ".join(settings(key)), value)
    n_train = dataset_sizes(cfg.data)[0]
    _need(cfg.batch_size <= n_train, "batch_size", f"at most the {n_train} training volumes", cfg.batch_size)
    from scaffold.tracking import LOGGERS, check_available  # the allowed loggers are the registered ones

    logger = getattr(cfg, "logger", "none")
    _need(logger in LOGGERS, "logger", " | ".join(LOGGERS), logger)
    check_available(logger)  # a missing package fails here, before any work
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
    # Last: the memory model reads the checked shape, precision, batch, placement and shard keys. A scale
    # that cannot fit on its device even with recompute fails here, before any data or model exists.
    from scaffold.model.memory import check_scale

    check_scale(cfg)


def register() -> None:
    """Registers the schema with Hydra's ConfigStore (as `base_config`, used by conf/config.yaml), the
    `--help` page generated from it (as hydra/help `scaffold`, see scaffold/help.py), and the
    `scaffold.direction` resolver: `${scaffold.direction:${objective}}` is minimize or maximize."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from scaffold import cli, help as help_page

    ConfigStore.instance().store(name="base_config", node=Config)
    # `python -m scaffold.train --help` (conf/config.yaml selects hydra/help: scaffold).
    header, body = help_page.train_page(cli.config_groups())
    ConfigStore.instance().store(group="hydra/help", name="scaffold",
                                 node=help_page.hydra_help_node("scaffold.train", header, body))
    # An unknown objective resolves to minimize; `validate` names it before any trial runs.
    OmegaConf.register_new_resolver("scaffold.direction", lambda name: OBJECTIVES.get(name, "minimize"),
                                    replace=True)
