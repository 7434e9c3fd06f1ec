"""Benchmark every conv site of the U-Net: Triton kernels against cuDNN, in the same run.

    python -m scaffold.bench.conv --scale 7,8 [--sites stem,head] [--timer wall|device|host]
                                  [--out conv.json]

For each site (stem, each 3×3×3 conv, the transposed convs, the 1×1×1 head) and each direction
(forward, backward-data, backward-weight incl. the bias gradient) it times, on the same bf16 NDHWC
tensors: the Triton launchers (`triton`), cuDNN with algorithm search (`cudnn`: cudnn.benchmark on,
cuDNN's best), and cuDNN restricted to deterministic algorithms without search (`cudnn_det`: what the
vendor rung runs in training). `routed` is what `ladder.conv=auto` runs: per direction, the Triton
time where the measured route (scaffold/kernels/routes.py) takes Triton, else the `cudnn_det` time.
Medians of triton.testing.do_bench (`--timer wall`, the default) or of CUDA-graph replays (`--timer
device`: device time without the host's launch cost, which dominates the small sites as launched from
Python), or the host's launch cost alone (`--timer host`: Python, dispatch and launchers, timed
while the device is held busy), ratios, TFLOP/s, and per-model totals where each site is weighted by
how often it occurs in the model. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

import torch
from scaffold.bench import write_json

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
RUNGS = ("triton", "cudnn", "cudnn_det")  # timed
COLUMNS = RUNGS + ("routed",)  # routed: per direction, triton or cudnn_det as the route table says


@dataclass(frozen=True)
class Site:
    """One conv site of the model: `edge` is the input's spatial edge."""
    name: str
    kind: str  # conv | convT
    cin: int
    cout: int
    edge: int
    k: int
    pad: int
    bias: bool

    @property
    def geometry(self) -> tuple:
        """(stride, padding, dilation) of the site's conv: transposed convs have stride = kernel = 2."""
        stride = (self.k,) * 3 if self.kind == "convT" else (1, 1, 1)
        return stride, (self.pad,) * 3, (1, 1, 1)

    @property
    def out_edge(self) -> int:
        return self.edge * 2 if self.kind == "convT" else self.edge

    def flops(self, batch: int = 1) -> float:
        """Multiply-adds × 2 of one direction (all three directions cost the same)."""
        voxels = batch * self.edge ** 3  # input voxels for convT, output voxels for conv (same edge)
        return 2.0 * voxels * self.cin * self.cout * self.k ** 3


def model_sites(scale: int, base: int = 64, bottleneck: int = 3, classes: int = 6) -> list[Site]:
    """Every conv site of the U-Net at `scale`, in forward order (repeated shapes included)."""
    levels = scale - bottleneck
    edge = 2 ** scale
    w = [base * 2 ** i for i in range(levels + 1)]
    sites = [Site("stem", "conv", 3, w[0], edge, 3, 1, False),
             Site(f"inc2 {w[0]}@{edge}", "conv", w[0], w[0], edge, 3, 1, False)]
    for i in range(1, levels + 1):
        e = edge >> i
        sites.append(Site(f"down{i}a {w[i-1]}>{w[i]}@{e}", "conv", w[i - 1], w[i], e, 3, 1, False))
        sites.append(Site(f"down{i}b {w[i]}@{e}", "conv", w[i], w[i], e, 3, 1, False))
    for i in range(levels, 0, -1):
        e = edge >> i
        sites.append(Site(f"up{i}T {w[i]}>{w[i-1]}@{e}", "convT", w[i], w[i - 1], e, 2, 0, True))
        sites.append(Site(f"up{i}a {w[i]}>{w[i-1]}@{2*e}", "conv", w[i], w[i - 1], 2 * e, 3, 1, False))
        sites.append(Site(f"up{i}b {w[i-1]}@{2*e}", "conv", w[i - 1], w[i - 1], 2 * e, 3, 1, False))
    sites.append(Site("head", "conv", w[0], classes, edge, 1, 0, True))
    return sites


def distinct_sites(sites: list[Site]) -> list[tuple[Site, int]]:
    """Sites of equal shape are timed once and counted `count` times."""
    seen: dict[tuple, list] = {}
    for s in sites:
        key = (s.kind, s.cin, s.cout, s.edge, s.k, s.pad, s.bias)
        if key in seen:
            seen[key][1] += 1
        else:
            seen[key] = [s, 1]
    return [(s, n) for s, n in seen.values()]


