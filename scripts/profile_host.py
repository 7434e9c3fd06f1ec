#!/usr/bin/env python
"""Where the host's time goes in an eager training step: `python scripts/profile_host.py --scale 7`.

The eager step (no CUDA graph) is host-bound when the host needs longer to enqueue its kernels than the
device needs to run them. This builds a variant's TrainStep as scaffold.bench.minibatch does, then:
- the host's ms per step while the device is busy (each step launched behind a device-side sleep, so
  no launch ever waits for a full queue), without any profiler;
- the kernels launched per step (torch.profiler: CUDA kernel, memcpy and memset events);
- the same steps under cProfile: the functions by own time and by cumulative time, in ms per step
  (cProfile's overhead inflates every figure; the ranking is what it is for).
Prints the tables and writes them as JSON (`--out`).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=7)
    ap.add_argument("--variant", default="ladder")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--compare-launch", type=int, default=0, metavar="ROUNDS",
                    help="also time the step with every Triton launch through Triton's JIT path and "
                         "through the direct path (scaffold.kernels.lib.launch), alternating, ROUNDS each")
    ap.add_argument("--out", default="bench_results/profile_host.json")
    args = ap.parse_args(argv)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from scaffold.bench.minibatch import make_step
    from scaffold.bench.timing import host_ms

    dev = torch.device("cuda")
    _, step, masks = make_step(args.variant, args.scale, args.width, dev)
    for i in range(3):  # compiled, allocated, autotuned
        step(masks[i % len(masks)])
    torch.cuda.synchronize()
    per_step = host_ms(lambda: step(masks[0]), calls=1, rounds=7)
    compare = _compare_launch(step, masks, args.compare_launch) if args.compare_launch else None

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(masks[0])
        torch.cuda.synchronize()
    launches = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False))

    prof_py = cProfile.Profile()
    for i in range(args.steps):
        # One step at a time behind a device-side sleep: no launch waits for the device (with several
        # steps queued at once, the launch queue fills and a launch blocks until kernels finish).
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e8))
        prof_py.enable()
        step(masks[i % len(masks)])
        prof_py.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof_py)
    rows = []
    for (path, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{os.path.relpath(path) if path.startswith('/') else path}:{line}({fn})",
                     "calls_per_step": ncalls / args.steps, "own_ms": tottime * 1e3 / args.steps,
                     "cum_ms": cumtime * 1e3 / args.steps})
    own = sorted(rows, key=lambda r: -r["own_ms"])[: args.top]
    cum = sorted((r for r in rows if "scaffold" in r["function"] or "triton" in r["function"]),
                 key=lambda r: -r["cum_ms"])[: args.top]
    print(f"{args.variant} scale {args.scale}: host {per_step:.2f} ms per step (no profiler), "
          f"{launches} device launches per step")
    if compare:
        print("\n-- Triton launches: Triton's JIT path against the direct path (same process, alternating)")
        print(f"{'path':8} {'host ms/step':>13} {'step ms':>9} {'launches direct/triton':>23}  rounds (host)")
        for name, r in compare.items():
            print(f"{name:8} {r['host_ms']:13.2f} {r['step_ms']:9.2f} {r['direct']:>11}/{r['triton']:<11}  "
                  + " ".join(f"{v:.2f}" for v in r["host_rounds"]))
    for title, table, key in (("own time", own, "own_ms"), ("cumulative (ours and Triton's)", cum, "cum_ms")):
        print(f"\n-- by {title}, ms per step under cProfile")
        for r in table:
            print(f"{r[key]:8.3f}  {r['calls_per_step']:7.1f}x  {r['function']}")
    result = {"variant": args.variant, "scale": args.scale, "host_ms_per_step": per_step,
              "launches_per_step": launches, "compare_launch": compare, "by_own_time": own, "by_cumulative_time": cum,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def _compare_launch(step, masks, rounds: int) -> dict:
    """Host ms per step (device busy) and step ms (wall, device synchronized) with the Triton launches
    through each path, the paths alternating round by round; launches per step by path."""
    import statistics
    import time

    from scaffold.bench.timing import host_ms
    from scaffold.kernels.lib import launch

    out = {name: {"host_rounds": [], "step_rounds": []} for name in ("triton", "direct")}
    for _ in range(rounds):
        for name in out:
            launch.enabled = name == "direct"
            step(masks[0])  # this path's entries are filled
            torch.cuda.synchronize()
            c0 = launch.counts()
            out[name]["host_rounds"].append(host_ms(lambda: step(masks[0]), calls=1, rounds=5))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(10):
                step(masks[i % len(masks)])
            torch.cuda.synchronize()
            out[name]["step_rounds"].append((time.perf_counter() - t0) * 1e3 / 10)
            c1 = launch.counts()
            calls = 5 + 1 + 10  # host_ms: one warm-up call and 5 rounds of one call; then 10 steps
            out[name]["direct"] = round((c1["direct"] - c0["direct"]) / calls)
            out[name]["triton"] = round((c1["triton"] - c0["triton"]) / calls)
    launch.enabled = True
    for r in out.values():
        r["host_ms"] = statistics.median(r["host_rounds"])
        r["step_ms"] = statistics.median(r["step_rounds"])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
