"""Where the host's time goes: cProfile of the Triton conv launchers at chosen scale-7 sites and of
the default training step, beside host_ms (the host's cost per call) of each Triton and cuDNN call.

    python scripts/profile_host.py [--sites down4a,inc2,up3T,head] [--step] [--out DIR]

Prints the host cost per call, and writes under --out the top functions by own and cumulative time
(host_sites.txt, host_step.txt). cProfile slows every Python call, so its times are inflated; use them
for where the time goes, and timing.host_ms for how much. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch


def profile(fn, calls: int) -> str:
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    return s.getvalue()


def main(argv=None) -> int:
    from scaffold.bench.conv import (DIRECTIONS, distinct_sites, model_sites, site_tensors, triton_calls,
                                     vendor_calls)
    from scaffold.bench.timing import host_ms, graph_ms

    p = argparse.ArgumentParser()
    p.add_argument("--sites", default="down4a,inc2,up3T,head",
                   help="prefixes of scale-7 site names to profile ('' for none)")
    p.add_argument("--out", default=".")
    p.add_argument("--step", action="store_true", help="also profile the default scale-7 training step")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    report = []
    for site, _ in distinct_sites(model_sites(7)):
        if not any(site.name.startswith(n) for n in a.sites.split(",") if n):
            continue
        x, w, b, dy = site_tensors(site)
        tri, ven = triton_calls(site, x, w, b, dy), vendor_calls(site, x, w, b, dy)
        for d in DIRECTIONS:
            ht, hv = host_ms(tri[d]), host_ms(ven[d])
            dt = graph_ms(tri[d], reps=20)
            line = (f"{site.name:24s} {d:10s} host triton {ht*1e3:7.1f} us  cudnn {hv*1e3:7.1f} us  "
                    f"device triton {dt*1e3:7.1f} us")
            print(line, flush=True)
            report.append(line)
            report.append(profile(tri[d], 200))
    with open(os.path.join(a.out, "host_sites.txt"), "w") as f:
        f.write("\n".join(report))
    if a.step:
        from scaffold import determinism
        from scaffold.bench.minibatch import make_step

        determinism.configure("default")
        _, step_i = make_step("ladder", 7, 64, torch.device("cuda"))
        step = lambda: step_i(0)  # noqa: E731
        for _ in range(3):
            step()
        hs = host_ms(step, calls=1, rounds=5)
        print(f"step host {hs:.2f} ms", flush=True)
        txt = profile(step, 5)
        with open(os.path.join(a.out, "host_step.txt"), "w") as f:
            f.write(f"step host {hs:.2f} ms\n" + txt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
