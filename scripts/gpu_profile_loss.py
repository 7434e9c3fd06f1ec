"""Where the loss head's time goes on the GPU: kernel table of one fused forward+backward, and the fused
path's tile size swept (do_bench medians), beside the eager form. Prints a table; JSON to --out."""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from scaffold.bench import write_json
from scaffold.kernels import seg_loss
from scaffold.loss import SegmentationLoss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--edge", type=int, default=128)
    ap.add_argument("--out", default="bench_results/loss_profile.json")
    args = ap.parse_args()
    e, C = args.edge, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(1, C, e, e, e, device="cuda", generator=g).bfloat16()
    z = z.contiguous(memory_format=torch.channels_last_3d).requires_grad_()
    y = torch.randint(0, C, (1, e, e, e), device="cuda", generator=g)
    w = torch.linspace(0.5, 2.0, C, device="cuda")
    res = {}

    def fused(block_v=None):
        z.grad = None
        seg_loss.seg_loss_terms(z, y, w, 1e-6, block_v=block_v)[0].backward()

    def fwd_only():
        with torch.no_grad():
            seg_loss.forward_sums(z, y, w)

    for bv in (None, 64, 128, 512, 1024):
        res[f"fused_block_v_{bv}"] = do_bench(lambda: fused(bv), warmup=25, rep=100, return_mode="median")
    res["fused_forward_sums_only"] = do_bench(fwd_only, warmup=25, rep=100, return_mode="median")
    eager = SegmentationLoss(w, rung="vendor").cuda()

    def eager_step():
        z.grad = None
        eager(z, y).backward()

    res["eager"] = do_bench(eager_step, warmup=25, rep=100, return_mode="median")
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fused()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fused()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
    print(table)
    res["profile_table"] = table
    for k, v in res.items():
        if k != "profile_table":
            print(f"{k:>28}: {v * 1e3:9.1f} us")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
