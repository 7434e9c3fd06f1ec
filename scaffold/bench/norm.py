"""GroupNorm(+ReLU) and skip-concat sites of the U-Net: Triton against ATen eager and torch.compile.

    python -m scaffold.bench.norm [--scales 7 8] [--out norm.json] [--no-compile]

The sites are the model's own (scaffold.bench.sites), each run as the model runs it: bf16 channels-last
input, bf16 autocast, the model's groups, ReLU after the norm. Methods, all measured in the same process
on the same inputs:
  aten         F.group_norm then F.relu (autocast runs group_norm in fp32: fp32 output)
  compile      the same two calls through torch.compile
  triton       scaffold.kernels.groupnorm.group_norm (fp32 output, like ATen)
  triton_bf16  the same writing bf16 (what the next convolution casts to anyway), so dy is bf16 too
Forward is timed with autograd recording (as in training); backward is the gradient of x, weight and bias.
Each number is the median over repetitions with the L2 cache flushed before each (scaffold.bench.timing).
On CUDA the table gives device time (the call captured once in a CUDA graph and replayed: what a
training step pays when its host runs ahead, as the trainer's does); the JSON also holds `wall_*`
figures, the call as launched from Python, host launch cost included. The backward's device time is
that of forward + backward captured together minus the forward's. Achieved bandwidth
counts the fewest bytes each direction must move (each input read once, each output written once)
against the 4.8 TB/s of an H200. Concat sites: torch.cat then the cast to bf16 (stock autocast: cat
promotes to fp32, the consumer casts) against one Triton kernel, forward and backward.

The row `stream` is not a GroupNorm: it is the device time of ATen's own streaming kernels making the
same passes over bf16 data that the Triton GroupNorm makes (forward: one full reduction of x, then a
copy x -> y; backward: reductions of x and of dy, then dx = x + dy), a measured ceiling for this
two-pass algorithm on this device, beside the 4.8 TB/s datasheet floor.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from scaffold.bench import write_json
from scaffold.bench.sites import distinct, model_sites
from scaffold.bench.timing import measure
from scaffold.config import ModelConfig

PEAK_BYTES_PER_S = 4.8e12
EPS = 1e-5
CL = torch.channels_last_3d


def norm_sites(scale: int) -> list[dict]:
    """Distinct GroupNorm shapes of the model, in forward order, and how many sites have each."""
    return [dict(channels=s.cin, edge=s.edge, groups=s.groups, count=s.count)
            for s in distinct(model_sites(scale, ("group_norm",)))]


def concat_sites(scale: int) -> list[dict]:
    """The skip concats (the skip and the upsampled tensor have one width and edge), narrowest first
    as the GroupNorm rows."""
    sites = distinct(model_sites(scale, ("concat",)))
    return sorted((dict(channels=s.cin, edge=s.edge, count=s.count) for s in sites),
                  key=lambda site: site["channels"])


def wall_ms(fn) -> float:
    """Median ms of fn() as launched from Python (the host clock on the CPU, a smoke test only)."""
    return measure(fn, device=_device()).median


def device_ms(fn) -> float:
    """Median device ms of fn() from CUDA-graph replays."""
    return measure(fn, timer="device").median


def _failure(exc: Exception) -> str:
    """One line for a method that failed, kept in the results so the other methods' numbers survive."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _aten(x, w, b, groups):
    return F.relu(F.group_norm(x, groups, w, b, EPS), inplace=True)


def norm_methods(compile_too: bool) -> dict:
    from scaffold.kernels.groupnorm import group_norm

    methods = {
        "aten": _aten,
        "triton": lambda x, w, b, groups: group_norm(x, groups, w, b, EPS, True),
        "triton_bf16": lambda x, w, b, groups: group_norm(x, groups, w, b, EPS, True,
                                                          out_dtype=torch.bfloat16),
    }
    if compile_too:
        # The timing replays one backward graph many times (retain_graph): no donated buffers.
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        for key in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, key):
                setattr(torch._dynamo.config, key, 256)
        methods["compile"] = torch.compile(_aten, dynamic=False)
    return methods


