"""Run under torchrun (gloo, CPU) by tests/test_spatial.py: the gather's backward, a ring reduce-scatter
of whole-volume tensors; each rank saves what it computed and what it should be."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    from scaffold.spatial import _ring_sum_slab, gather_depth, make_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sg = make_mesh(rank, world, world, "cpu").shards
    depth, whole = 2, 2 * world
    # every rank's whole tensor: integers, so any order of summation gives exact sums
    mine = torch.arange(whole * 6, dtype=torch.float32).view(1, 2, whole, 3, 1) * (rank + 1)
    got = _ring_sum_slab(mine.contiguous(memory_format=torch.channels_last_3d), sg)
    total = sum(torch.arange(whole * 6, dtype=torch.float32).view(1, 2, whole, 3, 1) * (k + 1) for k in range(world))
    want = total[:, :, rank * depth:(rank + 1) * depth]
    # through autograd: the gather's gradient is this rank's slab of the group's summed gradients
    x = torch.full((1, 2, depth, 3, 1), float(rank), requires_grad=True)
    g = gather_depth(x, sg)
    (g * mine).sum().backward()
    torch.save({"got": got, "want": want, "grad": x.grad, "channels_last": got.is_contiguous(
        memory_format=torch.channels_last_3d)}, f"{out_dir}/{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    from tests.helpers import leave_rank
    leave_rank()
