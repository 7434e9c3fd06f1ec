"""Host cost of a Triton conv launch, three ways, at one scale-7 site's forward (default down4a):
the whole launcher, the JIT launch alone (kernel[grid](...) with the launcher's own arguments), and
the compiled kernel's runner, which skips the JIT's argument binding and specialization (a floor:
measurement only, nothing in the package launches this way). Needs a CUDA GPU.

    python scripts/launch_cost.py [site-prefix]
"""
import sys

import torch

from scaffold.bench.conv import distinct_sites, model_sites, site_tensors, triton_calls
from scaffold.bench.timing import host_ms
from scaffold.kernels import conv_box


def main():
    prefix = sys.argv[1] if len(sys.argv) > 1 else "down4a"
    site = next(s for s, _ in distinct_sites(model_sites(7)) if s.name.startswith(prefix))
    x, w, b, dy = site_tensors(site)
    fwd = triton_calls(site, x, w, b, dy)["fwd"]
    jit = conv_box._conv_box_kernel
    seen = {}
    orig = jit.run

    def spy(*args, grid, warmup, **kwargs):
        k = orig(*args, grid=grid, warmup=warmup, **kwargs)
        seen.setdefault("call", (args, grid, kwargs, k))
        return k
    jit.run = spy
    fwd()
    jit.run = orig
    args, grid, kwargs, kern = seen["call"]
    names = jit.arg_names
    bound = list(args) + [kwargs[n] for n in names[len(args):]]
    launch_kw = {k: v for k, v in kwargs.items() if k not in names}
    print("whole launcher   us", host_ms(fwd) * 1e3)
    print("jit launch       us", host_ms(lambda: jit[grid](*args, **kwargs)) * 1e3)
    runner = kern[tuple(grid) + (1,) * (3 - len(grid))]
    print("compiled runner  us", host_ms(lambda: runner(*bound)) * 1e3)
    e = torch.empty(1, device="cuda")
    print("torch.empty      us", host_ms(lambda: torch.empty((1, 64, 8, 8, 8), device="cuda")) * 1e3)
    print("x.add_(1) launch us", host_ms(lambda: e.add_(1)) * 1e3)
    from triton.tools.tensor_descriptor import TensorDescriptor
    v = x.permute(0, 2, 3, 4, 1)
    print("from_tensor      us", host_ms(lambda: TensorDescriptor.from_tensor(v, [1, 8, 8, 8, 64])) * 1e3)
    print("launch kwargs", launch_kw, "nargs", len(bound))


if __name__ == "__main__":
    main()