def bench_norm_site(site: dict, methods: dict, seed: int = 0) -> dict:
    C, edge, G = site["channels"], site["edge"], site["groups"]
    g = torch.Generator(device=_device()).manual_seed(seed)
    x = torch.randn((1, C, edge, edge, edge), generator=g, device=_device()).to(torch.bfloat16)
    x = x.contiguous(memory_format=CL).requires_grad_()
    w = (1 + 0.1 * torch.randn(C, generator=g, device=_device())).requires_grad_()
    b = (0.1 * torch.randn(C, generator=g, device=_device())).requires_grad_()
    elems = x.numel()
    row = dict(site)
    for name, fn in methods.items():
        r: dict = {}
        if torch.cuda.is_available():
            try:  # device time first, on leaves of its own (see _graph_fwd_bwd)
                r.update(_graph_fwd_bwd(lambda xs, ws, bs, fn=fn: fn(xs, ws, bs, G), (x, w, b)))
            except Exception as exc:
                r["graph_error"] = _failure(exc)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        try:
            with torch.autocast(_device(), dtype=torch.bfloat16):
                y = fn(x, w, b, G)
            dy = torch.randn(y.shape, generator=g, device=_device(), dtype=y.dtype)
            dy = dy.contiguous(memory_format=CL)

            def fwd():
                with torch.autocast(_device(), dtype=torch.bfloat16):
                    return fn(x, w, b, G)

            def bwd():
                torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)

            out_bytes = y.element_size()
            # Fewest bytes: forward reads x, writes y; backward reads x and dy, writes dx.
            floor_bytes = elems * (2 + out_bytes) + elems * (2 + out_bytes + 2)
            r["floor_ms"] = floor_bytes / PEAK_BYTES_PER_S * 1e3
            wf, wb = wall_ms(fwd), wall_ms(bwd)  # as launched from Python, host cost included
            r.update(wall_fwd_ms=wf, wall_bwd_ms=wb, wall_total_ms=wf + wb)
            if "total_ms" not in r:
                r.update(fwd_ms=wf, bwd_ms=wb, total_ms=wf + wb)
            r["tb_per_s"] = floor_bytes / (r["total_ms"] * 1e-3) / 1e12
            row[name] = r
            del y, dy
        except Exception as exc:  # one failing method must not lose the others
            row[name] = dict(error=_failure(exc))
    if torch.cuda.is_available():
        try:
            row["stream"] = stream_reference(x)
        except Exception as exc:
            row["stream"] = dict(error=_failure(exc))
        torch.cuda.empty_cache()
    return row


def stream_reference(x: torch.Tensor) -> dict:
    """Device time of the GroupNorm's passes made by ATen's streaming kernels (see the module doc)."""
    x = x.detach()
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dy = torch.randn_like(x)

    def fwd():
        x.sum(dtype=torch.float32)
        y.copy_(x)

    def bwd():
        x.sum(dtype=torch.float32)
        dy.sum(dtype=torch.float32)
        torch.add(x, dy, out=dx)

    f, b = device_ms(fwd), device_ms(bwd)
    floor_bytes = x.numel() * x.element_size() * 5  # the bf16 GroupNorm's: x, y; x, dy, dx
    return dict(fwd_ms=f, bwd_ms=b, total_ms=f + b, floor_ms=floor_bytes / PEAK_BYTES_PER_S * 1e3)


def _graph_fwd_bwd(fn, inputs: tuple) -> dict:
    """Device time of fn's forward and of forward + backward, from CUDA-graph replays. The inputs are
    re-made as fresh leaves here: autograd nodes created on another stream, kept alive by an earlier
    output, would make the captured backward synchronise with the default stream (a capture error)."""
    leaves = tuple(t.detach().clone().requires_grad_() for t in inputs)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        shape_dtype = fn(*leaves)
    dy = torch.randn(shape_dtype.shape, device="cuda", dtype=shape_dtype.dtype)
    dy = dy.contiguous(memory_format=CL)
    del shape_dtype
    leaves = tuple(t.detach().requires_grad_() for t in leaves)  # drop that forward's graph

    def fwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(*leaves)

    def fwd_bwd():  # the backward must follow a forward captured with it
        torch.autograd.grad(fwd(), leaves, dy)

    gf = device_ms(fwd)
    gfb = device_ms(fwd_bwd)
    return dict(fwd_ms=gf, bwd_ms=max(gfb - gf, 0.0), total_ms=gfb)


def bench_concat_site(site: dict, seed: int = 0) -> dict:
    from scaffold.kernels.concat import concat_channels

    C, edge = site["channels"], site["edge"]
    g = torch.Generator(device=_device()).manual_seed(seed)
    shape = (1, C, edge, edge, edge)

    def make(dtype):
        t = torch.randn(shape, generator=g, device=_device()).to(dtype).contiguous(memory_format=CL)
        return t.requires_grad_()

    cases = {
        "aten": (make(torch.float32), make(torch.bfloat16),
                 lambda a, b: torch.cat([a, b], dim=1).to(torch.bfloat16)),
        "triton": (make(torch.float32), make(torch.bfloat16),
                   lambda a, b: concat_channels(a, b, torch.bfloat16)),
        "triton_bf16_skip": (make(torch.bfloat16), make(torch.bfloat16),
                             lambda a, b: concat_channels(a, b, torch.bfloat16)),
    }
    row = dict(site)
    for name, (a, b, fn) in cases.items():
        try:
            out = fn(a, b)
            dy = torch.randn(out.shape, generator=g, device=_device()).to(out.dtype)
            dy = dy.contiguous(memory_format=CL)
            floor_bytes = 2 * (a.numel() * a.element_size() + b.numel() * 2 + out.numel() * 2)
            r = dict(floor_ms=floor_bytes / PEAK_BYTES_PER_S * 1e3)
            wf = wall_ms(lambda: fn(a, b))
            wb = wall_ms(lambda: torch.autograd.grad(out, (a, b), dy, retain_graph=True))
            r.update(wall_fwd_ms=wf, wall_bwd_ms=wb, wall_total_ms=wf + wb)
            if torch.cuda.is_available():
                try:
                    r.update(_graph_fwd_bwd(lambda p, q, fn=fn: fn(p, q), (a, b)))
                except Exception as exc:
                    r["graph_error"] = _failure(exc)
            if "total_ms" not in r:
                r.update(fwd_ms=wf, bwd_ms=wb, total_ms=wf + wb)
            r["tb_per_s"] = floor_bytes / (r["total_ms"] * 1e-3) / 1e12
            row[name] = r
            del out, dy
        except Exception as exc:
            row[name] = dict(error=_failure(exc))
    return row


