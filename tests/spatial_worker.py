"""Run under torchrun (gloo) by tests/test_spatial.py: one forward and backward of the U-Net and its loss
on a batch of volumes split over the shard group; rank 0 saves the whole-volume output (gathered), the
loss, every parameter gradient and each rank's peak device memory for the test to compare with one
process. On the CPU, on one CUDA device that every rank shares (`cuda`: gloo's exchanges staged through
host memory, as NCCL refuses two ranks on one GPU), or with a CUDA device per rank (`cuda-each`: NCCL,
each rank on its local rank's GPU); on a GPU the model's rungs are the GPU's (Triton)."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(out_path: str, scale: int, shards: int, bf16: bool, bottleneck: int, device: str = "cpu",
         norm: str = "auto") -> None:
    from scaffold.metrics import hard_dice
    from scaffold.spatial import all_sum, make_mesh, shard_model
    from tests.spatial_case import case

    each = device == "cuda-each"
    if each:
        import os

        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device)
    dist.init_process_group("nccl" if each else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if dev.type == "cuda":
        from scaffold import determinism

        determinism.configure("default")  # as the trainer: no TF32 in cuDNN's fp32 convolutions
    mesh = make_mesh(rank, world, shards, dev.type)
    sg = mesh.shards
    model, loss_fn, x, labels = case(scale, bottleneck=bottleneck, device=dev, norm=norm)
    shard_model(model, sg)
    lo, hi = sg.slab(x.shape[2])
    sharded_loss = loss_fn.split(lambda t: all_sum(t, sg))
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        fmt = torch.channels_last_3d if dev.type == "cuda" else torch.contiguous_format
        logits = model(x[:, :, lo:hi].contiguous(memory_format=fmt))
    loss, ce, dice = sharded_loss.terms(logits.float(), labels[:, lo:hi].contiguous())
    loss.backward()
    with torch.no_grad():
        per_sample = sharded_loss.per_sample(logits.float(), labels[:, lo:hi].contiguous())
        hd = hard_dice(logits.float(), labels[:, lo:hi].contiguous(), loss_fn.n_classes, shards=sg)
    # What DDP does over the world: the mean of the ranks' gradients (here in rank order).
    grads = {n: all_sum(p.grad, sg) / sg.count for n, p in model.named_parameters()}
    parts = [torch.empty_like(logits) for _ in range(sg.count)]
    dist.all_gather(parts, logits.detach().contiguous(), group=sg.group)
    peak = [0] * world
    dist.all_gather_object(peak, torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0)
    if rank == 0:
        torch.save({"logits": torch.cat(parts, 2).cpu(), "loss": loss.detach().cpu(), "ce": ce.detach().cpu(),
                    "dice": dice.detach().cpu(), "per_sample": per_sample.cpu(), "hard_dice": hd.cpu(),
                    "grads": {n: g.cpu() for n, g in grads.items()}, "peak_bytes": peak,
                    "norm_rungs": sorted({r for m in model.modules() if type(m).__name__ == "ShardedGroupNorm"
                                          for r in m.rungs_ran})}, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "bf16", int(sys.argv[5]), *sys.argv[6:8])
    from tests.helpers import leave_rank
    leave_rank()
