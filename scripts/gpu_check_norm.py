"""One run on a GPU for the GroupNorm(+ReLU) and concat kernels: correctness at real shapes, the gpu tests,
a tile sweep, and the benchmark against ATen and torch.compile. Prints a compact table last and writes
JSON under --out-dir (default bench_results/gpu_norm).

    PYTHONPATH=. python3 scripts/gpu_check_norm.py --stages check tests sweep bench --scales 7
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from scaffold.bench import norm as nb
from scaffold.bench import write_json
from scaffold.bench.timing import kernel_ms
from scaffold.kernels import concat as cc
from scaffold.kernels import groupnorm as gn

CL = torch.channels_last_3d
RESULTS: dict = {}
DEADLINE = [float("inf")]  # time.time() after which long stages start nothing new
SUMMARY: list[str] = []


def rel(out, expect) -> float:
    return ((out.double() - expect.double()).norm() / expect.double().norm()).item()


def make(C, edge, dtype=torch.bfloat16, layout=CL, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((1, C, edge, edge, edge), generator=g, device="cuda").to(dtype)
    x = x.contiguous(memory_format=layout)
    w = 1 + 0.1 * torch.randn(C, generator=g, device="cuda")
    b = 0.1 * torch.randn(C, generator=g, device="cuda")
    dy = torch.randn(x.shape, generator=g, device="cuda").contiguous(memory_format=CL)
    return x, w, b, dy


def check_site(C, edge, dtype=torch.bfloat16, layout=CL) -> dict:
    x, w, b, dy = make(C, edge, dtype, layout)
    out_dtype = torch.float32  # what F.group_norm returns under CUDA autocast (and for fp32 input)
    y, mean, rstd = gn.forward(x, 8, w, b, 1e-5, True, out_dtype,
                               out=torch.full(x.shape, float("nan"), device="cuda").contiguous(
                                   memory_format=CL if layout == CL else torch.contiguous_format))
    dx, dw, db = gn.backward(dy, x, w, b, mean, rstd, 8, True,
                             out=torch.full_like(x, float("nan")))
    xf, wf, bf = (t.float().detach().requires_grad_() for t in (x, w, b))
    y_ref = F.relu(F.group_norm(xf, 8, wf, bf, 1e-5))
    gref = torch.autograd.grad(y_ref, (xf, wf, bf), dy)
    y2, mean2, rstd2 = gn.forward(x, 8, w, b, 1e-5, True, out_dtype)
    again = (y2,) + gn.backward(dy, x, w, b, mean2, rstd2, 8, True)
    got = (y, dx, dw, db)
    h = hashlib.sha256()
    for t in got:
        h.update(t.float().cpu().numpy().tobytes())
    return dict(C=C, edge=edge, dtype=str(dtype), layout=str(layout),
                err_y=rel(y, y_ref), err_dx=rel(dx, gref[0]), err_dw=rel(dw, gref[1]),
                err_db=rel(db, gref[2]), all_written=not any(t.isnan().any().item() for t in got),
                repeat_bitwise=all(torch.equal(p, q) for p, q in zip(got, again)),
                digest=h.hexdigest()[:16])


def stage_check():
    rows = []
    cases = [(64, 128, torch.bfloat16, CL), (128, 64, torch.bfloat16, CL), (256, 32, torch.bfloat16, CL),
             (512, 16, torch.bfloat16, CL), (1024, 8, torch.bfloat16, CL), (2048, 8, torch.bfloat16, CL),
             (128, 64, torch.bfloat16, torch.contiguous_format), (256, 32, torch.float32, CL)]
    for C, edge, dtype, layout in cases:
        try:
            rows.append(check_site(C, edge, dtype, layout))
        except Exception:
            rows.append(dict(C=C, edge=edge, error=traceback.format_exc(limit=3)[-600:]))
        print(rows[-1], flush=True)
    try:  # concat: bitwise against torch.cat then the cast, and an exact gradient split
        g = torch.Generator(device="cuda").manual_seed(1)
        a = torch.randn((1, 64, 128, 128, 128), generator=g, device="cuda").contiguous(memory_format=CL)
        bb = torch.randn(a.shape, generator=g, device="cuda").to(torch.bfloat16)
        bb = bb.contiguous(memory_format=CL)
        out = cc.concat_channels(a, bb, torch.bfloat16)
        ga, gb = cc.split_backward(out, 64, torch.float32, torch.bfloat16)
        rows.append(dict(concat_bitwise=torch.equal(out, torch.cat([a, bb], 1).to(torch.bfloat16)),
                         split_exact=torch.equal(ga, out[:, :64].float()) and torch.equal(gb, out[:, 64:])))
    except Exception:
        rows.append(dict(concat_error=traceback.format_exc(limit=3)[-600:]))
    print(rows[-1], flush=True)
    RESULTS["check"] = rows
    for r in rows:
        if "err_y" in r:
            SUMMARY.append(f"check {r['C']}@{r['edge']}^3 {r['dtype'][6:]} {r['layout'][6:]}: "
                           f"y {r['err_y']:.1e} dx {r['err_dx']:.1e} dw {r['err_dw']:.1e} db {r['err_db']:.1e} "
                           f"written {r['all_written']} repeat {r['repeat_bitwise']} {r['digest']}")
        else:
            SUMMARY.append(f"check {str(r)[:200]}")


def stage_tests():
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_kernel_groupnorm.py",
           "tests/test_kernel_concat.py", "-m", "gpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    tail = (res.stdout + res.stderr).strip().splitlines()
    RESULTS["tests"] = dict(rc=res.returncode, tail=tail[-30:])
    print("\n".join(tail[-30:]), flush=True)
    SUMMARY.append(f"gpu tests rc={res.returncode}: {tail[-1] if tail else ''}")


def stage_xproc():
    """Bitwise across processes: a fresh interpreter computes the same site's digest."""
    here = check_site(128, 64)["digest"]
    res = subprocess.run([sys.executable, __file__, "--stages", "digest"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    there = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-300:]
    RESULTS["xproc"] = dict(here=here, there=there, equal=here == there)
    SUMMARY.append(f"cross-process bitwise (128@64^3 fwd+bwd): {here == there} ({here} vs {there})")


def stage_digest():
    print(check_site(128, 64)["digest"])


# Split (statistics) passes: (elements per tile, warps, programs per SM); elementwise (normalize, dx)
# passes: (elements per tile, warps). Swept one side at a time, the other at the heuristic's value
# (the first entry of each list); device time from CUDA-graph replays, L2 flushed before each.
SWEEP_RED = [(4096, 8, 4), (4096, 8, 8), (8192, 8, 4), (2048, 4, 8), (2048, 4, 16), (16384, 16, 2),
             (2048, 8, 8), (4096, 4, 8), (8192, 16, 4), (4096, 8, 2), (8192, 8, 2)]
SWEEP_EW = [(4096, 8), (2048, 4), (8192, 8), (16384, 16), (4096, 4), (1024, 4)]
SWEEP_SITES = [(64, 128), (128, 64), (256, 32), (512, 16), (1024, 8), (2048, 8), (64, 256)]
SITES = [SWEEP_SITES]  # the sweep's sites; --sites replaces them


def stage_sweep():
    from scaffold.bench.timing import graph_ms

    rows = []
    red0, ew0 = SWEEP_RED[0], SWEEP_EW[0]
    configs = [r + ew0 for r in SWEEP_RED] + [red0 + e for e in SWEEP_EW[1:]]
    for C, edge in SITES[0]:
        x, w, b, dy = make(C, edge)
        dyb = dy.to(torch.bfloat16)
        del dy
        for tile in configs:
            if time.time() > DEADLINE[0]:
                rows.append(dict(C=C, edge=edge, tile=tile, error="skipped: out of time"))
                continue
            try:
                y, mean, rstd = gn.forward(x, 8, w, b, 1e-5, True, torch.bfloat16, tile=tile)
                f = graph_ms(lambda: gn.forward(x, 8, w, b, 1e-5, True, torch.bfloat16, tile=tile))
                bw = graph_ms(lambda: gn.backward(dyb, x, w, b, mean, rstd, 8, True, tile=tile))
                # Bytes the kernels move: forward 2 reads + 1 write, backward 4 reads + 1 write (bf16).
                rows.append(dict(C=C, edge=edge, tile=tile, fwd_ms=f, bwd_ms=bw,
                                 tb_s=x.numel() * 16 / ((f + bw) * 1e-3) / 1e12))
                del y, mean, rstd
            except Exception as exc:
                rows.append(dict(C=C, edge=edge, tile=tile, error=str(exc)[:300]))
            print(rows[-1], flush=True)
        del x, dyb
        torch.cuda.empty_cache()
    RESULTS["sweep"] = rows
    for r in rows:
        if "fwd_ms" in r:
            SUMMARY.append(f"sweep {r['C']}@{r['edge']}^3 tile {r['tile']}: fwd {r['fwd_ms']:.4f} "
                           f"bwd {r['bwd_ms']:.4f} ms ({r['tb_s']:.2f} TB/s of kernel traffic)")
        else:
            SUMMARY.append(f"sweep {r['C']}@{r['edge']}^3 tile {r['tile']}: {r.get('error', '')[:150]}")


# Split passes' tile loop: (num_stages, loop_unroll_factor) of tl.range; (0, 0) is the compiler's choice.
LOOP_OPTIONS = [(0, 0), (0, 2), (0, 4), (2, 0), (3, 0), (4, 0), (2, 2)]


def stage_loop():
    """The table's tile for each site with each loop option (same bits by construction: checked)."""
    from scaffold.bench.timing import graph_ms

    rows = []
    for C, edge in SITES[0]:
        x, w, b, dy = make(C, edge)
        dyb = dy.to(torch.bfloat16)
        del dy
        width = "narrow" if C <= 128 else "mid" if C <= 256 else "wide"
        base = gn.TILE_TABLE.get((gn.arch_key(x.device), "bf16", width))
        ref = None
        for loop in LOOP_OPTIONS:
            if time.time() > DEADLINE[0]:
                break
            tile = tuple(base[:5]) + loop
            try:
                y, mean, rstd = gn.forward(x, 8, w, b, 1e-5, True, torch.bfloat16, tile=tile)
                dx, _, _ = gn.backward(dyb, x, w, b, mean, rstd, 8, True, tile=tile)
                bits = (y.view(torch.int16).sum().item(), dx.view(torch.int16).sum().item(),
                        mean.sum().item(), rstd.sum().item())
                ref = bits if ref is None else ref
                f = graph_ms(lambda: gn.forward(x, 8, w, b, 1e-5, True, torch.bfloat16, tile=tile))
                bw = graph_ms(lambda: gn.backward(dyb, x, w, b, mean, rstd, 8, True, tile=tile))
                rows.append(dict(C=C, edge=edge, tile=tile, fwd_ms=f, bwd_ms=bw, same_bits=bits == ref))
                del y, mean, rstd, dx
            except Exception as exc:
                rows.append(dict(C=C, edge=edge, tile=tile, error=str(exc)[:300]))
            print(rows[-1], flush=True)
        del x, dyb
        torch.cuda.empty_cache()
    RESULTS["loop"] = rows
    for r in rows:
        SUMMARY.append(f"loop {r['C']}@{r['edge']}^3 {r['tile'][5:]}: " + (
            f"fwd {r['fwd_ms']:.4f} bwd {r['bwd_ms']:.4f} ms same bits {r['same_bits']}"
            if "fwd_ms" in r else r["error"][:150]))


def stage_profile():
    """Per-kernel device time of one forward + backward at each scale-7 site (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for C, edge in SWEEP_SITES[:5]:
        x, w, b, dy = make(C, edge)
        dyb = dy.to(torch.bfloat16)
        for _ in range(2):
            y, mean, rstd = gn.forward(x, 8, w, b, 1e-5, True, torch.bfloat16)
            gn.backward(dyb, x, w, b, mean, rstd, 8, True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                y, mean, rstd = gn.forward(x, 8, w, b, 1e-5, True, torch.bfloat16)
                gn.backward(dyb, x, w, b, mean, rstd, 8, True)
            torch.cuda.synchronize()
        per = {k: v * 1e3 for k, v in kernel_ms(prof, 5).items()}  # µs per call
        rows.append(dict(C=C, edge=edge, kernels_us=per))
        SUMMARY.append(f"profile {C}@{edge}^3 us: " + ", ".join(f"{k[:24]} {v:.1f}" for k, v in per.items()))
    RESULTS["profile"] = rows


def stage_bench(scales, compile_too, deadline):
    RESULTS["bench"] = nb.run(scales, compile_too=compile_too, deadline=deadline)
    for scale, res in RESULTS["bench"]["scales"].items():
        for kind in ("norm_totals", "concat_totals"):
            for name, t in res[kind].items():
                SUMMARY.append(f"scale {scale} {kind[:-7]} {name}: fwd {t['fwd_ms']:.2f} "
                               f"bwd {t['bwd_ms']:.2f} total {t['total_ms']:.2f} ms "
                               f"(floor {t['floor_ms']:.2f})")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", nargs="+", default=["check", "tests", "sweep", "bench"])
    p.add_argument("--scales", type=int, nargs="+", default=[7])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out-dir", default="bench_results/gpu_norm")
    p.add_argument("--sites", default=None, metavar="C@EDGE,...",
                   help="sweep only these sites, e.g. 64@128,128@64 (default: every scale-7 and -8 shape)")
    p.add_argument("--budget-s", type=float, default=270.0, help="start nothing new after this")
    args = p.parse_args()
    t0 = time.time()
    DEADLINE[0] = t0 + args.budget_s
    if args.sites:
        try:
            SITES[0] = [tuple(int(v) for v in site.split("@")) for site in args.sites.split(",")]
        except ValueError:
            raise SystemExit(f"--sites {args.sites!r}: expected C@EDGE pairs, e.g. 64@128,128@64")
    RESULTS["env"] = dict(torch=torch.__version__, device=torch.cuda.get_device_name(),
                          triton=__import__("triton").__version__)
    stages = dict(check=stage_check, tests=stage_tests, sweep=stage_sweep, xproc=stage_xproc,
                  profile=stage_profile, loop=stage_loop,
                  digest=stage_digest,
                  bench=lambda: stage_bench(args.scales, not args.no_compile, t0 + args.budget_s))
    if args.stages == ["digest"]:
        return stage_digest()
    for name in args.stages:
        t = time.time()
        if t > t0 + args.budget_s:
            SUMMARY.append(f"stage {name}: skipped (out of time)")
            continue
        try:
            stages[name]()
        except Exception:
            msg = traceback.format_exc(limit=4)
            print(msg, flush=True)
            SUMMARY.append(f"stage {name} failed: {msg.splitlines()[-1][:200]}")
        SUMMARY.append(f"stage {name}: {time.time() - t:.0f} s")
        os.makedirs(args.out_dir, exist_ok=True)
        write_json(os.path.join(args.out_dir, "gpu_check_norm.json"), RESULTS)
    print(f"\n==== summary ({time.time() - t0:.0f} s, {RESULTS['env']}) ====")
    print("\n".join(SUMMARY))


if __name__ == "__main__":
    main()
