"""Parameters sharded over the ranks (`parallel.fsdp`): torch's FSDP2 (`fully_shard`) on the U-Net.

Under DDP every rank holds every parameter, its gradient and Adam's two moments: 16 bytes a parameter,
~345 GiB at scale 11 with 8 levels, more than any device. Here each rank keeps 1/W of each (W: the world
size), as DTensors sharded along their first dimension:

- **Units**: the stem, each Down block's DoubleConv (its pool has no parameters), each Up block, and the
  root (the U-Net itself, whose own parameters are the 1×1×1 head's). Before a unit runs, its
  parameters are all-gathered whole; after its forward they are freed again (the root's stay whole
  through the step); its backward gathers them again, and its gradients leave it reduce-scattered: each
  rank keeps its shard of the sum, averaged over the world. The Down block's DoubleConv, not the block,
  is the unit: the block also hands its input on as the skip, and a unit's backward gathers as soon
  as any of its outputs gets a gradient, which for a skip comes from its Up block, early in the
  backward: every encoder block would be gathered at once.
- **Layout**: FSDP2 shards contiguous parameters only, so a channels-last model (CUDA) has its
  parameters put back in torch's default layout first; the activations stay channels-last
  (`UNet3d.channels_last`). The Triton convolutions then copy each weight to channels-last per call
  (scaffold.kernels.conv.directions.channels_last_weight), cuDNN converts it itself.
- **Skip rooms off**: a unit's output must not be a view of a larger buffer that the next unit writes
  into (scaffold.plan turns them off); the concat copies both halves.
- **With spatial shards**: the mesh is the whole world, data-parallel × spatial flattened into one
  dimension (the way torchtitan shards over its data and context-parallel ranks together): the ranks of
  a shard group back-propagate the same loss over their slabs, so the world's average of their
  gradients is the data-parallel mean of the per-volume gradients, as DDP's all-reduce gives.
- **Optimizer**: torch's Adam over the shards (scaffold.step.optimizer_kind); the clip's total norm is
  DTensor's (each rank's sum of squares, all-reduced).
- **Checkpoints** hold the unsharded state, as without FSDP: `full_state` gathers the parameters and
  Adam's moments on rank 0 (to host memory, one tensor at a time) and numbers the optimizer's
  parameters as torch's own `state_dict` does; `load_full_state` takes such a state on every rank and
  keeps each rank's shard. A run resumes at any world size, with FSDP on or off.
- **Collectives in evaluation**: every forward gathers, so every rank runs the same number of
  evaluation batches (scaffold.trainer pads the shorter ranks with a batch whose values it drops).

Determinism: the all-gathers copy; the reduce-scatters sum each element over the ranks in an order fixed
by the collective's algorithm (gloo's or NCCL's, chosen from the message sizes and topology), and the
units reduce in the order of the backward, which is the same at every step: a run at a fixed world size
is bitwise reproducible. The sums differ from DDP's all-reduce in order, so FSDP on and off agree to
rounding, not bits.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def shard_model(model: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """Shards a UNet3d's parameters over the whole world, in place (its blocks and the root as FSDP
    units, see the module docstring); returns it. Spatial sharding (scaffold.spatial.shard_model) goes
    first: its modules keep their parameters' names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for p in model.parameters():  # FSDP2 refuses non-contiguous parameters (channels-last ones)
        if not p.is_contiguous():
            model.channels_last = True  # the activations keep their layout
            p.data = p.data.contiguous()
    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for unit in (model.inc, *(down.conv for down in model.downs), *model.ups):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are FSDP's shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _options(**kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters' names, in the order torch numbers them in its state dicts."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) unsharded, on rank 0 in host memory, in the layout an unsharded
    model's `state_dict()` and torch's `Optimizer.state_dict()` have (parameters numbered, not named);
    other ranks get empty dicts. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _options(cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    named = get_optimizer_state_dict(model, optimizer, options=options)
    if not named:
        return model_state, {}
    index = {n: i for i, n in enumerate(_names(model, optimizer))}
    # (the named form's groups hold lists where torch's hold tuples: Adam's betas)
    groups = [{**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()},
               "params": [index[n] for n in g["params"]]} for g in named["param_groups"]]
    return model_state, {"state": {index[n]: st for n, st in named["state"].items()}, "param_groups": groups}


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optimizer_state: dict) -> None:
    """Loads an unsharded state (a checkpoint's, read by every rank) into the sharded model and
    optimizer: each rank keeps its shard; the given dicts are left as they are. A collective: every rank
    calls it."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    # (copies of the dicts: loading replaces their tensors with this rank's shards)
    set_model_state_dict(model, dict(model_state), options=_options())
    names = _names(model, optimizer)
    named = {"state": {names[i]: dict(st) for i, st in optimizer_state["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                              for g in optimizer_state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, named, options=_options())
