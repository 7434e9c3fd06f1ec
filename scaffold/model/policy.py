"""The rung policy: which implementation every ladder call runs on. The one place that decides.

A *rung* is one implementation of an operator kind. `vendor` is torch's own op (cuDNN / the CPU
kernels) and is always there; `triton` runs our kernels (scaffold.kernels, imported on first use so
that a missing or broken kernel module only makes the rung unavailable); `routed` (the convolutions)
runs each direction (forward, backward-data, backward-weight) on Triton, on our Gluon kernel for Hopper
or on deterministic cuDNN as a table of measured routes says (scaffold/model/routes.py); `gluon` (the
convolutions, sm_90) runs all three directions of the 3×3×3 convs it takes on the Gluon kernels
(scaffold.kernels.conv.gluon, .gluon_wgrad: GLUON_ROUTE). More rungs can be
registered (tests register fakes); a registered rung is a valid `ladder.<kind>` setting.

The choice is a pure function of (setting, device, the call's metadata): never of a timing race, so
the bits a run produces do not depend on it. Settings:
  auto   - on CUDA the kind's AUTO_RUNG when it supports the call, else vendor; on the CPU always
           vendor (the Triton interpreter is for tests, which force a rung)
  <rung> - that rung where it supports the call, else vendor (the module warns once)
  vendor - always vendor

Each kind has one call type (a NamedTuple: the arguments by name) and one Triton adapter below. A rung
is `supports(call) -> bool` (metadata only, no host sync) and `forward(call)`, autograd-aware, which
under autocast casts like autocast would and returns the dtype vendor returns.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

VENDOR, AUTO, TRITON, ROUTED, GLUON = "vendor", "auto", "triton", "routed", "gluon"


class ConvCall(NamedTuple):
    x: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int


class ConvTransposeCall(NamedTuple):
    x: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    stride: tuple
    padding: tuple
    output_padding: tuple
    groups: int
    dilation: tuple
    out: Optional[torch.Tensor] = None  # where a Triton forward may write the output (FastConvTranspose3d)


class GroupNormCall(NamedTuple):
    x: torch.Tensor
    num_groups: int
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    eps: float
    relu: bool
    out_dtype: Optional[torch.dtype]  # None: as F.group_norm returns (fp32 under autocast)
    room: int = 0  # channels of room to leave after the output for a later concat (FastGroupNorm)


class ConcatCall(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor
    dtype: Optional[torch.dtype]  # the consumer's compute dtype (autocast's), written for both halves
    into_room: bool = False  # a is a GroupNorm output made with room for b (FastConcat)


class PoolCall(NamedTuple):
    x: torch.Tensor  # the 2×2×2 max pool (scaffold.model.pool.max_pool2)
    skip: bool = False  # also return x as a skip connection reads it: (pool(x), x)


class LossCall(NamedTuple):
    logits: torch.Tensor
    labels: torch.Tensor
    weight: torch.Tensor
    eps: float


CALLS = {"conv": ConvCall, "conv_transpose": ConvTransposeCall, "group_norm": GroupNormCall,
         "concat": ConcatCall, "pool": PoolCall, "loss": LossCall}
OPS = tuple(CALLS)


@dataclass(frozen=True)
class Rung:
    supports: Callable[[Any], bool]
    forward: Callable[[Any], Any]


_REGISTRY: dict[str, dict[str, Rung]] = {op: {} for op in OPS}

# The rung `auto` takes on CUDA, per kind, following the measurements in docs/performance.md: our
# GroupNorm, concat, pool and loss kernels beat ATen; for convolutions neither side wins every site
# and direction, so `auto` runs `routed` (unmeasured shapes stay on vendor).
AUTO_RUNG = {"conv": ROUTED, "conv_transpose": ROUTED, "group_norm": TRITON, "concat": TRITON,
             "pool": TRITON, "loss": TRITON}


def register_rung(op: str, name: str, supports: Callable[[Any], bool],
                  forward: Callable[[Any], Any]) -> Optional[Rung]:
    """Adds (or replaces) rung `name` of kind `op`; returns the rung it replaced, if any."""
    if op not in OPS:
        raise ValueError(f"op={op!r}: expected one of {', '.join(OPS)}")
    if name in (VENDOR, AUTO):
        raise ValueError(f"rung name {name!r} is reserved")
    previous = _REGISTRY[op].get(name)
    _REGISTRY[op][name] = Rung(supports, forward)
    return previous


def unregister_rung(op: str, name: str) -> Optional[Rung]:
    """Removes rung `name` of kind `op`; returns it (None when it was not registered)."""
    return _REGISTRY[op].pop(name, None)


def rung(op: str, name: str) -> Rung:
    return _REGISTRY[op][name]


def settings(op: str) -> list[str]:
    """The values `ladder.<op>` accepts: auto, vendor and every registered rung."""
    return [AUTO, *sorted(_REGISTRY[op]), VENDOR]


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def select_rung(op: str, setting: str, call: Any) -> str:
    """The rung a call takes: a pure function of the setting, the device and the call's metadata."""
    if setting == VENDOR:
        return VENDOR
    name = setting
    if setting == AUTO:
        if not _on_cuda(call[0]):
            return VENDOR
        name = AUTO_RUNG[op]
    chosen = _REGISTRY[op].get(name)
    if chosen is None or not chosen.supports(call):
        return VENDOR
    return name


# --- the convolutions' directions ---------------------------------------------------------------

