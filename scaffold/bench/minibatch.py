"""Training-step benchmark: `python -m scaffold.bench.minibatch [--scale 7] [--variants ...] [--out FILE]`.

Times the trainer's own training step (scaffold.step.TrainStep: input built on the device, forward under
bf16 autocast, loss on the uint8 labels, backward, gradient clip, Adam, grads reset) for several variants,
side by side in one process:
  ladder    the default: every site on its `auto` rung (the convolutions `routed`: per direction on
            Triton or deterministic cuDNN as the measured routes say; GroupNorm, concat and the max
            pool on Triton)
  graphed   the default as the trainer runs it on one GPU: the whole step (forward, loss, backward,
            clip, Adam) captured once as a CUDA graph and replayed (scaffold/step.py)
  triton    the default with the convolutions forced onto the Triton rung (conv=triton,
            conv_transpose=triton), to weigh that rung inside the real step
  cudnn     the default with the convolutions forced onto vendor (cuDNN), the other sites as ladder
  vendor    every site forced to the vendor op (stock eager PyTorch: cuDNN + ATen, torch's default Adam)
  compiled  the vendor model under torch.compile (what a user gets from stock PyTorch + compile), with
            torch's default Adam
  V+recompute  variant V with model.recompute=blocks (activations recomputed in the backward)
  V+separatehead  variant V with the last GroupNorm + ReLU and the 1x1x1 head run apart (UNet3d.fuse_head
            off; fused by default where the rungs allow, see scaffold.kernels.norm_head)
  V@alt     variant V with the conv route table of `--alt-routes FILE` (another tree's routes.py, or the
            JSON of `scaffold.bench.tune_routes --out`) in place of scaffold/model/routes.py's, to weigh
            a route change inside the step; a variant may be named more than once, e.g.
            `--variants graphed,graphed@alt,graphed,graphed@alt` alternates the two tables
Each variant runs warm-up steps first, then `--reps` rounds of `--steps` steps timed with
scaffold.bench.timing.measure (wall timer: CUDA events, one wait at the end); the table gives the median
step time and the ratio to `vendor`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from scaffold import determinism
from scaffold.bench import model_bench_setup, write_json
from scaffold.bench.timing import measure
from scaffold.config import Config, LadderConfig


def build(variant: str, scale: int, width: int, device: torch.device, n_classes: int = 6):
    from scaffold.model.unet import UNet3d

    cfg = Config(scale=scale)
    cfg.model.base_width = width
    cfg.model.recompute = "off"  # what each variant measures does not depend on the device's memory
    fuse_head = not variant.endswith("+separatehead")
    if not fuse_head:
        variant = variant[: -len("+separatehead")]
    if variant.endswith("+recompute"):  # any variant with model.recompute=blocks
        cfg.model.recompute = "blocks"
        variant = variant[: -len("+recompute")]
    rung = "auto" if variant in ("ladder", "graphed", "triton", "cudnn") else "vendor"
    conv = {"triton": "triton", "cudnn": "vendor"}.get(variant, rung)
    cfg.ladder = LadderConfig(conv=conv, conv_transpose=conv, group_norm=rung, concat=rung, pool=rung,
                              loss=rung)
    determinism.seed_all(0)
    model = UNet3d.from_config(cfg, n_classes).to(device)
    model.fuse_head = fuse_head
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last_3d)
    net = torch.compile(model) if variant == "compiled" else model
    return model, net, cfg


# Kernel name fragments -> the part of the step they belong to (first match wins).
CATEGORIES = (
    ("norm_head", ("_nh_",)),  # the last GroupNorm fused with the 1x1x1 head (scaffold.kernels.norm_head)
    ("group_norm", ("_gn_", "group_norm", "GroupNorm", "RowwiseMoments", "GammaBeta", "ComputeFusedParams",
                    "ComputeInternalGradients", "ComputeBackwardFusedParams")),
    ("concat", ("_concat_kernel", "_split_kernel", "_copy_kernel", "CatArrayBatched")),
    ("pool", ("_pool_fwd_kernel", "_pool_bwd_kernel")),
    ("loss", ("_loss_", "softmax", "nll")),
    ("conv", ("conv", "Conv", "cudnn", "xmma", "cutlass", "sm90_", "implicit", "wgrad", "dgrad",
              "_bias_grad_kernel")),
    ("optimizer", ("multi_tensor", "foreach", "adam", "Adam", "norm_kernel", "_sq_partials_kernel",
                   "_clip_kernel")),
)


def category(kernel: str) -> str:
    for name, parts in CATEGORIES:
        if any(p in kernel for p in parts):
            return name
    return "other"


def step_breakdown(step, steps: int) -> dict:
    """Device time per step by part (kernel durations from the profiler, summed by name), the step's
    wall time under the profiler, the host time to enqueue one step from an idle device, and the
    host's time per step while the device is busy (timing.host_ms: the step is host-bound where this
    exceeds the device time)."""
    from torch.profiler import ProfilerActivity, profile

    from scaffold.bench.timing import host_ms, kernel_ms

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(0)
    enqueue_ms = (time.perf_counter() - t0) * 1e3  # launches only: nothing in the step waits on the device
    torch.cuda.synchronize()
    # the host's own time per step, median of 5 steps each launched behind a device-side sleep
    host_step_ms = host_ms(lambda: step(0), calls=1, rounds=5)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels = kernel_ms(prof, steps)
    parts: dict[str, float] = {}
    for name, ms in kernels.items():
        parts[category(name)] = parts.get(category(name), 0.0) + ms
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:25])
    return {"device_ms_by_part": parts, "device_ms_total": sum(parts.values()),
            "profiled_step_wall_ms": wall_ms, "host_enqueue_ms": enqueue_ms,
            "host_ms_per_step": host_step_ms, "top_kernels_ms": top}


def make_step(variant: str, scale: int, width: int, device: torch.device, n_classes: int = 6):
    """(model, step, masks): `step` is the trainer's own TrainStep (scaffold.step) for a variant, with the
    default config's optimizer, clip and precision; `masks` are 4 fixed random uint8 volumes, batch 1
    each (masks[i] is one step's batch, the labels exactly as the trainer feeds them)."""
    from scaffold.loss import SegmentationLoss
    from scaffold.step import TrainStep, amp_dtype, make_optimizer

    model, net, cfg = build(variant, scale, width, device, n_classes)
    loss_fn = SegmentationLoss(torch.linspace(0.5, 2.0, n_classes), rung=cfg.ladder.loss).to(device)
    g = torch.Generator().manual_seed(0)
    edge = 2**scale
    masks = torch.randint(0, n_classes, (4, 1, edge, edge, edge), generator=g, dtype=torch.uint8).to(device)
    palette = torch.rand(n_classes, 3, generator=g).to(device)
    if variant in ("vendor", "compiled"):  # stock PyTorch: the optimizer a user gets by default
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.optim.weight_decay)
    else:
        # working copies as the trainer has them: for the model itself, without recompute
        optimizer = make_optimizer(model, cfg, working=net is model and model.recompute == "off")
    step = TrainStep(net, loss_fn, optimizer, palette, amp_dtype(cfg.precision, device), cfg.optim.grad_clip)
    if variant.split("+")[0] == "graphed":
        if device.type != "cuda":
            raise ValueError("the graphed variant needs a CUDA device (CUDA graphs)")
        step.capture(masks[0], required=True)
    return model, step, masks


