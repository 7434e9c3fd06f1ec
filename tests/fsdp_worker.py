"""Run under torchrun (gloo, CPU) by tests/test_fsdp.py: one training step of the U-Net with its
parameters sharded over every rank (scaffold.fsdp), optionally composed with spatial shards. Each
data-parallel rank trains one volume of the batch (split over its shard group). Rank 0 saves the whole
logits, every parameter's gradient (FSDP's average over the world, gathered), the unsharded states
before and after an Adam step, and the unsharded state of a checkpoint file it was given after
loading it into the sharded model and gathering it again."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(out_path: str, scale: int, bottleneck: int, shards: int, load_path: str, recompute: str) -> None:
    from scaffold import fsdp
    from scaffold.spatial import all_sum, make_mesh, shard_model
    from tests.spatial_case import case

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(rank, world, shards, "cpu")
    sg, d = mesh.shards, mesh.data_rank
    model, loss_fn, x, labels = case(scale, batch=mesh.data_world, bottleneck=bottleneck)
    model.skip_rooms = False  # as the plan has it under FSDP
    model.set_recompute(recompute)
    model.to(memory_format=torch.channels_last_3d)  # the layout to_device gives a model on CUDA
    if sg is not None:
        shard_model(model, sg)
        loss_fn = loss_fn.split(lambda t: all_sum(t, sg))
    fsdp.shard_model(model, "cpu")
    assert fsdp.is_sharded(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before, _ = fsdp.full_state(model, optimizer)
    lo, hi = sg.slab(x.shape[2]) if sg is not None else (0, x.shape[2])
    logits = model(x[d:d + 1, :, lo:hi].contiguous())
    loss = loss_fn.terms(logits, labels[d:d + 1, lo:hi].contiguous())[0]
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.detach().contiguous())
    optimizer.step()
    _, after = fsdp.full_state(model, optimizer)
    state = torch.load(load_path, weights_only=False)
    fsdp.load_full_state(model, optimizer, state["model"], state["optimizer"])
    reloaded = fsdp.full_state(model, optimizer)
    if rank == 0:
        per = shards if sg is not None else 1  # ranks d*per ... d*per+per-1 hold volume d's slabs
        whole = torch.cat([torch.cat(parts[v * per:(v + 1) * per], 2) for v in range(world // per)])
        torch.save({"logits": whole, "grads": grads, "before": before, "after": after, "reloaded": reloaded},
                   out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    from tests.helpers import leave_rank
    leave_rank()
