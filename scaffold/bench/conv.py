"""Benchmark every conv site of the U-Net: Triton kernels against cuDNN, in the same run.

    python -m scaffold.bench.conv --scale 7,8 [--sites inc.conv1,outc] [--timer wall|device|host]
                                  [--out conv.json]

The sites are the model's own (scaffold.bench.sites: its convolutions, transposed convolutions and
1×1×1 head, those of equal shape timed once and counted as often as they occur; `--sites` keeps
those whose module names contain one of the given strings). For each site and each direction
(forward, backward-data, backward-weight; the bias gradient, ours whatever the route, is not part of
any) it times, on the same bf16 NDHWC tensors: the Triton launchers (`triton`), cuDNN with algorithm
search (`cudnn`: cudnn.benchmark on, cuDNN's best), and cuDNN restricted to deterministic algorithms
without search (`cudnn_det`: what the vendor rung runs in training); on an sm_90 GPU also our Gluon
kernels (`gluon`: the three directions of the 3×3×3 sites with channels multiples of 64, each
with its default tile). `routed` is what `ladder.conv=auto` runs: per direction, the time of the
rung the measured route (scaffold/model/routes.py) takes, Triton, Gluon or `cudnn_det`. Medians of one of
scaffold.bench.timing's timers: `wall` (the default: as launched from Python), `device` (CUDA-graph
replays: device time without the host's launch cost, which dominates the small sites as launched
from Python) or `host` (the host's launch cost alone, timed while the device is held busy); ratios,
TFLOP/s, and per-model totals where each site is weighted by how often it occurs in the model. Needs
a CUDA GPU.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from scaffold.bench import write_json
from scaffold.bench.sites import Site, distinct, model_sites
from scaffold.bench.timing import TIMERS, measure
from scaffold.config import ModelConfig

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
RUNGS = ("triton", "cudnn", "cudnn_det")  # timed at every site and direction
GLUON = "gluon"  # timed too where it takes the site and direction (sm_90; `gluon_calls`)
COLUMNS = RUNGS + ("routed",)  # routed: per direction, triton or cudnn_det as the route table says
CONV_OPS = ("conv", "conv_transpose")


def conv_sites(scale: int, model: ModelConfig | None = None) -> list[Site]:
    """The distinct conv sites of the U-Net at `scale`, in forward order."""
    return distinct(model_sites(scale, CONV_OPS, model))


def transposed(site: Site) -> bool:
    return site.op == "conv_transpose"


def geometry(site: Site) -> tuple:
    """(stride, padding, dilation) of the site's conv."""
    return site.stride, site.padding, site.dilation


def flops(site: Site, batch: int = 1) -> float:
    """Multiply-adds × 2 of one direction (all three directions cost the same): over the input voxels
    of a transposed conv, the output voxels of a conv (the same count at stride 1)."""
    voxels = batch * math.prod(site.inputs[0][2:])
    return 2.0 * voxels * site.cin * site.cout * math.prod(site.weight[2:])


def describe(site: Site) -> dict:
    """A site's fields in the JSON rows."""
    return {"name": site.name, "modules": list(site.names),
            "kind": "convT" if transposed(site) else "conv", "cin": site.cin, "cout": site.cout,
            "edge": site.edge, "k": site.weight[2], "pad": site.padding[0], "bias": site.bias}


def site_key(site: Site, arch: str = "", dtype: torch.dtype = torch.bfloat16) -> str:
    """The routes.py key of a site (batch excluded) on `arch` (default: this GPU's)."""
    from scaffold.kernels.lib.device import arch_key
    from scaffold.model import routes

    return routes.route_key(arch or arch_key(torch.device("cuda")), dtype,
                            "convT" if transposed(site) else "conv", site.cin, site.cout,
                            site.weight[2:], *geometry(site), site.inputs[0][2:])


