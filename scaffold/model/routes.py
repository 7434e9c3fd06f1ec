"""The measured routes of the `routed` convolution rung (what `ladder.conv=auto` runs on CUDA): data.

A conv site has three kernels per step: forward, backward-data and backward-weight (a bias gradient
runs on our kernel whatever the route: scaffold.model.conv). For each *measured* shape this table says
which of them run our Triton kernels and which cuDNN with deterministic algorithms (through ATen, as
the vendor rung runs them in training), so that `auto` takes the faster of the two per direction; an
all-vendor shape with a bias still takes the routed rung, for that gradient. Both sides are
deterministic, and the route is a table lookup on (arch, dtype, op, channels, geometry, spatial size),
never a timing race at run time, so a run's bits depend only on (device, dtype, shape) as before. A
shape not in the table is not routed: `auto` runs it all on vendor (`ladder.conv=triton` forces every
direction onto Triton), except a shape where an operand has 2^31 elements or more (`beyond_int32`):
there cuDNN leaves its tiled kernels for direct convolutions with 64-bit indices, measured on the H200
at scale 9 up to a thousand times slower than our kernels (whose offsets are int64 throughout), so such
a shape runs on Triton when unmeasured, and the tuner, which times only ours there, gives each of its
directions to the faster of Triton and Gluon.

`python -m scaffold.bench.tune_routes` times both sides per site and direction on the GPU the table is for and
rewrites the ROUTES block below. Keys: arch|dtype|op|cin>cout|geometry|DxHxW of the conv's input
(batch excluded: the routes were measured at batch 1); values: the rung of forward, backward-data and
backward-weight: 'triton', 'vendor', or 'gluon' (our Gluon kernels for Hopper, the three directions
of the 3×3×3 convs whose channels are multiples of 64; where one declines an operand at run time,
e.g. one not contiguous in NDHWC, the Triton launcher runs that call).
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch

from scaffold.kernels.lib.device import arch_key, dtype_key

TRITON = "triton"
VENDOR = "vendor"
GLUON = "gluon"  # our Gluon kernels for Hopper: the three directions of 3×3×3 convs only

# BEGIN ROUTES (written by python -m scaffold.bench.tune_routes; values: forward, backward-data, backward-weight)
ROUTES: dict[str, tuple[str, str, str]] = {
    "sm90|bf16|convT|1024>512|k2s2p0d1|16x16x16": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|convT|1024>512|k2s2p0d1|8x8x8": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|convT|128>64|k2s2p0d1|128x128x128": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|convT|128>64|k2s2p0d1|64x64x64": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|convT|2048>1024|k2s2p0d1|8x8x8": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|convT|256>128|k2s2p0d1|32x32x32": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|convT|256>128|k2s2p0d1|64x64x64": ('triton', 'vendor', 'triton'),
    "sm90|bf16|convT|512>256|k2s2p0d1|16x16x16": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|convT|512>256|k2s2p0d1|32x32x32": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|conv|1024>1024|k3s1p1d1|16x16x16": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|1024>1024|k3s1p1d1|8x8x8": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|1024>2048|k3s1p1d1|8x8x8": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|conv|1024>512|k3s1p1d1|16x16x16": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|1024>512|k3s1p1d1|32x32x32": ('vendor', 'vendor', 'gluon'),
    "sm90|bf16|conv|128>128|k3s1p1d1|128x128x128": ('vendor', 'vendor', 'gluon'),
    "sm90|bf16|conv|128>128|k3s1p1d1|256x256x256": ('gluon', 'gluon', 'gluon'),
    "sm90|bf16|conv|128>128|k3s1p1d1|64x64x64": ('vendor', 'vendor', 'gluon'),
    "sm90|bf16|conv|128>256|k3s1p1d1|32x32x32": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|128>256|k3s1p1d1|64x64x64": ('vendor', 'vendor', 'gluon'),
    "sm90|bf16|conv|128>64|k3s1p1d1|128x128x128": ('gluon', 'vendor', 'gluon'),
    "sm90|bf16|conv|128>64|k3s1p1d1|256x256x256": ('gluon', 'gluon', 'gluon'),
    "sm90|bf16|conv|128>64|k3s1p1d1|512x512x512": ('gluon', 'triton', 'gluon'),
    "sm90|bf16|conv|2048>1024|k3s1p1d1|16x16x16": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|2048>2048|k3s1p1d1|8x8x8": ('triton', 'vendor', 'vendor'),
    "sm90|bf16|conv|256>128|k3s1p1d1|128x128x128": ('vendor', 'vendor', 'gluon'),
    "sm90|bf16|conv|256>128|k3s1p1d1|256x256x256": ('gluon', 'gluon', 'gluon'),
    "sm90|bf16|conv|256>128|k3s1p1d1|64x64x64": ('vendor', 'vendor', 'gluon'),
    "sm90|bf16|conv|256>256|k3s1p1d1|32x32x32": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|256>256|k3s1p1d1|64x64x64": ('vendor', 'vendor', 'gluon'),
    "sm90|bf16|conv|256>512|k3s1p1d1|16x16x16": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|256>512|k3s1p1d1|32x32x32": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|3>64|k3s1p1d1|128x128x128": ('triton', 'triton', 'triton'),
    "sm90|bf16|conv|3>64|k3s1p1d1|256x256x256": ('triton', 'triton', 'triton'),
    "sm90|bf16|conv|512>1024|k3s1p1d1|16x16x16": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|512>1024|k3s1p1d1|8x8x8": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|512>256|k3s1p1d1|32x32x32": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|512>256|k3s1p1d1|64x64x64": ('vendor', 'vendor', 'gluon'),
    "sm90|bf16|conv|512>512|k3s1p1d1|16x16x16": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|512>512|k3s1p1d1|32x32x32": ('vendor', 'vendor', 'vendor'),
    "sm90|bf16|conv|64>128|k3s1p1d1|128x128x128": ('vendor', 'gluon', 'gluon'),
    "sm90|bf16|conv|64>128|k3s1p1d1|256x256x256": ('triton', 'gluon', 'gluon'),
    "sm90|bf16|conv|64>128|k3s1p1d1|64x64x64": ('vendor', 'gluon', 'gluon'),
    "sm90|bf16|conv|64>64|k3s1p1d1|128x128x128": ('gluon', 'gluon', 'gluon'),
    "sm90|bf16|conv|64>64|k3s1p1d1|256x256x256": ('gluon', 'gluon', 'gluon'),
    "sm90|bf16|conv|64>64|k3s1p1d1|512x512x512": ('gluon', 'gluon', 'gluon'),
    "sm90|bf16|conv|64>6|k1s1p0d1|128x128x128": ('triton', 'triton', 'vendor'),
    "sm90|bf16|conv|64>6|k1s1p0d1|256x256x256": ('triton', 'triton', 'vendor'),
}
# END ROUTES


def _dims(v: Sequence[int]) -> str:
    """'3' for an isotropic triple, '3x3x1' otherwise."""
    v = [int(a) for a in v]
    return str(v[0]) if len(set(v)) == 1 else "x".join(map(str, v))


@functools.lru_cache(maxsize=1024)  # a pure function of its (hashable) arguments; called per conv call
def route_key(arch: str, dtype: torch.dtype, op: str, cin: int, cout: int, kernel: Sequence[int],
              stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
              spatial: Sequence[int]) -> str:
    """The table key of one conv call: op is 'conv' or 'convT'; `spatial` is the input's (D, H, W)."""
    geometry = f"k{_dims(kernel)}s{_dims(stride)}p{_dims(padding)}d{_dims(dilation)}"
    return (f"{arch}|{dtype_key(dtype)}|{op}|{cin}>{cout}|{geometry}|"
            + "x".join(str(int(s)) for s in spatial))


