"""One process's place in a job: rank, world size, device, and reductions of device tensors.

Under torchrun (or Slurm with the usual RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR variables) the process group
is initialised from the environment: NCCL on CUDA, gloo on the CPU. A single process needs none of it.
Reductions take and return device tensors and never read them back to the host.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Place:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device_kind: str) -> Place:
    """Join the process group when launched by torchrun/Slurm; a lone process gets Place()."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Place()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
    return Place(rank=rank, world=world, local_rank=local_rank)


def all_reduce_sum(t: torch.Tensor, place: Place) -> torch.Tensor:
    if place.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, place: Place) -> Any:
    """Rank 0's value on every rank (e.g. the run directory that only rank 0 decides)."""
    if place.world <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(place: Place) -> None:
    if place.world > 1:
        dist.barrier()


def shutdown(place: Place) -> None:
    """Leave the group together: a rank that tears down while another still works (rank 0 writing
    figures and results) can leave the group's teardown waiting forever."""
    if place.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
