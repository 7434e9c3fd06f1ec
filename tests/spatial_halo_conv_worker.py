"""Run under torchrun (gloo) by tests/test_spatial.py: one forward and backward of a 3×3×3 conv
(HaloConv3d, float64) over each rank's block of a cubic volume, with its D halo overlapped and not,
the overlapped one twice and once more through host buffers (`ShardGroup.stage`, as for CUDA tensors
over gloo); rank 0 saves the whole output, input gradient, weight and bias gradients of
each (blocks joined, parameter gradients summed in rank order), the one-process conv's, and the
planes each run's convolutions were given."""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main(out_path: str, edge: int, pd: int, ph: int) -> None:
    from scaffold.model.grid import Grid
    from scaffold.model.ladder import FastConv3d
    from scaffold.spatial import HaloConv3d, ShardGroup, all_sum, make_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sg = make_mesh(rank, world, world, "cpu").shards
    grid = Grid(pd, ph) if ph > 1 else None  # None: D slabs over the whole group
    torch.manual_seed(0)
    x = torch.randn(2, 3, edge, edge, edge, dtype=torch.float64)
    dy = torch.randn(2, 4, edge, edge, edge, dtype=torch.float64)
    conv = FastConv3d(3, 4, 3, padding=1).double()
    d0, d1, h0, h1 = Grid(pd, ph).box(sg.index, edge)

    def joined(t: torch.Tensor) -> torch.Tensor:  # every rank's block in its place in the volume
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        whole = t.new_empty((*t.shape[:2], edge, edge, edge))
        for j, part in enumerate(parts):
            a, b, c, e = Grid(pd, ph).box(j, edge)
            whole[:, :, a:b, c:e] = part
        return whole

    runs = []
    staged = ShardGroup(sg.group, sg.ranks, sg.index, stage=True)
    for overlap, group in ((True, sg), (True, sg), (False, sg), (True, staged)):
        site = copy.deepcopy(conv)
        site.__class__, site.shards, site.grid, site.overlap = HaloConv3d, group, grid, overlap
        planes = []
        padded = site.padded
        site.padded = lambda t, p: planes.append(t.shape[2]) or padded(t, p)
        xb = x[:, :, d0:d1, h0:h1].clone().requires_grad_()
        y = site(xb)
        (y * dy[:, :, d0:d1, h0:h1]).sum().backward()
        runs.append({"y": joined(y.detach()), "dx": joined(xb.grad), "dw": all_sum(site.weight.grad, sg),
                     "db": all_sum(site.bias.grad, sg), "planes": planes})
    ref = conv.requires_grad_()
    xr = x.clone().requires_grad_()
    yr = F.conv3d(xr, ref.weight, ref.bias, padding=1)
    (yr * dy).sum().backward()
    if rank == 0:
        torch.save({"runs": runs, "y": yr.detach(), "dx": xr.grad, "dw": ref.weight.grad, "db": ref.bias.grad},
                   out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
    from tests.helpers import leave_rank
    leave_rank()