def site_tensors(site: Site, batch: int = 1, seed: int = 0, dtype=torch.bfloat16):
    """Random bf16 NDHWC operands of a site: x, w, bias (or None), dy."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cl = torch.channels_last_3d
    e, eo = site.edge, site.out_edge

    def rnd(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32) * scale
        return t.to(dtype).contiguous(memory_format=cl) if t.dim() == 5 else t.to(dtype)

    wshape = ((site.cin, site.cout) if site.kind == "convT" else (site.cout, site.cin)) + (site.k,) * 3
    fan_in = site.cin * site.k ** 3
    x = rnd(batch, site.cin, e, e, e)
    w = rnd(*wshape, scale=fan_in ** -0.5)
    b = rnd(site.cout) if site.bias else None
    dy = rnd(batch, site.cout, eo, eo, eo)
    return x, w, b, dy


def triton_calls(site: Site, x, w, b, dy) -> dict:
    """The Triton launchers of each direction (bias gradient counted with the weight gradient)."""
    from scaffold.kernels import conv as K
    from scaffold.kernels.bias_grad import bias_grad

    geom = site.geometry
    if site.kind == "convT":
        return {
            "fwd": lambda: K.conv_transpose3d_forward(x, w, b),
            "bwd_data": lambda: K.conv_transpose3d_backward_data(dy, w, x.shape),
            "bwd_weight": lambda: (K.conv_transpose3d_backward_weight(dy, x, w.shape, w.dtype),
                                   bias_grad(dy, b.dtype) if b is not None else None),
        }
    return {
        "fwd": lambda: K.conv3d_forward(x, w, b, *geom),
        "bwd_data": lambda: K.conv3d_backward_data(dy, w, x.shape, *geom),
        "bwd_weight": lambda: (K.conv3d_backward_weight(dy, x, w.shape, w.dtype, *geom),
                               bias_grad(dy, b.dtype) if b is not None else None),
    }


def vendor_calls(site: Site, x, w, b, dy) -> dict:
    """cuDNN through ATen: the forward op and convolution_backward with one output mask each."""
    import torch.nn.functional as F

    transposed = site.kind == "convT"
    stride, pad, dilation = site.geometry
    bias_sizes = [site.cout] if b is not None else None

    def backward(mask):
        return torch.ops.aten.convolution_backward(
            dy, x, w, bias_sizes, stride, pad, dilation, transposed, (0, 0, 0), 1, mask)

    fwd = ((lambda: F.conv_transpose3d(x, w, b, stride=stride)) if transposed
           else (lambda: F.conv3d(x, w, b, stride, pad, dilation)))
    return {"fwd": fwd, "bwd_data": lambda: backward([True, False, False]),
            "bwd_weight": lambda: backward([False, True, b is not None])}


def _first(t):
    return t[0] if isinstance(t, tuple) else t


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
                "bwd_weight": ref["bwd_weight"]()[1], "bias": ref["bwd_weight"]()[2]}
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    out = {"site": site.name}
    for d in DIRECTIONS:
        calls = [tri[d]() for _ in range(max(repeats, 2))]
        first = calls[0]
        pairs = [(d, _first(first), [_first(c) for c in calls[1:]])]
        if d == "bwd_weight" and first[1] is not None:
            pairs.append(("bias", first[1], [c[1] for c in calls[1:]]))
        for name, g1, others in pairs:
            r = refs[name]
            err = ((g1.float() - r).norm() / r.norm()).item()
            out[f"{name}_rel_err"] = err
            out[f"{name}_repeat_equal"] = all(torch.equal(g1, g) for g in others)
            raw = g1.detach().float().cpu().contiguous().numpy().tobytes()  # bf16 -> fp32 is exact
            out[f"{name}_sha"] = hashlib.sha256(raw).hexdigest()[:16]
    return out


TIMERS = ("wall", "device", "host")


def time_ms(fn, timer: str = "wall") -> float:
    """Median ms of fn. `wall`: triton.testing.do_bench, launched from Python, so where the device
    finishes first the host's launch cost is what is timed. `device`: replays of a CUDA graph of fn
    (scaffold.bench.timing.graph_ms): the device time alone, what a step pays when its host runs
    ahead. Both clear the L2 before each repetition. `host`: the host's launch cost alone
    (scaffold.bench.timing.host_ms), launched behind a device-side sleep."""
    if timer == "device":
        from scaffold.bench.timing import graph_ms

        return graph_ms(fn, reps=30)
    if timer == "host":
        from scaffold.bench.timing import host_ms

        return host_ms(fn)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def time_rung(rung: str, fn, timer: str = "wall") -> float:
    """Median ms of fn on one rung (`time_ms`'s timer): `cudnn_det` under deterministic cuDNN without
    algorithm search (the vendor rung in training), the others under the caller's cuDNN flags."""
    if rung != "cudnn_det":
        return time_ms(fn, timer)
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True,
                                    allow_tf32=torch.backends.cudnn.allow_tf32):
        return time_ms(fn, timer)