def site_tensors(site: Site, batch: int = 1, seed: int = 0, dtype=torch.bfloat16):
    """Random bf16 NDHWC operands of a site: x, w, bias (or None), dy."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):  # drawn in `dtype` and in NDHWC order: no fp32 or NCDHW copy of a
        if len(shape) == 5:      # volume (a 128-channel 512³ operand is 34 GB in bf16)
            n, c, *spatial = shape
            t = torch.randn(n, *spatial, c, generator=gen, device="cuda", dtype=dtype).permute(0, 4, 1, 2, 3)
        else:
            t = torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)
        return t.mul_(scale) if scale != 1.0 else t

    fan_in = site.cin * math.prod(site.weight[2:])
    x = rnd(batch, *site.inputs[0][1:])
    w = rnd(*site.weight, scale=fan_in ** -0.5)
    b = rnd(site.cout) if site.bias else None
    dy = rnd(batch, *site.output[1:])
    return x, w, b, dy


def triton_calls(site: Site, x, w, b, dy) -> dict:
    """The Triton launchers of each direction, and of the bias gradient ("bias": None without a bias),
    which training runs on our kernel whatever the route, so no direction's timing includes it."""
    from scaffold.kernels import conv as K

    def bias_grad():
        return K.bias_grad(dy, b.dtype) if b is not None else None

    if transposed(site):
        return {
            "fwd": lambda: K.conv_transpose3d_forward(x, w, b),
            "bwd_data": lambda: K.conv_transpose3d_backward_data(dy, w, x.shape),
            "bwd_weight": lambda: K.conv_transpose3d_backward_weight(dy, x, w.shape, w.dtype),
            "bias": bias_grad,
        }
    geom = geometry(site)
    return {
        "fwd": lambda: K.conv3d_forward(x, w, b, *geom),
        "bwd_data": lambda: K.conv3d_backward_data(dy, w, x.shape, *geom),
        "bwd_weight": lambda: K.conv3d_backward_weight(dy, x, w.shape, w.dtype, *geom),
        "bias": bias_grad,
    }


def gluon_calls(site: Site, x, w, b, dy) -> dict:
    """The Gluon kernels' directions at a site they take (forward with the bias, backward-data and
    backward-weight), as the `gluon` route runs them; {} where they take none (not sm_90, not 3×3×3,
    channels)."""
    from scaffold.kernels.conv import gluon as G
    from scaffold.kernels.conv import gluon_wgrad as GW

    if transposed(site) or not G.supported(x, w, *geometry(site)):
        return {}
    calls = {"fwd": lambda: G.conv3d_forward(x, w, bias=b)}
    if G.supported(dy, w.transpose(0, 1), *geometry(site)):
        calls["bwd_data"] = lambda: G.conv3d_backward_data(dy, w)
    if GW.supported(dy, x, w.shape, *geometry(site)):
        calls["bwd_weight"] = lambda: GW.conv3d_backward_weight(dy, x, dtype=w.dtype)
    return calls


def vendor_calls(site: Site, x, w, b, dy) -> dict:
    """cuDNN through ATen: the forward op and convolution_backward with one output mask each (the
    bias gradient apart, as in `triton_calls`)."""
    import torch.nn.functional as F

    stride, pad, dilation = geometry(site)
    bias_sizes = [site.cout] if b is not None else None

    def backward(mask):
        return torch.ops.aten.convolution_backward(
            dy, x, w, bias_sizes, stride, pad, dilation, transposed(site), (0, 0, 0), 1, mask)

    fwd = ((lambda: F.conv_transpose3d(x, w, b, stride=stride)) if transposed(site)
           else (lambda: F.conv3d(x, w, b, stride, pad, dilation)))
    return {"fwd": fwd, "bwd_data": lambda: backward([True, False, False]),
            "bwd_weight": lambda: backward([False, True, False]),
            "bias": lambda: backward([False, False, True])[2] if b is not None else None}


