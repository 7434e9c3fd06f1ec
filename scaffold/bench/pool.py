"""The U-Net's 2×2×2 max-pool sites: the Triton kernel against the vendor formulation and ATen.

    python -m scaffold.bench.pool [--scales 7 8] [--reps 20] [--out pool.json]

The sites are the model's own (scaffold.bench.sites: the pool in front of each Down block), each run as
the model runs it: bf16 channels-last input. Methods, measured in the same process on the same inputs:
  triton      scaffold.kernels.pool (the `triton` rung, what `auto` runs on CUDA)
  vendor      scaffold.model.pool.max_pool2 (the `vendor` rung: torch.max over a window view, a one-hot
              backward); the same bits as triton
  max_pool3d  F.max_pool3d, for reference only: its CUDA backward scatters with atomics (refused under
              torch.use_deterministic_algorithms), so no rung runs it
Device time (scaffold.bench.timing's `device` timer: CUDA-graph replays, L2 flushed before each),
median of `--reps`. Forward is timed with autograd recording (as in training); backward is forward +
backward captured together minus the forward. Bandwidth counts the fewest bytes each direction must
move (x read and y written; dy read and dx written) against the 4.8 TB/s of an H200.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from scaffold.bench import write_json
from scaffold.bench.sites import distinct, model_sites
from scaffold.bench.timing import measure
from scaffold.config import ModelConfig

PEAK_BYTES_PER_S = 4.8e12
CL = torch.channels_last_3d


def pool_sites(scale: int) -> list[dict]:
    """The model's distinct pool inputs, in forward order, and how many sites have each."""
    return [dict(channels=s.cin, edge=s.edge, count=s.count)
            for s in distinct(model_sites(scale, ("pool",)))]


def methods() -> dict:
    from scaffold.kernels.pool import max_pool2 as triton_pool
    from scaffold.model.pool import max_pool2 as vendor_pool

    return {"triton": triton_pool, "vendor": vendor_pool,
            "max_pool3d": lambda x: F.max_pool3d(x, 2)}


def bench_site(site: dict, reps: int) -> dict:
    c, e = site["channels"], site["edge"]
    x = torch.randn(1, c, e, e, e, device="cuda").bfloat16().contiguous(memory_format=CL)
    x.requires_grad_()
    dy = torch.randn(1, c, e // 2, e // 2, e // 2, device="cuda").bfloat16()
    dy = dy.contiguous(memory_format=CL)
    big = x.numel() * x.element_size()
    row = dict(site=f"{c}@{e}", channels=c, edge=e, count=site["count"], fwd_bytes=big * 9 // 8,
               bwd_bytes=big * 9 // 8)
    for name, fn in methods().items():
        fwd = measure(lambda: fn(x), timer="device", reps=reps).median
        both = measure(lambda: torch.autograd.grad(fn(x), x, dy), timer="device", reps=reps).median
        row[f"{name}_fwd_ms"] = fwd
        row[f"{name}_bwd_ms"] = max(both - fwd, 0.0)
    return row


def bench(scales: list[int], reps: int, log=print) -> dict:
    results = []
    for scale in scales:
        rows = [bench_site(s, reps) for s in pool_sites(scale)]
        totals = {f"{m}_{d}_ms": sum(r["count"] * r[f"{m}_{d}_ms"] for r in rows)
                  for m in methods() for d in ("fwd", "bwd")}
        results.append(dict(scale=scale, rows=rows, totals=totals))
        log(format_table(scale, rows, totals))
    return dict(device=torch.cuda.get_device_name(), reps=reps, results=results)


def format_table(scale: int, rows: list[dict], totals: dict) -> str:
    names = list(methods())
    head = f"scale {scale}: device ms fwd / bwd (" + ", ".join(names) + "); triton's TB/s fwd / bwd"
    lines = [head]
    for r in rows:
        cells = "  ".join(f"{r[f'{m}_fwd_ms']:.3f}/{r[f'{m}_bwd_ms']:.3f}" for m in names)
        bw = (r["fwd_bytes"] / r["triton_fwd_ms"] / 1e9, r["bwd_bytes"] / r["triton_bwd_ms"] / 1e9)
        lines.append(f"  {r['site']:>10}  {cells}  {bw[0]:.2f}/{bw[1]:.2f}")
    cells = "  ".join(f"{totals[f'{m}_fwd_ms']:.3f}/{totals[f'{m}_bwd_ms']:.3f}" for m in names)
    lines.append(f"  {'sum':>10}  {cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", type=int, nargs="+", default=[7, 8])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args(argv)
    bottleneck = ModelConfig().bottleneck
    if any(not bottleneck < s <= 9 for s in args.scales):
        raise SystemExit(f"--scales {args.scales}: expected integers in {bottleneck + 1}..9")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (device time is measured with CUDA graphs)")
    result = bench(args.scales, args.reps)
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