def site_route(site: Site, x, w):
    """The measured route of a site (routes.py), None when its shape has none."""
    from scaffold.kernels.routes import conv_route

    return conv_route(x, w, *site.geometry, transposed=site.kind == "convT")


def bench_site(site: Site, batch: int = 1, rungs=RUNGS, timer: str = "wall") -> dict:
    x, w, b, dy = site_tensors(site, batch)
    row = {"site": asdict(site), "gflop": site.flops(batch) / 1e9}
    calls = {"triton": triton_calls(site, x, w, b, dy)}
    calls["cudnn"] = calls["cudnn_det"] = vendor_calls(site, x, w, b, dy)
    for d in DIRECTIONS:
        for rung in rungs:
            try:
                row[f"{rung}_{d}_ms"] = time_rung(rung, calls[rung][d], timer)
            except Exception as e:  # one failing direction must not lose the rest of the table
                row[f"{rung}_{d}_ms"] = None
                row[f"{rung}_{d}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    route = site_route(site, x, w)
    row["route"] = None if route is None else ["triton" if t else "vendor" for t in route]
    if "triton" in rungs and "cudnn_det" in rungs:
        for i, d in enumerate(DIRECTIONS):
            row[f"routed_{d}_ms"] = row[f"{'triton' if route and route[i] else 'cudnn_det'}_{d}_ms"]
    return row


def bench_model(scale: int, names: list[str] | None = None, batch: int = 1, log=print,
                timer: str = "wall") -> dict:
    torch.backends.cudnn.benchmark = True
    rows, totals = [], {f"{r}_{d}": 0.0 for r in COLUMNS for d in DIRECTIONS}
    for site, count in distinct_sites(model_sites(scale)):
        if names and not any(n in site.name for n in names):
            continue
        row = bench_site(site, batch, timer=timer)
        row["count"] = count
        rows.append(row)
        for key in totals:
            if row.get(f"{key}_ms") is not None and totals[key] is not None:
                totals[key] += count * row[f"{key}_ms"]
            else:
                totals[key] = None
        log(format_row(row))
        torch.cuda.empty_cache()
    return {"scale": scale, "timer": timer, "rows": rows, "totals_ms": totals}


def _fmt(v, spec="7.3f"):
    return "   n/a " if v is None else format(v, spec)


def format_row(row: dict) -> str:
    """One line per site: its route (T: Triton, v: vendor, -: none), then per direction Triton / cuDNN
    (search) / cuDNN (deterministic) in ms, the ratio Triton / cuDNN (search) and Triton's TFLOP/s."""
    s = row["site"]
    route = "".join("Tv"[r != "triton"] for r in row["route"]) if row.get("route") else "---"
    parts = [f"{s['name'][:24]:24s} x{row['count']} {route}"]
    for d in DIRECTIONS:
        t, c, v = (row.get(f"{r}_{d}_ms") for r in RUNGS)
        ratio = (t / c) if (t and c) else None
        tf = row["gflop"] / t if t else None
        parts.append(f"{d[:6]:>6s} {_fmt(t)}/{_fmt(c)}/{_fmt(v)} ({_fmt(ratio, '4.2f')}x, "
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="7", help="comma-separated scales, e.g. 7,8")
    p.add_argument("--sites", default="", help="comma-separated substrings of site names to keep")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--timer", default="wall", choices=TIMERS,
                   help="wall: do_bench as launched from Python (host launch cost included where "
                        "it dominates); device: CUDA-graph replays, the device time alone; host: "
                        "the host's launch cost alone")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        scales = [int(s) for s in args.scale.split(",") if s]
    except ValueError:
        p.error(f"--scale={args.scale!r}: expected comma-separated integers such as 7,8")
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
