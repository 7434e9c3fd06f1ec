"""The U-Net's operator sites, read off the model itself: what the benchmarks and tuners time.

`model_sites` builds scaffold.model.unet.UNet3d on meta tensors (shapes only: no memory, no kernels),
hooks its ladder modules (convolutions, transposed convolutions, GroupNorms, skip concats, max pools),
runs one forward on a (1, 3, E, E, E) input, E = 2^scale, and records what each module was called with.
The benchmarks so time exactly the calls the model makes, and follow the model when it changes.

The meta tensors are torch's fake tensors (FakeTensorMode: meta storage under a CPU device label), not
plain `device="meta"` ones: the ladder modules ask autocast about their input's device type, which
the meta device cannot answer. Every site runs its vendor op here, which is all shapes need.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from scaffold.config import LadderConfig, ModelConfig

OPS = ("conv", "conv_transpose", "group_norm", "concat", "pool")  # the ladder's operator kinds


@dataclass(frozen=True)
class Site:
    """One ladder call of the model, or (from `distinct`) every call of one geometry.

    Shapes are (N, C, D, H, W) as the module saw them; `weight` is the conv weight's shape (Cout, Cin,
    k, k, k), or (Cin, Cout, k, k, k) for a transposed conv; `groups` is the conv's groups or the
    GroupNorm's number of groups."""
    names: tuple[str, ...]  # the modules making this call, in forward order
    op: str
    inputs: tuple[tuple[int, ...], ...]
    output: tuple[int, ...]
    weight: Optional[tuple[int, ...]] = None
    bias: bool = False
    stride: Optional[tuple[int, ...]] = None
    padding: Optional[tuple[int, ...]] = None
    dilation: Optional[tuple[int, ...]] = None
    groups: int = 1

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def count(self) -> int:
        """How many modules of the model make this call."""
        return len(self.names)

    @property
    def cin(self) -> int:
        return self.inputs[0][1]

    @property
    def cout(self) -> int:
        return self.output[1]

    @property
    def edge(self) -> int:
        """The first input's spatial edge (the model's volumes are cubes)."""
        return self.inputs[0][2]

    def matches(self, patterns: Optional[Sequence[str]]) -> bool:
        """Whether any module name contains any of `patterns` (None or empty: every site)."""
        return not patterns or any(p in n for p in patterns for n in self.names)


def _record(name: str, module, args: tuple, out) -> Site:
    shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
    out = out[0] if isinstance(out, tuple) else out  # the pool with its skip: (pooled, input)
    site = Site((name,), module.op, shapes, tuple(out.shape))
    if module.op in ("conv", "conv_transpose"):
        return replace(site, weight=tuple(module.weight.shape), bias=module.bias is not None,
                       stride=tuple(module.stride), padding=tuple(module.padding),
                       dilation=tuple(module.dilation), groups=module.groups)
    if module.op == "group_norm":
        return replace(site, groups=module.num_groups)
    return site


def model_sites(scale: int, ops: Sequence[str] = OPS, model: Optional[ModelConfig] = None,
                classes: int = 6) -> list[Site]:
    """Every call of the listed operator kinds that one forward of the U-Net at `scale` makes (batch 1),
    in forward order; `model` defaults to ModelConfig()'s widths, depth and groups."""
    m = model or ModelConfig()
    return [s for s in _walk(scale, m.bottleneck, m.base_width, m.groups, classes) if s.op in ops]


@functools.lru_cache(maxsize=None)  # a pure function of its arguments; benchmarks and tests ask again
def _walk(scale: int, bottleneck: int, base_width: int, groups: int, classes: int) -> tuple[Site, ...]:
    from scaffold.model.ladder import LadderSite
    from scaffold.model.unet import UNet3d

    vendor = LadderConfig(**{f.name: "vendor" for f in fields(LadderConfig)})
    sites: list[Site] = []
    with FakeTensorMode(), torch.no_grad():
        net = UNet3d(scale, bottleneck, base_width, groups, 3, classes, ladder=vendor)
        for name, module in net.named_modules():
            if isinstance(module, LadderSite):
                module.register_forward_hook(
                    lambda mod, args, out, name=name: sites.append(_record(name, mod, args, out)))
        net(torch.empty((1, 3) + (2**scale,) * 3))
    return tuple(sites)


def distinct(sites: Sequence[Site]) -> list[Site]:
    """The sites of equal call merged into one (its `names` all of theirs), in order of first call."""
    merged: dict[Site, Site] = {}
    for s in sites:
        key = replace(s, names=())
        merged[key] = replace(s, names=merged[key].names + s.names) if key in merged else s
    return list(merged.values())
