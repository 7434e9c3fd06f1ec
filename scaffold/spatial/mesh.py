"""The shard groups of spatial parallelism: which ranks share a volume, and the 2-D mesh (data-parallel ×
spatial) they form."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

@dataclass(eq=False)
class ShardGroup:
    """This rank's place in its shard group: `ranks` are the group's global ranks in slab order."""

    group: Any  # a torch.distributed ProcessGroup
    ranks: tuple[int, ...]
    index: int
    stage: bool = False  # device tensors pass through host memory (gloo over CUDA tensors: ranks sharing a GPU)

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def prev(self) -> Optional[int]:
        return self.ranks[self.index - 1] if self.index > 0 else None

    @property
    def next(self) -> Optional[int]:
        return self.ranks[self.index + 1] if self.index + 1 < self.count else None

    @property
    def leader(self) -> bool:
        """Whether this rank reports the group's (replicated) values in a world-wide sum."""
        return self.index == 0

    def slab(self, depth: int) -> tuple[int, int]:
        """[start, stop) of this rank's planes of a volume `depth` planes deep."""
        per = depth // self.count
        return self.index * per, (self.index + 1) * per

    def __deepcopy__(self, memo) -> "ShardGroup":  # a model copy (the warm-up's) shares the group
        return self


@dataclass(frozen=True)
class Mesh:
    """The world as data-parallel × spatial ranks."""

    shards: Optional[ShardGroup]  # None when volumes are not split
    data_rank: int
    data_world: int


def make_mesh(rank: int, world: int, spatial: int, device_type: str, timeout_s: Optional[float] = None) -> Mesh:
    """The 2-D mesh of a job of `world` ranks with `spatial` ranks per volume (every rank calls it). Its
    groups wait at most `timeout_s` in a collective, like the job's default group (parallel.timeout_s):
    a halo exchange with a rank that hangs fails within that bound."""
    if spatial <= 1:
        return Mesh(None, rank, world)
    if world % spatial:
        from scaffold.config import ConfigError

        raise ConfigError(f"parallel.spatial_shards={spatial}: expected a divisor of the world size "
                          f"({world} ranks)")
    import datetime

    from torch.distributed.device_mesh import DeviceMesh

    data = world // spatial
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    # Every rank creates every group, in the same order: one per volume (consecutive ranks), one per
    # slab position (the data-parallel peers).
    spatial_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(d * spatial, (d + 1) * spatial)) for d in range(data)], timeout=timeout)
    data_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, world, spatial)) for i in range(spatial)], timeout=timeout)
    mesh = DeviceMesh.from_group([data_group, spatial_group], device_type,
                                 mesh=torch.arange(world).view(data, spatial), mesh_dim_names=("data", "spatial"))
    group = mesh.get_group("spatial")
    ranks = tuple(dist.get_process_group_ranks(group))
    # gloo moves CUDA tensors in few collectives and no point-to-point ones: two ranks sharing one GPU
    # (NCCL refuses that) exchange their device tensors through host memory.
    stage = device_type == "cuda" and dist.get_backend(group) == "gloo"
    return Mesh(ShardGroup(group, ranks, ranks.index(rank), stage), rank // spatial, data)
