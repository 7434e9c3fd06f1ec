"""Optimizer benchmark: `python -m scaffold.bench.optimizer [--scale 7] [--sweep]`.

Adam and the gradient clip over the U-Net's parameters (random gradients, fixed seed), each variant
timed on its own (default: device time, each call captured in a CUDA graph and replayed; `--timer wall`
on the CPU), side by side in one process:

  ours     scaffold.kernels.adam.Adam with bf16 working copies of the conv weights, as the trainer runs
           it: the clip's norm and the update in three launches, reading bf16 gradients and writing the
           bf16 copies the next forward reads
  torch    what a step paid before: torch's fused, capturable Adam with the clip folded in (a foreach
           norm, then the divisor as Adam's `grad_scale`) over fp32 gradients
  casts    the two casts per conv weight that autocast adds without working copies (fp32 -> bf16 in the
           forward, the bf16 gradient -> fp32 in the backward), one foreach copy each: `torch + casts`
           is the baseline `ours` replaces

`--sweep` also times ours over chunk sizes × warps (what picked scaffold.kernels.adam.BLOCK and WARPS).
Prints a table and writes JSON (`--out`).
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from scaffold.bench import write_json
from scaffold.bench.timing import measure


def _model(scale: int, width: int, device: torch.device):
    from scaffold.model.unet import UNet3d

    torch.manual_seed(0)
    return UNet3d(scale, base_width=width, groups=min(8, width)).to_device(device)


def _grads(tensors: list[torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(1)
    for t in tensors:
        t.grad = (torch.randn(t.shape, generator=g) * 1e-3).to(t.device, t.dtype).contiguous(
            memory_format=torch.channels_last_3d if t.dim() == 5 else torch.contiguous_format)


def ours(scale: int, width: int, device: torch.device, block: int, warps: int):
    """(step, parameter count) for our Adam with working copies at a chunk size and warp count."""
    from scaffold.kernels import adam as A
    from scaffold.model.ladder import attach_working_copies

    model = _model(scale, width, device)
    copies = attach_working_copies(model)
    A.BLOCK, A.WARPS = block, warps  # read at each step; a new optimizer plans its chunks afresh
    opt = A.Adam(list(model.parameters()), lr=torch.tensor(1e-3, device=device), max_norm=1.0,
                 working=copies)
    _grads(opt.grad_leaves())
    return opt.step, sum(p.numel() for p in model.parameters())


def stock(scale: int, width: int, device: torch.device):
    """(torch's fused Adam + folded clip, the two casts) as the step ran them before working copies."""
    from scaffold.model.ladder import FastConv3d, FastConvTranspose3d
    from scaffold.step import fold_clip

    model = _model(scale, width, device)
    params = list(model.parameters())
    cuda = device.type == "cuda"  # torch's capturable Adam is for accelerators
    opt = torch.optim.Adam(params, lr=torch.tensor(1e-3, device=device) if cuda else 1e-3, fused=True,
                           capturable=cuda)
    _grads(params)
    no_inf = torch.zeros((), device=device)
    convs = [p for m in model.modules() if isinstance(m, (FastConv3d, FastConvTranspose3d))
             for p in (m.weight, m.bias) if p is not None]
    w16 = [torch.empty_like(p, dtype=torch.bfloat16) for p in convs]
    g16 = [p.grad.to(torch.bfloat16) for p in convs]
    g32 = [p.grad for p in convs]

    def step():
        fold_clip(opt, params, 1.0, no_inf)
        opt.step()

    def casts():
        torch._foreach_copy_(w16, convs)
        torch._foreach_copy_(g32, g16)

    return step, casts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=None, help="default: 7 on CUDA, 4 on the CPU")
    ap.add_argument("--width", type=int, default=None, help="default: 64 on CUDA, 4 on the CPU")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sweep", action="store_true", help="also time chunk sizes × warps of ours")
    ap.add_argument("--timer", choices=("device", "wall"), default=None,
                    help="default: device on CUDA, wall on the CPU")
    ap.add_argument("--out", default="bench_results/optimizer.json")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    scale = args.scale if args.scale is not None else (7 if cuda else 4)
    width = args.width if args.width is not None else (64 if cuda else 4)
    timer = args.timer or ("device" if cuda else "wall")
    if timer == "device" and not cuda:
        raise SystemExit("--timer device needs a CUDA GPU (use --timer wall)")
    from scaffold.kernels import adam as A

    def ms(fn) -> list[float]:
        fn()  # plans, tables and compilation before any capture
        return list(measure(fn, timer=timer, reps=args.reps, warmup=2, device=device).ms)

    block0, warps0 = A.BLOCK, A.WARPS
    rows = {}
    try:
        step, n = ours(scale, width, device, block0, warps0)
        rows["ours"] = ms(step)
        torch_step, casts = stock(scale, width, device)
        rows["torch"] = ms(torch_step)
        rows["casts"] = ms(casts)
        sweep = {}
        if args.sweep:
            for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
                step, _ = ours(scale, width, device, block, warps)
                sweep[f"{block}x{warps}"] = ms(step)
    finally:
        A.BLOCK, A.WARPS = block0, warps0
    med = {k: statistics.median(v) for k, v in rows.items()}
    base = med["torch"] + med["casts"]
    print(f"Adam + clip over {n:,} parameters (scale {scale}, width {width}), {timer} ms, "
          f"median of {args.reps}")
    print(f"{'variant':<14}{'ms':>9}{'vs torch + casts':>18}")
    for name in ("ours", "torch", "casts"):
        print(f"{name:<14}{med[name]:>9.3f}{med[name] / base:>17.2f}x")
    print(f"{'torch + casts':<14}{base:>9.3f}{1.0:>17.2f}x")
    for key, v in sweep.items():
        print(f"ours {key:<9}{statistics.median(v):>9.3f}{statistics.median(v) / base:>17.2f}x")
    write_json(args.out, {"scale": scale, "width": width, "params": n, "timer": timer,
                          "block": block0, "warps": warps0, "ms": rows, "median_ms": med,
                          "sweep_ms": sweep})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
