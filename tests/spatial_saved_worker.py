"""Run under torchrun (gloo, CPU) by tests/test_memory_model.py: one forward and loss of the U-Net on a
batch of volumes split over the shard group, counting (per rank) the bytes of the distinct storages
autograd saves, parameters excluded, as tests/test_memory_model.py counts them in one process."""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main(out_dir: str, scale: int, shards: int, amp: bool, recompute: str) -> None:
    from scaffold.data.loader import make_input
    from scaffold.loss import SegmentationLoss
    from scaffold.model.unet import UNet3d
    from scaffold.spatial import all_sum, make_mesh, shard_model
    from tests.helpers import saved_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sg = make_mesh(rank, world, shards, "cpu").shards
    torch.manual_seed(0)
    model = UNet3d(scale, 2, 8, 4, 3, 4)
    model.set_recompute(recompute)
    shard_model(model, sg)
    loss = SegmentationLoss(torch.ones(4)).split(lambda t: all_sum(t, sg))
    edge = 2**scale
    labels = torch.randint(0, 4, (2, edge, edge, edge), dtype=torch.uint8)
    lo, hi = sg.slab(edge)
    labels = labels[:, lo:hi].contiguous()
    with saved_bytes(model) as saved:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(make_input(labels, torch.rand(4, 3)))
        total, _, _ = loss.terms(logits, labels)
    total.backward()  # the sharded backward runs too (its collectives pair up across ranks)
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump({"saved": saved["bytes"]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "bf16", sys.argv[5])
    from tests.helpers import leave_rank
    leave_rank()