def check_site(site: Site, batch: int = 1, seed: int = 0, repeats: int = 4) -> dict:
    """Correctness of every direction at a real site: relative error against cuDNN in fp32 (no tf32)
    on the same bf16 operands, bitwise equality of `repeats` calls, and a hash of each result."""
    import hashlib

    x, w, b, dy = site_tensors(site, batch, seed)
    tri = triton_calls(site, x, w, b, dy)
    up = [None if t is None else t.float() for t in (x, w, b, dy)]
    ref = vendor_calls(site, *up)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        refs = {"fwd": ref["fwd"](), "bwd_data": ref["bwd_data"]()[0],
                "bwd_weight": ref["bwd_weight"]()[1], "bias": ref["bias"]()}
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    out = {"site": site.name}
    for d in DIRECTIONS:
        calls = [tri[d]() for _ in range(max(repeats, 2))]
        pairs = [(d, calls[0], calls[1:])]
        if d == "bwd_weight" and b is not None:
            biases = [tri["bias"]() for _ in range(max(repeats, 2))]
            pairs.append(("bias", biases[0], biases[1:]))
        for name, g1, others in pairs:
            r = refs[name]
            out[f"{name}_rel_err"] = ((g1.float() - r).norm() / r.norm()).item()
            out[f"{name}_repeat_equal"] = all(torch.equal(g1, g) for g in others)
            raw = g1.detach().float().cpu().contiguous().numpy().tobytes()  # bf16 -> fp32 is exact
            out[f"{name}_sha"] = hashlib.sha256(raw).hexdigest()[:16]
    return out


# Repetitions per timer: a stable median at every site, few enough that the tuners finish in minutes.
REPS = {"wall": 50, "device": 30, "host": 5}


def time_ms(fn, timer: str = "wall") -> float:
    """Median ms of fn with one of scaffold.bench.timing's timers (host: 40 calls a repetition)."""
    return measure(fn, timer=timer, reps=REPS[timer], calls=40 if timer == "host" else 1).median


def time_rung(rung: str, fn, timer: str = "wall") -> float:
    """Median ms of fn on one rung (`time_ms`'s timer): `cudnn_det` under deterministic cuDNN without
    algorithm search (the vendor rung in training), the others under the caller's cuDNN flags."""
    if rung != "cudnn_det":
        return time_ms(fn, timer)
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True,
                                    allow_tf32=torch.backends.cudnn.allow_tf32):
        return time_ms(fn, timer)


def site_route(site: Site):
    """The measured route of a site on this GPU in bf16 (routes.py: each direction's rung name),
    None when its shape has none."""
    from scaffold.model import routes

    route = routes.ROUTES.get(site_key(site))
    return None if route is None else list(route)


def _column(rung: str) -> str:
    return {"triton": "triton", "gluon": GLUON}.get(rung, "cudnn_det")


