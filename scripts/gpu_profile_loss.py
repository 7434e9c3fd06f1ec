"""Where the loss head's time goes on the GPU: the fused path's tile and split configurations swept
(device time from CUDA-graph replays, and as launched from Python), beside the eager form, and a kernel
table of one fused forward + backward. Prints a table; JSON to --out.

    python scripts/gpu_profile_loss.py [--edge 128]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from scaffold.bench import write_json
from scaffold.bench.timing import graph_ms, kernel_ms, wall_ms
from scaffold.kernels import seg_loss
from scaffold.loss import SegmentationLoss

EPS = 1e-6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--edge", type=int, default=128)
    ap.add_argument("--out", default="bench_results/loss_profile.json")
    ap.add_argument("--sweep", default=None, metavar="FORMS:VOXELS:WARPS:PER_SM",
                    help="sweep only these plans, e.g. rows:64,128:2,4:16,32 (default: a wide grid)")
    ap.add_argument("--check-best", action="store_true",
                    help="check the fastest plan: against the eager head, 50 repeats bitwise, no host sync")
    args = ap.parse_args()
    e, C = args.edge, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(1, C, e, e, e, device="cuda", generator=g).bfloat16()
    z = z.contiguous(memory_format=torch.channels_last_3d).requires_grad_()
    y = torch.randint(0, C, (1, e, e, e), device="cuda", generator=g).to(torch.uint8)  # as the trainer
    w = torch.linspace(0.5, 2.0, C, device="cuda")
    one = torch.ones((), device="cuda")
    res: dict = {"edge": e, "sweep": []}

    def launchers(tile=None):
        _, _, _, sums = seg_loss.forward(z, y, w, EPS, tile=tile)
        seg_loss.backward(z, y, w, sums, EPS, one, None, None, tile=tile)

    def autograd_path():
        z.grad = None
        seg_loss.seg_loss_terms(z, y, w, EPS)[0].backward()

    eager = SegmentationLoss(w, rung="vendor").cuda()

    def eager_step():
        z.grad = None
        eager(z, y).backward()

    for name, fn in (("default (autograd)", autograd_path), ("default (launchers)", launchers),
                     ("eager", eager_step)):
        res[name] = dict(device_ms=graph_ms(fn), wall_ms=wall_ms(fn))
        print(f"{name:>22}: device {res[name]['device_ms'] * 1e3:8.1f} us, "
              f"as launched {res[name]['wall_ms'] * 1e3:8.1f} us", flush=True)
    if args.sweep:
        forms, *axes = args.sweep.split(":")
        axes = [tuple(int(v) for v in a.split(",")) for a in axes]
        configs = [(bv, warps, per_sm, form) for form in forms.split(",")
                   for bv, warps, per_sm in itertools.product(*axes)]
    else:
        configs = [(bv, warps, per_sm, "tile") for bv, warps, per_sm in
                   itertools.product((32, 64, 128), (2, 4, 8), (4, 16))]
        configs += [(bv, warps, per_sm, "rows") for bv, warps, per_sm in
                    itertools.product((128, 256, 512, 1024), (4, 8), (4, 16))]
    for tile in configs:
        try:
            row = dict(tile=tile, device_ms=graph_ms(lambda: launchers(tile)),
                       forward_ms=graph_ms(lambda: seg_loss.forward(z, y, w, EPS, tile=tile)))
        except Exception as exc:
            row = dict(tile=tile, error=str(exc)[:200])
        res["sweep"].append(row)
        print(row, flush=True)
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        autograd_path()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            autograd_path()
        torch.cuda.synchronize()
    per = {k: v * 1e3 for k, v in kernel_ms(prof, 5).items()}  # µs per call
    res["kernels_us"] = per
    print("kernels (us per call): " + ", ".join(f"{k[:40]} {v:.1f}" for k, v in per.items()))
    for form in seg_loss.FORMS:
        rows = [r for r in res["sweep"] if "device_ms" in r and r["tile"][3] == form]
        if rows:
            best = min(rows, key=lambda r: r["device_ms"])
            print(f"best {form} {best['tile']}: {best['device_ms'] * 1e3:.1f} us device "
                  f"(forward {best['forward_ms'] * 1e3:.1f})")
    if args.check_best:
        best = min((r for r in res["sweep"] if "device_ms" in r), key=lambda r: r["device_ms"])
        res["check"] = check_plan(z, y, w, tuple(best["tile"]), eager)
        print(f"check of {best['tile']}: {res['check']}")
    write_json(args.out, res)


def check_plan(z, y, w, tile, eager) -> dict:
    """The fused head at `tile` against the eager head (fp32 math on the same bf16 logits), bitwise
    repeats, and no host sync in forward + backward."""
    x = z.detach().clone().requires_grad_()
    e_loss, e_ce, e_dice = eager.terms(x, y)
    (e_dz,) = torch.autograd.grad(e_loss, x)
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, ce, dice = seg_loss.seg_loss_terms(x, y, w, EPS, tile=tile)
        (dz,) = torch.autograd.grad(loss, x)
        values = torch.stack([seg_loss.seg_loss_terms(z, y, w, EPS, tile=tile)[0] for _ in range(50)])
        (dz2,) = torch.autograd.grad(seg_loss.seg_loss_terms(x, y, w, EPS, tile=tile)[0], x)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    return dict(loss_rel=rel(loss, e_loss), ce_rel=rel(ce, e_ce), dice_rel=rel(dice, e_dice),
                dz_rel=rel(dz, e_dz), distinct_in_50=torch.unique(values).numel(),
                grad_repeat_bitwise=torch.equal(dz, dz2), no_sync=True,
                ok=rel(loss, e_loss) < 1e-3 and rel(dz, e_dz) < 1e-2 and torch.unique(values).numel() == 1
                and torch.equal(dz, dz2))


if __name__ == "__main__":
    main()