INT32_MAX = 2**31 - 1


def beyond_int32(x_shape: Sequence[int], w_shape: Sequence[int], stride, padding, dilation,
                 transposed: bool = False) -> bool:
    """Whether a conv call's input or output has more elements than a 32-bit index reaches (the
    weight is small), for kernel = stride transposed convs with no padding as the model makes them.
    Shapes are (N, C, D, H, W); the weight is (Cout, Cin, k...) or (Cin, Cout, k...) transposed."""
    n = int(x_shape[0])
    if transposed:
        cout = int(w_shape[1])
        out = [int(s) * int(st) for s, st in zip(x_shape[2:], stride)]
    else:
        cout = int(w_shape[0])
        out = [(int(s) + 2 * int(p) - int(d) * (int(k) - 1) - 1) // int(st) + 1
               for s, k, st, p, d in zip(x_shape[2:], w_shape[2:], stride, padding, dilation)]
    numel_in = math.prod(int(s) for s in x_shape)
    numel_out = n * cout * math.prod(max(s, 0) for s in out)
    return max(numel_in, numel_out) > INT32_MAX


def lookup(x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation,
           transposed: bool = False) -> Optional[tuple]:
    """(forward, backward-data, backward-weight) for this call, each True (Triton), GLUON (our Gluon
    kernels, scaffold.kernels.conv.gluon and .gluon_wgrad) or False (vendor), or None when its shape was
    never measured and fits 32-bit indices (all Triton when it does not: see the module's docstring).
    The dtype is the one the conv computes in (autocast's, when it is on). Metadata only: no host
    sync."""
    kind = x.device.type
    autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    dtype = torch.get_autocast_dtype(kind) if autocast else x.dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    cin, cout = (weight.shape[0], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[0])
    key = route_key(arch_key(x.device), dtype, "convT" if transposed else "conv", cin, cout,
                    tuple(weight.shape[2:]), tuple(stride), tuple(padding), tuple(dilation),
                    tuple(x.shape[2:]))
    entry = ROUTES.get(key)
    if entry is None:
        large = beyond_int32(x.shape, weight.shape, stride, padding, dilation, transposed)
        return (True, True, True) if large else None
    return tuple(GLUON if rung == GLUON else rung == TRITON for rung in entry)