def bench_site(site: Site, batch: int = 1, rungs=RUNGS, timer: str = "wall", gluon: bool = True) -> dict:
    """Times of each rung and direction at a site; `gluon`: also the Gluon kernel where it takes the
    site and direction (keys `gluon_<direction>_ms`; absent elsewhere)."""
    x, w, b, dy = site_tensors(site, batch)
    row = {"site": describe(site), "gflop": flops(site, batch) / 1e9}
    calls = {"triton": triton_calls(site, x, w, b, dy)}
    calls["cudnn"] = calls["cudnn_det"] = vendor_calls(site, x, w, b, dy)
    timed = list(rungs)
    if gluon:
        calls[GLUON] = gluon_calls(site, x, w, b, dy)
        timed.append(GLUON)
    for d in DIRECTIONS:
        for rung in timed:
            if d not in calls[rung]:
                continue
            try:
                row[f"{rung}_{d}_ms"] = time_rung(rung, calls[rung][d], timer)
            except Exception as e:  # one failing direction must not lose the rest of the table
                row[f"{rung}_{d}_ms"] = None
                row[f"{rung}_{d}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    route = site_route(site)
    row["route"] = route
    if "triton" in rungs and "cudnn_det" in rungs:
        for i, d in enumerate(DIRECTIONS):
            row[f"routed_{d}_ms"] = row.get(f"{_column(route[i] if route else 'vendor')}_{d}_ms")
    return row


def bench_model(scale: int, names: list[str] | None = None, batch: int = 1, log=print,
                timer: str = "wall") -> dict:
    torch.backends.cudnn.benchmark = True
    rows, totals = [], {f"{r}_{d}": 0.0 for r in COLUMNS for d in DIRECTIONS}
    for site in conv_sites(scale):
        if not site.matches(names):
            continue
        row = bench_site(site, batch, timer=timer)
        row["count"] = site.count
        rows.append(row)
        for key in totals:
            if row.get(f"{key}_ms") is not None and totals[key] is not None:
                totals[key] += site.count * row[f"{key}_ms"]
            else:
                totals[key] = None
        log(format_row(row))
        torch.cuda.empty_cache()
    return {"scale": scale, "timer": timer, "rows": rows, "totals_ms": totals}


def _fmt(v, spec="7.3f"):
    return "   n/a " if v is None else format(v, spec)


def format_row(row: dict) -> str:
    """One line per site: its route (T: Triton, G: Gluon, v: vendor, -: none), then per direction
    Triton / cuDNN (search) / cuDNN (deterministic) in ms, [Gluon where timed,] the ratio Triton /
    cuDNN (search) and Triton's TFLOP/s."""
    s = row["site"]
    route = "".join({"triton": "T", "gluon": "G"}.get(r, "v") for r in row["route"]) if row.get("route") else "---"
    name = f"{s['name']} {s['cin']}>{s['cout']}@{s['edge']}"
    parts = [f"{name[:30]:30s} x{row['count']} {route}"]
    for d in DIRECTIONS:
        t, c, v = (row.get(f"{r}_{d}_ms") for r in RUNGS)
        g = row.get(f"{GLUON}_{d}_ms")
        ratio = (t / c) if (t and c) else None
        tf = row["gflop"] / t if t else None
        gluon = f" G {_fmt(g)}" if g is not None else ""
        parts.append(f"{d[:6]:>6s} {_fmt(t)}/{_fmt(c)}/{_fmt(v)}{gluon} ({_fmt(ratio, '4.2f')}x, "
                     f"{_fmt(tf, '4.0f')} TF/s)")
    return " | ".join(parts)


def format_totals(result: dict) -> str:
    t = result["totals_ms"]
    lines = [f"scale {result['scale']} totals over every site (count-weighted), ms, "
             f"{result['timer']} time:"]
    for rung in COLUMNS:
        per = [t.get(f"{rung}_{d}") for d in DIRECTIONS]
        if None in per:
            lines.append(f"  {rung:<10} incomplete (a direction failed)")
            continue
        lines.append(f"  {rung:<10} {sum(per):8.2f}  [" +
                     ", ".join(f"{d} {a:.2f}" for d, a in zip(DIRECTIONS, per)) + "]")
    return "\n".join(lines)


def parse_scales(p: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s]
    except ValueError:
        p.error(f"--scale={text!r}: expected comma-separated integers such as 7,8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="7", help="comma-separated scales, e.g. 7,8")
    p.add_argument("--sites", default="", help="comma-separated substrings of the sites' module "
                   "names (e.g. inc.conv1,ups.0.up,outc) to keep")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--timer", default="wall", choices=TIMERS,
                   help="wall: as launched from Python (host launch cost included where it "
                        "dominates); device: CUDA-graph replays, the device time alone; host: the "
                        "host's launch cost alone")
    p.add_argument("--reps", type=int, default=0,
                   help="timed repetitions per direction (default: %s by timer); 1 for sizes where a "
                        "call takes seconds (scale 9)" % ", ".join(f"{k} {v}" for k, v in REPS.items()))
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args(argv)
    scales = parse_scales(p, args.scale)
    if args.reps > 0:
        REPS[args.timer] = args.reps
    if not torch.cuda.is_available():
        print("scaffold.bench.conv: needs a CUDA GPU (cuDNN is the baseline)", file=sys.stderr)
        return 2
    names = [n for n in args.sites.split(",") if n] or None
    results = [bench_model(s, names, args.batch, timer=args.timer) for s in scales]
    for r in results:
        print(format_totals(r))
    if args.out:
        write_json(args.out, {"device": torch.cuda.get_device_name(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