def load_routes(path: str) -> dict:
    """A conv route table from a routes.py (its ROUTES) or from tune_routes' JSON (its "routes")."""
    import importlib.util
    import json

    try:
        if path.endswith(".json"):
            with open(path) as f:
                table = json.load(f).get("routes")
        else:
            spec = importlib.util.spec_from_file_location("_alt_routes", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            table = getattr(mod, "ROUTES", None)
    except (OSError, SyntaxError, ValueError, AttributeError) as e:
        raise ValueError(f"--alt-routes {path}: {type(e).__name__}: {e}".splitlines()[0]) from None
    if not isinstance(table, dict):
        raise ValueError(f"--alt-routes {path}: expected a routes.py with ROUTES or tune_routes' JSON "
                         f"with 'routes'")
    return {k: tuple(v) for k, v in table.items()}


def time_variant(variant: str, scale: int, width: int, steps: int, reps: int, warmup: int,
                 device: torch.device, profile: bool = False, routes: dict | None = None) -> dict:
    """One variant's timings; `routes`: a conv route table used in place of the committed one while the
    variant is built and timed (a `V@alt` variant)."""
    if variant.endswith("@alt"):
        if routes is None:
            raise ValueError(f"variant {variant} needs --alt-routes FILE")
        from scaffold.model import routes as committed

        saved = dict(committed.ROUTES)
        committed.ROUTES.clear()
        committed.ROUTES.update(routes)
        try:
            res = time_variant(variant[: -len("@alt")], scale, width, steps, reps, warmup, device, profile)
        finally:
            committed.ROUTES.clear()
            committed.ROUTES.update(saved)
        return {**res, "variant": variant}
    cuda = device.type == "cuda"
    if cuda:  # peak from here on: a CUDA graph allocates its memory when it is captured, in make_step
        torch.cuda.reset_peak_memory_stats()
        base_bytes = torch.cuda.memory_allocated()
    model, train_step, masks = make_step(variant, scale, width, device)

    def step(i: int):
        train_step(masks[i % masks.shape[0]])

    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    count = iter(range(1 << 62))  # each timed call steps on the next of the 4 volumes
    per_step = measure(lambda: step(next(count)), timer="wall", reps=reps, warmup=0, calls=steps,
                       device=device).ms
    breakdown = step_breakdown(step, steps) if (cuda and profile) else None
    census = None
    if variant != "compiled":
        from scaffold.model.ladder import census as ladder_census
        from scaffold.model.policy import OPS

        c = ladder_census(model, train_step.loss_fn)
        census = {op: c[op] for op in OPS}
    peak = (torch.cuda.max_memory_allocated() - base_bytes) / 2**30 if cuda else None
    return {"variant": variant, "step_ms_median": statistics.median(per_step), "step_ms_reps": list(per_step),
            "warmup_s": warm_s, "peak_mem_gib": peak,
            "census": census, "breakdown": breakdown}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=None, help="default: 7 on CUDA, 4 on the CPU")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--variants", default="ladder,vendor,compiled")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile the steps: device time by part (GroupNorm, conv, loss, ...)")
    ap.add_argument("--alt-routes", default="", metavar="FILE",
                    help="the conv route table of the `V@alt` variants (a routes.py, or tune_routes' JSON)")
    ap.add_argument("--out", default="bench_results/minibatch.json")
    args = ap.parse_args(argv)
    alt = None
    if args.alt_routes:
        try:
            alt = load_routes(args.alt_routes)
        except ValueError as e:
            ap.error(str(e))
    elif any(v.endswith("@alt") for v in args.variants.split(",")):
        ap.error("the @alt variants need --alt-routes FILE")
    device, scale = model_bench_setup(args.scale)
    cuda = device.type == "cuda"
    if args.breakdown and not cuda:
        print("--breakdown: the device time by part comes from CUDA kernel timings, and no CUDA device is "
              "here; timing the whole steps only", file=sys.stderr)
    results = []
    for v in args.variants.split(","):
        try:
            results.append(time_variant(v, scale, args.width, args.steps, args.reps, args.warmup, device,
                                        profile=args.breakdown, routes=alt))
        except Exception as e:  # keep the other variants' numbers
            results.append({"variant": v, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
        if cuda:
            torch.cuda.empty_cache()
    base = next((r["step_ms_median"] for r in results if r["variant"] == "vendor" and "error" not in r), None)
    dev = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"training step, scale {scale} ({2**scale}³), width {args.width}, batch 1, {dev}; "
          f"median of {args.reps} x {args.steps} steps")
    print(f"{'variant':<14} {'step ms':>9} {'vs vendor':>10} {'peak GiB':>9}  rungs")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<14} failed: {r['error']}")
            continue
        ratio = f"{r['step_ms_median'] / base:.2f}x" if base else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        rungs = "" if r["census"] is None else "; ".join(
            f"{op} " + ",".join(f"{k}:{n}" for k, n in sorted(c.items())) for op, c in r["census"].items())
        print(f"{r['variant']:<14} {r['step_ms_median']:>9.2f} {ratio:>10} {mem:>9}  {rungs}")
    for r in results:
        b = r.get("breakdown")
        if b:
            parts = "  ".join(f"{k} {v:.2f}" for k, v in sorted(b["device_ms_by_part"].items(),
                                                                key=lambda kv: -kv[1]))
            print(f"{r['variant']:<14} device ms per step by part: {parts}  (sum {b['device_ms_total']:.2f}; "
                  f"profiled step {b['profiled_step_wall_ms']:.2f}; host enqueue {b['host_enqueue_ms']:.2f}, "
                  f"host per step behind a busy device {b['host_ms_per_step']:.2f})")
    write_json(args.out, {"scale": scale, "width": args.width, "device": dev, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
