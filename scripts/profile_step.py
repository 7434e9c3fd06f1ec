#!/usr/bin/env python
"""One training step of a variant, profiled: `python scripts/profile_step.py --scale 9 --variant ladder+recompute`.

For steps too long for scaffold.bench.minibatch's repetitions (scale 9: seconds a step): builds the
trainer's TrainStep as the minibatch benchmark does (variants as there), runs `--steps` untimed steps
(each timed on the host, with a device wait, and the peak allocated memory since start-up), then one
step under the torch profiler. Prints the steps' times, the device time by part and the top kernels;
writes them as JSON (`--out`).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=9)
    ap.add_argument("--variant", default="ladder+recompute")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--part", action="append", default=[],
                    help="also list every kernel of this part (e.g. other, optimizer); repeatable")
    ap.add_argument("--out", default="bench_results/profile_step.json")
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from scaffold.bench.minibatch import category, make_step
    from scaffold.bench.timing import kernel_ms

    dev = torch.device("cuda")
    _, step, masks = make_step(args.variant, args.scale, args.width, dev)
    steps = []
    for i in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(masks[i % masks.shape[0]])
        torch.cuda.synchronize()
        steps.append({"s": time.perf_counter() - t0, "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        print(f"step {i}: {steps[-1]['s']:.2f} s, peak {steps[-1]['peak_gib']:.1f} GiB", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step(masks[0])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = kernel_ms(prof, 1)
    parts: dict[str, float] = {}
    for name, ms in kernels.items():
        parts[category(name)] = parts.get(category(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
    print(f"profiled step: {wall:.2f} s wall; device ms by part: "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])))
    for name, ms in top:
        print(f"{ms:10.3f} ms  {category(name):9s}  {name[:130]}")
    for part in args.part:
        listed = sorted(((n, ms) for n, ms in kernels.items() if category(n) == part), key=lambda kv: -kv[1])
        print(f"part {part}: {sum(ms for _, ms in listed):.3f} ms in {len(listed)} kernel names")
        for name, ms in listed:
            print(f"{ms:10.3f} ms  {name[:140]}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"scale": args.scale, "variant": args.variant, "device": torch.cuda.get_device_name(dev),
                   "steps": steps, "profiled_wall_s": wall, "device_ms_by_part": parts, "top_kernels_ms": top,
                   "kernels_ms": {n: [category(n), ms] for n, ms in kernels.items()}},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