def totals(rows: list[dict]) -> dict:
    """Per method: Σ count × (fwd, bwd, total) over the sites."""
    out: dict[str, dict] = {}
    for row in rows:
        for name, r in row.items():
            if isinstance(r, dict) and "total_ms" in r:
                t = out.setdefault(name, dict(fwd_ms=0.0, bwd_ms=0.0, total_ms=0.0, floor_ms=0.0))
                for k in ("wall_fwd_ms", "wall_bwd_ms", "wall_total_ms"):
                    if k in r:
                        t.setdefault(k, 0.0)
                for k in t:
                    t[k] += row["count"] * r[k]
    return out


def format_table(title: str, rows: list[dict], methods: list[str]) -> str:
    head = f"{'site':>12} {'n':>2} " + " ".join(f"{m + ' f/b ms':>24}" for m in methods)
    lines = [title, head]
    for row in rows + [dict(channels="total", edge="", count="", **totals(rows))]:
        cells = []
        for m in methods:
            r = row.get(m, {})
            if "total_ms" in r:
                cells.append(f"{r['fwd_ms']:8.3f}/{r['bwd_ms']:8.3f}" +
                             (f" {r['tb_per_s']:4.2f}TB/s" if "tb_per_s" in r else f" {' ' * 8}"))
            else:
                cells.append(f"{'error' if 'error' in r else '-':>26}")
        site = f"{row['channels']}@{row['edge']}^3" if row["edge"] != "" else "total"
        lines.append(f"{site:>12} {row['count']!s:>2} " + " ".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def run(scales: list[int], compile_too: bool = True, deadline: float = float("inf")) -> dict:
    """Benchmarks every site of each scale; sites not started by `deadline` (a time.time() value) are
    listed as skipped, so a time-limited run still reports what it measured."""
    methods = norm_methods(compile_too)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "scales": {}}
    for scale in scales:
        norm_rows, cat_rows = [], []
        for site in norm_sites(scale):
            timely = time.time() < deadline
            norm_rows.append(bench_norm_site(site, methods) if timely else dict(site, skipped=True))
            torch.cuda.empty_cache()
        for site in concat_sites(scale):
            timely = time.time() < deadline
            cat_rows.append(bench_concat_site(site) if timely else dict(site, skipped=True))
            torch.cuda.empty_cache()
        result["scales"][scale] = dict(norm=norm_rows, norm_totals=totals(norm_rows),
                                       concat=cat_rows, concat_totals=totals(cat_rows))
        print(format_table(f"scale {scale}: GroupNorm+ReLU (device fwd/bwd, achieved vs 4.8 TB/s)", norm_rows,
                           list(methods) + ["stream"]), flush=True)
        print(format_table(f"scale {scale}: skip concat", cat_rows,
                           ["aten", "triton", "triton_bf16_skip"]), flush=True)
        for kind, rows in (("GroupNorm+ReLU", norm_rows), ("concat", cat_rows)):
            walls = {m: t["wall_total_ms"] for m, t in totals(rows).items() if "wall_total_ms" in t}
            print(f"scale {scale} {kind}, as launched from Python (host cost included), total ms: " +
                  ", ".join(f"{m} {v:.2f}" for m, v in walls.items()), flush=True)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", type=int, nargs="+", default=[7, 8])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = p.parse_args(argv)
    bottleneck = ModelConfig().bottleneck
    bad = [s for s in args.scales if not bottleneck < s <= 9]
    if bad:
        raise SystemExit(f"--scales {bad}: expected integers in {bottleneck + 1}..9")
    if not torch.cuda.is_available():
        raise SystemExit("scaffold.bench.norm: needs a CUDA GPU")
    result = run(args.scales, compile_too=not args.no_compile)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
