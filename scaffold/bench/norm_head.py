"""The U-Net's tail, fused against apart: the last GroupNorm + ReLU and the 1×1×1 head.

    python -m scaffold.bench.norm_head [--scale 7] [--width 64] [--classes 6] [--reps 30] [--out tail.json]

At the tail's own shape (batch 1, `width` channels at 2^scale voxels per side, channels-last, bf16 on
CUDA, fp32 on the CPU): `fused` is scaffold.kernels.norm_head (forward, then the backward from a fixed
logits' gradient); `apart` is the model's GroupNorm + ReLU kernels (scaffold.kernels.groupnorm, writing
the head's compute dtype) followed by the head as a stock convolution (F.conv3d forward,
aten.convolution_backward for all three gradients), each direction timed alone. On CUDA the times are
device time (scaffold.bench.timing, `device` timer); on the CPU, host time under Triton's interpreter
(only useful to check that the benchmark runs). The JSON also records whether two fused backward passes
gave the same bits and the largest difference between the fused and the separate logits and input
gradient (the order of two sums differs, see scaffold.kernels.norm_head). The figure of record for the
step is bench.minibatch's (`graphed` against `graphed+separatehead`): this one says where the tail's
time goes.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from scaffold.bench import write_json
from scaffold.bench.timing import measure

GROUPS, EPS = 8, 1e-5


def tensors(scale: int, width: int, classes: int, device: torch.device) -> dict:
    """The tail's inputs: x (the last conv's output), GroupNorm's affine parameters in fp32, the head's
    weight and bias in the compute dtype, and a logits' gradient."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    edge = 2**scale
    cl = torch.channels_last_3d
    x = torch.randn(1, width, edge, edge, edge, generator=g).to(device, dtype).contiguous(memory_format=cl)
    t = dict(x=x, weight=(torch.rand(width, generator=g) + 0.5).to(device),
             bias=(torch.randn(width, generator=g) * 0.1).to(device),
             head_weight=(torch.randn(classes, width, 1, 1, 1, generator=g) * 0.1).to(device, dtype),
             head_bias=torch.randn(classes, generator=g).to(device, dtype))
    t["dl"] = torch.randn((1, classes) + x.shape[2:], generator=g).to(device, dtype).contiguous(memory_format=cl)
    return t


def run(scale: int, width: int, classes: int, reps: int, device: torch.device) -> dict:
    from scaffold.kernels import groupnorm as GN
    from scaffold.kernels import norm_head as NH

    t = tensors(scale, width, classes, device)
    x, w, b, hw, hb, dl = (t[k] for k in ("x", "weight", "bias", "head_weight", "head_bias", "dl"))
    dtype = x.dtype
    timer = "device" if device.type == "cuda" else "wall"

    def apart_forward():
        y, mean, rstd = GN.forward(x, GROUPS, w, b, EPS, True, dtype)
        return F.conv3d(y, hw, hb), y, mean, rstd

    _, y, mean, rstd = apart_forward()

    def apart_backward():
        dy, dhw, dhb = torch.ops.aten.convolution_backward(dl, y, hw, [classes], [1, 1, 1], [0, 0, 0], [1, 1, 1],
                                                            False, [0, 0, 0], 1, [True, True, True])
        return GN.backward(dy, x, w, b, mean, rstd, GROUPS, True)[0], dhw, dhb

    def fused_forward():
        return NH.forward(x, GROUPS, w, b, EPS, hw, hb, dtype)

    logits, fmean, frstd = fused_forward()

    def fused_backward():
        return NH.backward(dl, x, w, b, fmean, frstd, GROUPS, hw, hb)

    ms = {}
    for name, fn in (("apart_fwd", apart_forward), ("apart_bwd", apart_backward), ("fused_fwd", fused_forward),
                     ("fused_bwd", fused_backward)):
        m = measure(fn, timer=timer, reps=reps, warmup=2)
        ms[name] = dict(median_ms=m.median, min_ms=min(m.ms))
    once, twice = fused_backward(), fused_backward()
    apart_dx = apart_backward()[0]
    return {
        "scale": scale, "width": width, "classes": classes, "dtype": str(dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "timer": timer,
        "ms": ms,
        "fused_backward_same_bits_twice": all(torch.equal(a, c) for a, c in zip(once, twice)),
        "max_abs_diff_logits": (logits.float() - apart_forward()[0].float()).abs().max().item(),
        "max_abs_diff_dx": (once[0].float() - apart_dx.float()).abs().max().item(),
    }


def format_table(r: dict) -> str:
    ms = r["ms"]
    lines = [f"the tail at scale {r['scale']} ({r['width']} channels, {r['classes']} classes, {r['dtype']}), "
             f"{r['device']}, {r['timer']} time, median ms",
             f"{'':8} {'forward':>9} {'backward':>9} {'total':>9}"]
    for kind in ("apart", "fused"):
        f, b = ms[f"{kind}_fwd"]["median_ms"], ms[f"{kind}_bwd"]["median_ms"]
        lines.append(f"{kind:8} {f:9.4f} {b:9.4f} {f + b:9.4f}")
    total = {k: ms[f"{k}_fwd"]["median_ms"] + ms[f"{k}_bwd"]["median_ms"] for k in ("apart", "fused")}
    lines.append(f"fused / apart: {total['fused'] / total['apart']:.2f}x; fused backward bitwise twice: "
                 f"{r['fused_backward_same_bits_twice']}; largest difference: logits {r['max_abs_diff_logits']:.3g}, "
                 f"dx {r['max_abs_diff_dx']:.3g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=7)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--classes", type=int, default=6)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench_results/norm_head.json")
    args = p.parse_args(argv)
    if not 1 <= args.scale <= 9:
        raise SystemExit(f"--scale {args.scale}: expected an integer in 1..9")
    from scaffold.kernels import norm_head as NH

    if not 1 <= args.classes <= NH.MAX_CLASSES or not 1 <= args.width <= NH.MAX_HEAD_CHANNELS \
            or args.width % GROUPS:
        raise SystemExit(f"--classes {args.classes} --width {args.width}: expected at most {NH.MAX_CLASSES} "
                         f"classes and a width of at most {NH.MAX_HEAD_CHANNELS} divisible by {GROUPS}")
    result = run(args.scale, args.width, args.classes, args.reps, torch.device(args.device))
    print(format_table(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
