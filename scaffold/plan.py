"""How this run runs, decided once: `resolve(cfg, place) -> RunPlan`.

Every `auto` of the config, and every choice the code makes on its own (the device, the autocast dtype,
whether the step is a CUDA graph, activation recompute, where the masks live, bf16 working copies of the
conv weights, the skip rooms, the fused GroupNorm + head, the optimizer's implementation, the shard
count), is made here, once per process, each with a one-line reason; `RunPlan.lines()` is the start-up
log. The model, the trainer, the step and the data code take the plan's values instead of deciding.
`validate(cfg)` is the whole-config check that runs before any work (the schema's own field checks,
then those that need the model's shape, the registered ladder rungs, the dataset's size and the memory
model), and `check_scale` the memory model's verdict on whether a scale fits its device.

The memory figures come from the byte model in scaffold/model/memory.py (a `StepShape` is the step's
shape; `step_shape` builds it from a config as this plan resolves it). This module sits above the
model, data and step code and below the trainer and the worker: it may import the former, never the
latter.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from scaffold import config as schema
from scaffold.config import ConfigError, expect
from scaffold.distributed import Place, cuda_index
from scaffold.model.memory import GiB, HEADROOM, TOLERANCE, DeviceMemory, Estimate, StepShape, device_memory, \
    estimate
from scaffold.step import amp_dtype, optimizer_kind, wants_graph

log = logging.getLogger("scaffold")


# --- the whole-config check ---------------------------------------------------------------------

def validate(cfg: Any) -> None:
    """Semantic checks of a whole training config; raises ConfigError with one line naming the key.
    Shapes and arithmetic only: no dataset, no model, no CUDA context."""
    from scaffold.data.volumes import dataset_sizes
    from scaffold.model.grid import check_model
    from scaffold.model.policy import OPS, settings  # the allowed rungs are the registered ones
    from scaffold.tracking import LOGGERS, check_available  # the allowed loggers are the registered ones

    schema.check(cfg)
    schema.validate_data(cfg.data, cfg.scale)
    m = cfg.model
    check_model(cfg.scale, m.bottleneck, m.base_width, m.groups)
    if str(cfg.device) == "cpu":  # known before any work: the step's own rule says whether a graph can run
        wants_graph(cfg.cuda_graph, torch.device("cpu"))
    for key in OPS:
        value = getattr(cfg.ladder, key)
        expect(value in settings(key), f"ladder.{key}", " | ".join(settings(key)), value)
    n_train = dataset_sizes(cfg.data)[0]
    expect(cfg.batch_size <= n_train, "batch_size", f"at most the {n_train} training volumes", cfg.batch_size)
    logger = getattr(cfg, "logger", "none")
    expect(logger in LOGGERS, "logger", " | ".join(LOGGERS), logger)
    check_available(logger)  # a missing package fails here, before any work
    # Last: the memory model reads the checked shape, precision, batch, placement and shard keys. A scale
    # that cannot fit on its device even with recompute fails here, before any data or model exists.
    check_scale(cfg)


# --- the step's shape, from a config ---------------------------------------------------------------

def dataset_bytes(cfg: Any) -> int:
    """The masks of the whole dataset (uint8), which the trainer keeps on the device."""
    from scaffold.data.volumes import dataset_sizes

    return sum(dataset_sizes(cfg.data)) * (2**cfg.scale) ** 3


def masks_on_host(cfg: Any, device: str, capacity: int) -> bool:
    """Whether `data_placement` keeps the masks in pinned host memory: `host`, or `auto` where they
    would take more than a tenth of the device; never on the CPU (there is no device to spare)."""
    if device != "cuda":
        return False
    placement = getattr(cfg, "data_placement", "auto")
    return placement == "host" or (placement == "auto" and dataset_bytes(cfg) > capacity // 10)


def step_shape(cfg: Any, device: str, recompute: str = "off", n_classes: Optional[int] = None,
               data_bytes: Optional[int] = None, capacity: Optional[int] = None,
               world: Optional[int] = None, fsdp: Optional[bool] = None) -> StepShape:
    """The step of a training config on `device` ("cuda" or "cpu"): precision, rungs, CUDA graph,
    spatial shards, FSDP and the masks' placement as this plan resolves them (`capacity`: the device's
    bytes, for `data_placement=auto` and `parallel.fsdp=auto`; data_bytes overrides the masks' bytes;
    world: the processes, torchrun's WORLD_SIZE by default; fsdp: whether the parameters are sharded,
    by default as `wants_fsdp` decides)."""
    m = cfg.model
    amp = cfg.precision == "bf16" or (cfg.precision == "auto" and device == "cuda")
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's: DDP, whose step is not captured
    if fsdp is None:
        fsdp = wants_fsdp(cfg, device, world, capacity, n_classes)[0]
    shards = int(getattr(getattr(cfg, "parallel", None), "spatial_shards", 1) or 1)
    graph = device == "cuda" and cfg.cuda_graph != "off" and world == 1 and shards == 1
    # The slab GroupNorm saves what the fused rungs save (its input and the statistics).
    fused = device == "cuda" and getattr(cfg.ladder, "group_norm", "auto") != "vendor"
    if data_bytes is None:
        host = masks_on_host(cfg, device, capacity if capacity is not None else 1 << 62)
        data_bytes = 0 if host or device != "cuda" else dataset_bytes(cfg)
    return StepShape(cfg.scale, m.bottleneck, m.base_width, m.groups, 3,
                     n_classes if n_classes is not None else cfg.data.n_categories + 1, cfg.batch_size,
                     amp, device, fused, recompute, graph, data_bytes, world > 1 and not fsdp,
                     device == "cuda" and world == 1, shards,
                     head_on_vendor=getattr(cfg.ladder, "conv", "auto") == "vendor",
                     fsdp_world=world if fsdp and world > 1 else 1)


# --- parallel.fsdp=auto -----------------------------------------------------------------------------

def wants_fsdp(cfg: Any, device: str, world: int, capacity: Optional[int],
               n_classes: Optional[int] = None) -> tuple[bool, str]:
    """(whether the parameters, gradients and Adam state are sharded over the ranks, why) for
    `parallel.fsdp`: off in one process (nothing to shard over) and where asked; on where asked; auto:
    on where the memory model says the run with them replicated (DDP; with recompute where
    `model.recompute` allows it, its lowest need) does not fit the device's `capacity` at this world
    size (also the evaluation and the warm-up copy, as the scale check counts them), off otherwise
    (DDP: no all-gathers). Shapes only: no allocation."""
    setting = str(getattr(getattr(cfg, "parallel", None), "fsdp", "off"))
    if world <= 1:
        return False, f"parallel.fsdp={setting} -> off: one process, nothing to shard over"
    if setting != "auto":
        return setting == "on", f"parallel.fsdp={setting}"
    if capacity is None:
        return False, "parallel.fsdp=auto -> off: the device's memory is not known here"
    recompute = getattr(cfg.model, "recompute", "auto")
    if recompute == "auto":  # its lowest need: recompute=auto turns it on where needed, on CUDA only
        recompute = "blocks" if device == "cuda" else "off"
    s = step_shape(cfg, device, recompute, n_classes, capacity=capacity, world=world, fsdp=False)
    e = estimate(replace(s, graph=False), warmup=cfg.warmup_steps > 0)
    whole = e.params + e.grads + e.adam + e.buckets
    on = e.need > capacity * HEADROOM
    return on, (f"parallel.fsdp=auto -> {'on' if on else 'off'}: replicated over {world} ranks a rank needs "
                f"~{_size(e.need)} (parameters, gradients, Adam state and DDP's buckets {_size(whole)}) of "
                f"{_size(capacity)}")


def _size(n: int) -> str:
    """Bytes as GiB, or MiB below a tenth of one (a test's tiny model)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


# --- recompute=auto ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RecomputePlan:
    mode: str  # "off" | "blocks"
    setting: str  # what the config asked: off | blocks | auto
    off: Estimate
    blocks: Estimate
    memory: DeviceMemory
    blocks_eager: Optional[Estimate] = None  # with recompute, eager steps: where cuda_graph=auto may fall back

    @property
    def chosen(self) -> Estimate:
        return self.blocks if self.mode == "blocks" else self.off

    def line(self) -> str:
        """One start-up line: the prediction, the free memory and the choice."""
        g = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
        need = self.chosen.need
        with_ = f"~{g(self.blocks.need)} with"
        if self.blocks_eager is not None:  # the graphed figures, and the eager fallback's
            with_ += f" (as a CUDA graph; ~{g(self.blocks_eager.need)} in eager steps)"
            if self.mode == "blocks":
                need = min(need, self.blocks_eager.need)
        if need <= self.memory.free * HEADROOM:
            fits = ""
        elif need <= self.memory.free:
            fits = f" (tight: past {HEADROOM:.0%} of the free memory)"
        else:
            fits = " (predicted NOT to fit)"
        return (f"memory: the run needs ~{g(self.off.need)} without recompute, {with_}; "
                f"{g(self.memory.free)} free on {self.memory.name}: model.recompute={self.setting} -> "
                f"{self.mode}{fits}")


def choose(setting: str, off: Estimate, memory: DeviceMemory) -> str:
    """`auto`: recompute only where the run would not fit in the free memory (never on the CPU, whose
    memory the operating system extends by swapping rather than failing)."""
    if setting != "auto":
        return setting
    if memory.name == "cpu" or off.need <= memory.free * HEADROOM:
        return "off"
    return "blocks"


def plan_recompute(cfg: Any, device: Any, n_classes: Optional[int] = None,
                   memory: Optional[DeviceMemory] = None, data_bytes: Optional[int] = None,
                   evaluate: bool = True, warmup: Optional[bool] = None) -> RecomputePlan:
    """What `model.recompute` resolves to for a config on a device, free memory queried now unless
    given. By default the run is the trainer's (its dataset on the device, evaluation, warm-up copy);
    a benchmark passes its own data bytes and evaluate=False, warmup=False."""
    device = torch.device(device)
    memory = memory if memory is not None else device_memory(device)
    warmup = cfg.warmup_steps > 0 if warmup is None else warmup
    off = estimate(step_shape(cfg, device.type, "off", n_classes, data_bytes, memory.total), evaluate, warmup)
    blocks = estimate(replace(off.shape, recompute="blocks"), evaluate, warmup)
    eager = None
    if blocks.shape.graph and getattr(cfg, "cuda_graph", "") == "auto":
        eager = estimate(replace(blocks.shape, graph=False), evaluate, warmup)
    setting = getattr(cfg.model, "recompute", "auto")
    return RecomputePlan(choose(setting, off, memory), setting, off, blocks, memory, eager)


def recompute_mode(cfg: Any, n_classes: int, device: Any = None) -> tuple[str, str]:
    """(`model.recompute` as a mode, why): off and blocks as asked; auto from the memory model on the
    run's device (never on the CPU)."""
    setting = getattr(getattr(cfg, "model", None), "recompute", "off")
    if setting != "auto":
        return setting, f"model.recompute={setting}"
    where = device if device is not None else target_device(getattr(cfg, "device", "auto"))
    if where is None or torch.device(where).type != "cuda":
        return "off", "model.recompute=auto -> off: not on a CUDA device"
    plan = plan_recompute(cfg, where, n_classes)
    return plan.mode, plan.line()


def roomy_allocator() -> bool:
    """Let the CUDA caching allocator grow its segments in place (expandable segments) instead of
    leaving freed blocks of other sizes reserved but unusable: for runs the memory model finds tight,
    where that fragmentation (22 GiB measured at scale 9) decides between fitting and not. Only when the
    user has not configured the allocator (PYTORCH_CUDA_ALLOC_CONF), and before anything is allocated.
    Allocation only: no numerics change. Returns whether it was set."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or not torch.cuda.is_available():
        return False
    if torch.cuda.is_initialized() and torch.cuda.memory_allocated() > 0:
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.12's name
    (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
    return True


def graph_plan(cfg: Any, device: Any, n_classes: int, recompute: str) -> tuple[bool, str]:
    """(whether a CUDA-graph step fits, one line saying so) for `cuda_graph=auto`: a graph's pool stays
    reserved between replays, so evaluation and Adam's temporaries come on top of the step's peak;
    eager steps share one pool. Graphs are kept unless they would not fit and eager steps need less."""
    memory = device_memory(device, query_free=False)
    s = step_shape(cfg, "cuda", recompute, n_classes, capacity=memory.total)
    warmup = cfg.warmup_steps > 0
    graphed = estimate(replace(s, graph=True), warmup=warmup).need
    eager = estimate(replace(s, graph=False), warmup=warmup).need
    room = memory.total * HEADROOM
    fits = graphed <= room or graphed <= eager  # where neither fits, the smaller need has the better chance
    line = (f"memory: a CUDA-graph step needs ~{graphed / GiB:.0f} GiB (its pool stays reserved beside "
            f"evaluation), eager steps ~{eager / GiB:.0f} GiB, of {memory.total / GiB:.0f} GiB on "
            f"{memory.name}: cuda_graph=auto -> {'graph' if fits else 'eager'}")
    return fits, line


# --- the scale check ---------------------------------------------------------------------------------

def target_device(setting: Any) -> Optional[str]:
    """The device a run with `device=setting` would use from this process, or None where that device
    is not visible here (device=cuda on a host without one: the run's own validation checks it)."""
    setting = str(setting)
    if setting == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu" if setting == "auto" else None
    if setting.startswith("cuda:"):
        return setting
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def shards_needed(s: StepShape, capacity: int, warmup: bool, most: int = 1 << 12,
                  fsdp: bool = False) -> Optional[int]:
    """The fewest shards (a power of two) over which each device's share of the run is predicted to
    fit with recompute (strictly: this is the count to advise, not the scale check's tolerant test);
    else the fewest that pass the scale check; None if no split does (the parameters and Adam state,
    which every shard holds whole, do not fit). `fsdp`: the parameters, gradients and Adam state
    sharded over the world, at least the shard count (FSDP)."""
    needs = {}
    n = 2
    while n <= min(most, 2**s.scale):
        # sharded: no CUDA graph (as step_shape has it)
        shape = replace(s, depth_shards=n, graph=False, fsdp_world=1)
        if fsdp:  # as many ranks as shards at least; no DDP buckets, no working copies
            shape = replace(shape, fsdp_world=max(n, s.fsdp_world), data_parallel=False, ask_copies=False)
        needs[n] = estimate(shape, warmup=warmup).need
        if needs[n] <= capacity:
            return n
        n *= 2
    return next((n for n, need in needs.items() if _fits(need, capacity)), None)


def _fits(need: int, capacity: int) -> bool:
    """The scale check's test: only what surely does not fit is refused (see TOLERANCE)."""
    return need * (1 - TOLERANCE) <= capacity


def check_scale(cfg: Any) -> None:
    """ConfigError (one line) when a training config cannot fit on its device even with recompute.
    Cheap: shapes only, no allocation, no CUDA context (the device's total memory, not its free)."""
    where = target_device(cfg.device)
    if where is None:
        return
    memory = device_memory(where, query_free=False)
    s = step_shape(cfg, where.split(":")[0], "blocks", capacity=memory.total)
    if s.graph and cfg.cuda_graph == "auto":  # the trainer falls back to eager steps where only they fit
        s = replace(s, graph=False)
    warmup = cfg.warmup_steps > 0
    need = estimate(s, warmup=warmup).need
    if _fits(need, memory.total):
        return
    n = shards_needed(replace(s, fsdp_world=1), memory.total, warmup)
    setting = str(getattr(cfg.parallel, "fsdp", "auto"))
    n_fsdp = shards_needed(s, memory.total, warmup, fsdp=True) if setting != "off" else None
    if n is not None:
        advice = f"use parallel.spatial_shards >= {n}"
        if n_fsdp is not None and n_fsdp < n:
            advice = (f"with FSDP (parallel.fsdp=auto|on, as many ranks at least) {n_fsdp} spatial shards "
                      f"suffice; replicated, {advice}")
    elif n_fsdp is not None:
        advice = (f"use parallel.spatial_shards >= {n_fsdp} with FSDP (parallel.fsdp={setting}: the parameters, "
                  f"gradients and Adam state sharded over at least {n_fsdp} ranks)")
    else:
        e = estimate(replace(s, fsdp_world=1), warmup=warmup)
        whole = (e.params + e.grads + e.adam) / GiB
        if setting == "off":
            fsdp = "; parallel.fsdp=off: with auto or on, FSDP shards them over the ranks"
        else:
            f = estimate(replace(s, depth_shards=2**s.scale, graph=False, fsdp_world=max(2**s.scale, s.fsdp_world),
                                 data_parallel=False, ask_copies=False), warmup=warmup)
            fsdp = (f"; nor with FSDP: the largest U-Net blocks, whole while they run, need {f.gathered / GiB:.0f} "
                    f"GiB at once")
        advice = (f"no split of the volume fits either: every rank holds the whole model, and its parameters, "
                  f"gradients and Adam state alone are {whole:.0f} GiB{fsdp}; raise model.bottleneck (fewer "
                  f"levels, fewer parameters)")
    raise ConfigError(f"scale={cfg.scale} needs ~{need / GiB:.0f} GiB per device with recompute "
                      f"(batch_size={cfg.batch_size}, {s.data_bytes / GiB:.1f} GiB of masks on it); this device "
                      f"({memory.name}) has {memory.total / GiB:.0f} GiB: {advice}")


# --- the plan ------------------------------------------------------------------------------------

def device_kind(cfg: Any) -> str:
    """"cuda" or "cpu": the kind of device this run's processes use (it picks the process group's
    backend, NCCL or gloo, before the plan itself can be made)."""
    return "cuda" if str(cfg.device) != "cpu" and torch.cuda.is_available() else "cpu"


def pick_device(name: str, place: Place) -> torch.device:
    """The torch device of a `device` setting for this process (under torchrun: its local rank's GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name!r}: no CUDA device is available here (use device=cpu)")
        if name == "cuda":
            return torch.device("cuda", cuda_index(place.local_rank))
    return torch.device(name)


def asks_working_copies(data_parallel: bool, shards: int, recompute: str) -> bool:
    """Whether the trainer asks for bf16 working copies of the conv weights (scaffold.kernels.adam
    writes them, under bf16 autocast): where the step calls the model itself (DDP and the spatial
    shards reduce the parameters' own gradients: they keep fp32 ones) and keeps its activations: under
    recompute the casts' copies are not kept through the forward, so working copies, which always are,
    would raise the step's peak (by 2 bytes a parameter, 2.7 GiB at scale 9) where memory is what
    limits the run."""
    return not data_parallel and shards == 1 and recompute == "off"


@dataclass(frozen=True)
class RunPlan:
    """Every decision of one process's run; `reasons` says why, one line each (`lines()`)."""

    device: torch.device
    amp_dtype: Optional[torch.dtype]  # bf16 autocast, or None (fp32)
    world: int = 1  # processes
    data_parallel: bool = False  # in a process group: the model runs under DDP
    spatial_shards: int = 1  # ranks that share a volume
    cuda_graph: bool = False  # capture the step (and the evaluation) as CUDA graphs
    graph_required: bool = False  # cuda_graph=on: a failed capture is an error
    recompute: str = "off"  # "off" | "blocks"
    expandable_segments: bool = False  # a tight run: the allocator grows segments in place
    masks_on_host: bool = False  # the masks in pinned host memory, copied per step
    working_copies: bool = False  # asks for bf16 working copies of the conv weights (our Adam, bf16)
    skip_rooms: bool = True  # skips written with room for their concat's other half
    fuse_head: bool = True  # the last GroupNorm + ReLU and the 1x1x1 head as one op where a rung can
    optimizer: str = "torch"  # one of OPTIMIZERS
    fsdp: bool = False  # parameters, gradients and Adam state sharded over the ranks (FSDP2), not DDP
    # The memory model's bytes for this process on a CUDA device (Estimate.need: what
    # torch.cuda.max_memory_allocated should reach over the run); None on the CPU. result.json sets the
    # measured peak of every rank beside it.
    predicted_bytes: Optional[int] = None
    reasons: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def lines(self) -> list[str]:
        """The start-up log: each decision with its reason."""
        return [f"plan: {what}: {why}" for what, why in self.reasons]

    def record(self) -> dict[str, Any]:
        """The decisions as plain values (run.json, the census)."""
        return {"device": str(self.device), "autocast": str(self.amp_dtype).replace("torch.", "") if
                self.amp_dtype else None, "world": self.world, "data_parallel": self.data_parallel,
                "spatial_shards": self.spatial_shards, "cuda_graph": self.cuda_graph, "recompute": self.recompute,
                "masks_on_host": self.masks_on_host, "working_copies": self.working_copies,
                "skip_rooms": self.skip_rooms, "fuse_head": self.fuse_head, "optimizer": self.optimizer,
                "fsdp": self.fsdp, "predicted_gib": None if self.predicted_bytes is None else
                round(self.predicted_bytes / GiB, 3)}


def resolve(cfg: Any, place: Place = Place(), n_classes: Optional[int] = None) -> RunPlan:
    """The plan of a (validated) config for this process. Queries the device's memory where a decision
    needs it (recompute=auto); raises ConfigError, one line, where the run cannot be placed."""
    from scaffold.data.volumes import dataset_sizes

    n_classes = n_classes if n_classes is not None else cfg.data.n_categories + 1
    why: list[tuple[str, str]] = []
    device = pick_device(str(cfg.device), place)
    why.append(("device", f"{device} (device={cfg.device})"))
    amp = amp_dtype(cfg.precision, device)
    why.append(("precision", f"{'bf16 autocast' if amp else 'fp32'} (precision={cfg.precision} on {device.type})"))

    shards = int(cfg.parallel.spatial_shards)
    if shards > 1 and not place.joined:
        raise ConfigError(f"parallel.spatial_shards={shards}: one process cannot split a volume; launch "
                          f"{shards} ranks per volume (torchrun --nproc-per-node={shards} -m scaffold.train ...)")
    data_world = place.world // shards if place.joined else 1
    n_train = dataset_sizes(cfg.data)[0]
    if data_world > n_train:
        raise ConfigError(f"world size {place.world}: more data-parallel ranks ({data_world}) than the "
                          f"{n_train} training volumes")
    total = device_memory(device, query_free=False).total
    fsdp, fsdp_why = wants_fsdp(cfg, device.type, place.world if place.joined else 1, total, n_classes)
    if place.joined:
        how = f"FSDP over all {place.world}" if fsdp else "DDP"
        why.append(("ranks", f"{place.world} ({data_world} data-parallel x {shards} spatial shards), {how}"))
    why.append(("fsdp", f"{'on' if fsdp else 'off'} ({fsdp_why})"))

    recompute, line = recompute_mode(cfg, n_classes, device)
    why.append(("recompute", f"{recompute} ({line})"))
    roomy = recompute == "blocks" and device.type == "cuda" and cfg.model.recompute == "auto"
    if roomy:
        why.append(("allocator", "expandable segments: a tight run, where fragmentation must not decide "
                    "whether it fits (unless PYTORCH_CUDA_ALLOC_CONF is set)"))

    graph = wants_graph(cfg.cuda_graph, device, shards, fsdp)
    where = "under DDP, its all-reduce captured too" if place.joined else "in one process"
    graph_why = (f"cuda_graph={cfg.cuda_graph}: " + (f"one CUDA device {where}" if graph else
                 "needs a CUDA device, volumes not split over ranks and parameters not sharded"
                 if cfg.cuda_graph != "off"
                 else "eager steps asked for"))
    if graph and cfg.cuda_graph == "auto":
        graph, graph_why = graph_plan(cfg, device, n_classes, recompute)
    why.append(("cuda graph", f"{'yes' if graph else 'no'} ({graph_why})"))

    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    host = masks_on_host(cfg, device.type, capacity)
    why.append(("masks", ("pinned host memory, copied per step" if host else f"on {device}") +
                f" (data_placement={cfg.data_placement}, {dataset_bytes(cfg) / GiB:.2f} GiB)"))

    opt, opt_why = optimizer_kind(device, sharded=fsdp)
    why.append(("optimizer", opt_why))
    working = asks_working_copies(place.joined, shards, recompute)
    real = working and opt == "scaffold" and amp == torch.bfloat16
    why.append(("working copies", "bf16 conv weights written by Adam" if real else
                "none (they need our Adam under bf16 autocast, one process outside DDP, volumes not split and "
                "no recompute, whose peak they would raise)"))
    rooms = shards == 1 and recompute == "off" and not fsdp
    why.append(("skip rooms", "each skip written with room for its concat's other half" if rooms else
                "off (a recomputed block owns its tensors; a split volume moves its skips; an FSDP unit's "
                "output is no view of a buffer the next unit writes)"))
    fuse = shards == 1
    why.append(("fused head", "last GroupNorm + ReLU and the 1x1x1 head as one op where their rungs allow"
                if fuse else "off: the volume is split over ranks"))
    predicted = None
    if device.type == "cuda":
        shape = step_shape(cfg, "cuda", recompute, n_classes, capacity=capacity, world=place.world, fsdp=fsdp)
        predicted = estimate(replace(shape, graph=graph), warmup=cfg.warmup_steps > 0).need
        why.append(("memory", f"~{predicted / GiB:.1f} GiB a rank predicted (the memory model; result.json "
                    "sets each rank's measured peak beside it)"))
    return RunPlan(device, amp, place.world, place.joined, shards, graph, cfg.cuda_graph == "on", recompute,
                   roomy, host, working, rooms, fuse, opt, fsdp, predicted, tuple(why))