ALL_TRITON = (True, True, True)
# The `gluon` rung: all three directions on the Gluon kernels (scaffold.kernels.conv.gluon, .gluon_wgrad).
GLUON_ROUTE = (GLUON, GLUON, GLUON)


def conv_route(call: ConvCall | ConvTransposeCall) -> Optional[tuple]:
    """(forward, backward-data, backward-weight) of a conv call, each True (Triton), GLUON or False
    (vendor), from the measured routes; None when its shape was never measured."""
    from scaffold.model.routes import lookup

    transposed = isinstance(call, ConvTransposeCall)
    return lookup(call.x, call.weight, call.stride, call.padding, call.dilation, transposed)


# --- the Triton adapters, one per kind, importing their kernels on first use ----------------------

class LadderWarning(UserWarning):
    """A module could not run the rung it was asked for (unsupported call or a failing rung)."""


_LOADED: dict[str, Any] = {}


def kernel_module(name: str) -> Any:
    """The module `name`, or None when it cannot be imported (warned once: the rung is unavailable)."""
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(name)
        except Exception as exc:  # a missing or broken kernel module
            _LOADED[name] = None
            if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "triton":
                why = "Triton is not installed (pip install 'scaffold-unet[triton]')"
            else:
                why = f"{name}: {type(exc).__name__}: {exc}".splitlines()[0]
            warnings.warn(f"Triton rung unavailable, running vendor: {why}", LadderWarning, stacklevel=2)
    return _LOADED[name]


def _supported(module: str, predicate: str, *args) -> bool:
    mod = kernel_module(module)
    return mod is not None and bool(getattr(mod, predicate)(*args))


def _conv_supports(c: ConvCall) -> bool:
    return _supported("scaffold.kernels.conv", "conv3d_supported", *c)


def _conv_transpose_supports(c: ConvTransposeCall) -> bool:
    return _supported("scaffold.kernels.conv", "conv_transpose3d_supported", *c[:8])


def _conv_forward(c: ConvCall, route) -> torch.Tensor:
    return kernel_module("scaffold.model.conv").conv3d(c.x, c.weight, c.bias, c.stride, c.padding,
                                                       c.dilation, route)


def _conv_transpose_forward(c: ConvTransposeCall, route) -> torch.Tensor:
    return kernel_module("scaffold.model.conv").conv_transpose3d(c.x, c.weight, c.bias, c.stride, route,
                                                                 out=c.out)


def _gluon_supports(c: ConvCall) -> bool:
    """Metadata only: a conv the Gluon kernel takes (scaffold.kernels.conv.gluon.takes) in the dtype
    it computes in (autocast's when it is on; the backward-weight kernel takes the same convs), and
    that the Triton launchers take too (any operand a Gluon kernel declines at run time)."""
    gluon = kernel_module("scaffold.kernels.conv.gluon")
    if gluon is None or not _on_cuda(c.x):
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else c.x.dtype
    return gluon.takes(c.x, c.weight, dtype, c.stride, c.padding, c.dilation, c.groups) and _conv_supports(c)


def _routed(supports: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """`routed` takes a call that Triton supports and whose route sends some direction to Triton, or
    that has a bias: its gradient runs on ours whatever the route (scaffold.model.conv)."""
    def routed_supports(c) -> bool:
        route = conv_route(c)
        return route is not None and (any(route) or c.bias is not None) and supports(c)
    return routed_supports


def _register_triton_rungs() -> None:
    gn, cat, pool, loss = ("scaffold.kernels.groupnorm", "scaffold.kernels.concat", "scaffold.kernels.pool",
                           "scaffold.kernels.seg_loss")
    _REGISTRY["conv"][TRITON] = Rung(_conv_supports, lambda c: _conv_forward(c, ALL_TRITON))
    _REGISTRY["conv"][ROUTED] = Rung(_routed(_conv_supports), lambda c: _conv_forward(c, conv_route(c)))
    _REGISTRY["conv"][GLUON] = Rung(_gluon_supports, lambda c: _conv_forward(c, GLUON_ROUTE))
    _REGISTRY["conv_transpose"][TRITON] = Rung(_conv_transpose_supports,
                                               lambda c: _conv_transpose_forward(c, ALL_TRITON))
    _REGISTRY["conv_transpose"][ROUTED] = Rung(_routed(_conv_transpose_supports),
                                               lambda c: _conv_transpose_forward(c, conv_route(c)))
    _REGISTRY["group_norm"][TRITON] = Rung(
        lambda c: _supported(gn, "group_norm_supported", c.x, c.num_groups, c.weight, c.bias),
        lambda c: kernel_module(gn).group_norm(c.x, c.num_groups, c.weight, c.bias, c.eps, c.relu,
                                               out_dtype=c.out_dtype, room=c.room))
    _REGISTRY["concat"][TRITON] = Rung(
        lambda c: _supported(cat, "concat_supported", c.a, c.b),
        lambda c: kernel_module(cat).concat_channels(c.a, c.b, c.dtype, into_room=c.into_room))
    _REGISTRY["pool"][TRITON] = Rung(
        lambda c: _supported(pool, "max_pool2_supported", c.x),
        lambda c: (kernel_module(pool).max_pool2_with_skip(c.x) if c.skip
                   else kernel_module(pool).max_pool2(c.x)))
    _REGISTRY["loss"][TRITON] = Rung(
        lambda c: _supported(loss, "seg_loss_supported", c.logits, c.labels, c.weight),
        lambda c: kernel_module(loss).seg_loss_terms(c.logits, c.labels, c.weight, c.eps))


_register_triton_rungs()
