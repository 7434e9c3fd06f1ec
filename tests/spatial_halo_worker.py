"""Run under torchrun with 3 ranks by tests/test_spatial.py: the halo exchange alone on a 6-plane
volume of values 1..6, two planes per rank; each rank saves its padded slab and its input gradient."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    from scaffold.spatial import halo, make_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sg = make_mesh(rank, world, world, "cpu").shards
    x = (torch.arange(2, dtype=torch.float32) + 2 * rank + 1).view(1, 1, 2, 1, 1).requires_grad_()
    padded = halo(x, sg)
    (padded.flatten() * (torch.arange(4, dtype=torch.float32) + 10 * rank)).sum().backward()
    torch.save({"padded": padded.detach(), "grad": x.grad}, f"{out_dir}/{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    from tests.helpers import leave_rank
    leave_rank()
