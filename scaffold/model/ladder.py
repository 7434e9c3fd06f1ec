"""The ladder: drop-in torch modules whose every call runs on one rung, chosen without timing.

A *rung* is one implementation of an operator kind (`conv`, `conv_transpose`, `group_norm`, `concat`,
`pool`):
`vendor` is torch's own op (cuDNN / MIOpen / the CPU kernels) and is always there; `triton` is ours,
loaded lazily from `scaffold.kernels` so that a missing or broken kernel module only makes the rung
unavailable. Other rungs can be registered (the tests register fakes).

Which rung a call takes is a pure function of (device, dtype, shape, config): `select_rung`. It never
depends on a timing race, so the bits a run produces do not depend on it either. Settings per kind:
  auto   - on CUDA the kind's AUTO_RUNG when it is registered and supports the call, else vendor (on the
           CPU auto is always vendor: the Triton interpreter is for tests, which force a rung). That is
           `triton` for GroupNorm, concat and the max pool, and `routed` for the convolutions: per
           measured shape, each direction on whichever of Triton and deterministic cuDNN was faster
  triton - `triton` where supported, vendor otherwise (a module warns once when it cannot honour this)
  routed - (convolutions) the per-direction routes, also on the CPU under the interpreter
  vendor - always vendor
A rung that raises (typically a compile failure) makes its module warn once, switch to vendor for good
and record the failure; the call is re-run on vendor.

Contract for a rung: `supports(*args) -> bool` decides from metadata only (no host sync); `forward(*args)`
is autograd-aware and receives the tensors exactly as the module's forward gets them, so under autocast
it must cast like autocast would and return the dtype vendor returns (bf16 for convolutions, fp32 for
GroupNorm). The one exception is `concat`, which is given the consumer's compute dtype and writes both
halves in it: the consumer (a convolution) would cast the vendor result to that dtype anyway.
Argument tuples per kind (the same for `supports` and `forward`):
  conv:           (x, weight, bias, stride, padding, dilation, groups)
  conv_transpose: (x, weight, bias, stride, padding, output_padding, groups, dilation)
  group_norm:     (x, num_groups, weight, bias, eps, relu, out_dtype)   out_dtype None = as F.group_norm
  concat:         (a, b, dtype)                 -> cat([a, b], dim=1)
  pool:           (x,)                          -> the 2×2×2 max pool (scaffold.model.pool.max_pool2)

The census (`census`, `format_census`) says which rung every module ran and which ones fell back.
"""
from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaffold.config import ConfigError
from scaffold.model.pool import max_pool2

OPS = ("conv", "conv_transpose", "group_norm", "concat", "pool")
VENDOR = "vendor"
AUTO = "auto"
FAST = "triton"


class LadderWarning(UserWarning):
    """A module could not run the rung it was asked for (unsupported call or a failing rung)."""


@dataclass(frozen=True)
class Rung:
    supports: Callable[..., bool]
    forward: Callable[..., torch.Tensor]


_REGISTRY: dict[str, dict[str, Rung]] = {op: {} for op in OPS}


def register_rung(op: str, name: str, supports: Callable[..., bool],
                  forward: Callable[..., torch.Tensor]) -> Optional[Rung]:
    """Adds (or replaces) rung `name` for operator kind `op`; returns the rung it replaced, if any."""
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


def get_rung(op: str, name: str) -> Optional[Rung]:
    return _REGISTRY[op].get(name)


# The rung `auto` takes on CUDA, per operator kind (None: vendor). This follows the measurements in
# docs/performance.md: our GroupNorm and concat kernels beat ATen; for convolutions neither side wins
# every site and direction, so `auto` runs `routed`: per measured shape, each of forward,
# backward-data and backward-weight on whichever of Triton and deterministic cuDNN was faster
# (scaffold/kernels/routes.py); unmeasured shapes stay on vendor. `ladder.conv=triton` forces the
# Triton kernels for every direction.
ROUTED = "routed"
AUTO_RUNG = {"conv": ROUTED, "conv_transpose": ROUTED, "group_norm": FAST, "concat": FAST,
             "pool": FAST}


def select_rung(op: str, setting: str, device: torch.device, args: tuple) -> str:
    """The rung a call takes: a pure function of the device, the arguments' metadata and the setting."""
    if setting == VENDOR:
        return VENDOR
    name = setting
    if setting == AUTO:
        name = AUTO_RUNG.get(op, FAST)
        if device.type != "cuda" or name is None:
            return VENDOR
    rung = _REGISTRY[op].get(name)
    if rung is None or not rung.supports(*args):
        return VENDOR
    return name


# --- the Triton rungs, imported on first use -------------------------------------------------------

def _lazy_rung(module: str, forward_name: str, supports_name: str,
               forward_args: Callable[[tuple], tuple], supports_args: Callable[[tuple], tuple],
               forward_kwargs: Callable[[tuple], dict] = lambda a: {}) -> Rung:
    loaded: dict[str, Any] = {}

    def load():
        if "fns" not in loaded:
            try:
                mod = importlib.import_module(module)
                loaded["fns"] = (getattr(mod, forward_name), getattr(mod, supports_name))
            except Exception as exc:  # a missing or broken kernel module: the rung is unavailable
                loaded["fns"] = None
                warnings.warn(f"Triton rung unavailable, {forward_name} runs on vendor: {module}: "
                              f"{type(exc).__name__}: {exc}".splitlines()[0], LadderWarning, stacklevel=2)
        return loaded["fns"]

    def supports(*args) -> bool:
        fns = load()
        return fns is not None and bool(fns[1](*supports_args(args)))

    def forward(*args) -> torch.Tensor:
        return load()[0](*forward_args(args), **forward_kwargs(args))

    return Rung(supports, forward)


def _register_triton_rungs() -> None:
    keep = lambda a: a  # noqa: E731
    _REGISTRY["conv"][FAST] = _lazy_rung(
        "scaffold.kernels.conv", "conv3d", "conv3d_supported", lambda a: a[:6], keep)
    _REGISTRY["conv_transpose"][FAST] = _lazy_rung(
        "scaffold.kernels.conv", "conv_transpose3d", "conv_transpose3d_supported", lambda a: a[:4], keep)
    _REGISTRY["conv"][ROUTED] = _lazy_rung(
        "scaffold.kernels.conv", "conv3d_routed", "conv3d_routed_supported", lambda a: a[:6], keep)
    _REGISTRY["conv_transpose"][ROUTED] = _lazy_rung(
        "scaffold.kernels.conv", "conv_transpose3d_routed", "conv_transpose3d_routed_supported",
        lambda a: a[:4], keep)
    _REGISTRY["group_norm"][FAST] = _lazy_rung(
        "scaffold.kernels.groupnorm", "group_norm", "group_norm_supported", lambda a: a[:6], lambda a: a[:4],
        forward_kwargs=lambda a: {"out_dtype": a[6]})
    _REGISTRY["concat"][FAST] = _lazy_rung(
        "scaffold.kernels.concat", "concat_channels", "concat_supported", keep, lambda a: a[:2])
    _REGISTRY["pool"][FAST] = _lazy_rung(
        "scaffold.kernels.pool", "max_pool2", "max_pool2_supported", keep, keep)


_register_triton_rungs()


# --- the modules ----------------------------------------------------------------------------------

class LadderSite:
    """Mixin of the ladder modules: the setting, the rungs this module ran, and its fallback state.

    This state is plain Python attributes, so it never enters the state dict."""

    op: str = ""

    def _init_site(self) -> None:
        self.ladder_setting = AUTO
        self.ladder_name = type(self).__name__
        self.vendor_only = False
        self.fallback_error: Optional[str] = None
        self.rungs_ran: set[str] = set()
        self._warned_unsupported = False

    def _run(self, args: tuple, vendor: Callable[[], torch.Tensor]) -> torch.Tensor:
        name = VENDOR
        if not self.vendor_only:
            name = select_rung(self.op, self.ladder_setting, args[0].device, args)
            if name == VENDOR and self.ladder_setting not in (AUTO, VENDOR):
                self._warn_unsupported(args)
        if name != VENDOR:
            try:
                out = _REGISTRY[self.op][name].forward(*args)
            except Exception as exc:  # compile failure or a kernel bug: this module goes vendor for good
                self.vendor_only = True
                self.fallback_error = f"{name}: {type(exc).__name__}: {exc}".splitlines()[0]
                warnings.warn(f"{self.ladder_name} ({self.op}): rung {name!r} failed, using vendor from now "
                              f"on: {self.fallback_error}", LadderWarning, stacklevel=3)
            else:
                self.rungs_ran.add(name)
                return out
        self.rungs_ran.add(VENDOR)
        return vendor()

    def _warn_unsupported(self, args: tuple) -> None:
        if self._warned_unsupported:
            return
        self._warned_unsupported = True
        x = args[0]
        warnings.warn(f"{self.ladder_name} ({self.op}): ladder setting {self.ladder_setting!r} does not "
                      f"support {tuple(x.shape)} {x.dtype} on {x.device}; running vendor",
                      LadderWarning, stacklevel=4)


class FastConv3d(LadderSite, nn.Conv3d):
    """nn.Conv3d on the ladder: same parameters, same state-dict keys."""

    op = "conv"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_site()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vendor = lambda: self._conv_forward(x, self.weight, self.bias)  # noqa: E731
        if self.padding_mode != "zeros":
            self.rungs_ran.add(VENDOR)
            return vendor()
        args = (x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return self._run(args, vendor)


class FastConvTranspose3d(LadderSite, nn.ConvTranspose3d):
    """nn.ConvTranspose3d on the ladder: same parameters, same state-dict keys."""

    op = "conv_transpose"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_site()

    def forward(self, x: torch.Tensor, output_size: Optional[list[int]] = None) -> torch.Tensor:
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size,
                                              3, self.dilation)
        args = (x, self.weight, self.bias, self.stride, self.padding, tuple(output_padding), self.groups,
                self.dilation)
        return self._run(args, lambda: F.conv_transpose3d(
            x, self.weight, self.bias, self.stride, self.padding, output_padding, self.groups, self.dilation))


class FastGroupNorm(LadderSite, nn.GroupNorm):
    """nn.GroupNorm on the ladder, optionally followed by ReLU (`relu=True`), which a fused rung does in
    the same pass. The parameters and state-dict keys are those of nn.GroupNorm.

    Under autocast F.group_norm returns fp32. With `autocast_output=True` the module returns the autocast
    dtype (bf16) instead, on every rung: for a site whose consumers compute in that dtype anyway (a
    convolution, the max pool, the skip concat) the values are the same — the consumer would round the
    fp32 output to bf16 the same way (round to nearest even; the max commutes with that rounding) — and
    half the bytes are written and read. The U-Net's DoubleConv sets it."""

    op = "group_norm"

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 relu: bool = False, autocast_output: bool = False, device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype)
        self.relu = relu
        self.autocast_output = autocast_output
        self._init_site()

    def _vendor(self, x: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        # In place is safe: GroupNorm's backward needs its input and statistics, not its output.
        y = F.relu(y, inplace=True) if self.relu else y
        return y if out_dtype is None else y.to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        out_dtype = None
        if self.autocast_output and torch.is_autocast_enabled(kind):
            out_dtype = torch.get_autocast_dtype(kind)
        args = (x, self.num_groups, self.weight, self.bias, self.eps, self.relu, out_dtype)
        return self._run(args, lambda: self._vendor(x, out_dtype))

    def extra_repr(self) -> str:
        return super().extra_repr() + (", relu=True" if self.relu else "")


class FastConcat(LadderSite, nn.Module):
    """cat([a, b], dim=1) on the ladder (the U-Net's skip concat); holds no parameters."""

    op = "concat"

    def __init__(self):
        super().__init__()
        self._init_site()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        kind = a.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        return self._run((a, b, dtype), lambda: torch.cat([a, b], dim=1))


class FastMaxPool2(LadderSite, nn.Module):
    """The 2×2×2 max pool on the ladder (the U-Net's Down blocks); holds no parameters. Every rung gives
    F.max_pool3d(x, 2)'s values and sends each window's gradient to its first maximal element, with a
    deterministic backward (see scaffold.model.pool)."""

    op = "pool"

    def __init__(self):
        super().__init__()
        self._init_site()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run((x,), lambda: max_pool2(x))


# --- configuring a model, and its census ----------------------------------------------------------

def _sites(model: nn.Module):
    return ((name, m) for name, m in model.named_modules() if isinstance(m, LadderSite))


def ladder_settings(ladder: Any) -> dict[str, str]:
    """Setting per operator kind from a LadderConfig (or None = all auto). A config object without a
    `concat` or `pool` field gives those the `group_norm` setting."""
    if ladder is None:
        return {op: AUTO for op in OPS}
    settings = {op: getattr(ladder, op) for op in OPS[:3]}
    for op in ("concat", "pool"):
        settings[op] = getattr(ladder, op, settings["group_norm"])
    for op, value in settings.items():
        allowed = {AUTO, VENDOR, FAST, *_REGISTRY[op]}
        if value not in allowed:
            raise ConfigError(f"ladder.{op}={value!r}: expected {' | '.join(sorted(allowed))}")
    return settings


def set_ladder(model: nn.Module, ladder: Any) -> nn.Module:
    """Applies a LadderConfig to every ladder module of a built model (and names them for warnings).
    The census starts afresh; modules that fell back stay vendor-only and keep their record."""
    settings = ladder_settings(ladder)
    for name, m in _sites(model):
        m.ladder_setting = settings[m.op]
        m.ladder_name = name or type(m).__name__
        m.rungs_ran = set()
        m._warned_unsupported = False
    return model


def reset_census(model: nn.Module) -> None:
    """Forgets which rungs ran (fallback records stay: those modules remain vendor-only)."""
    for _, m in _sites(model):
        m.rungs_ran = set()


def census(model: nn.Module) -> dict:
    """Which rung each ladder module ran: counts per kind, the modules that fell back, and detail.

    A module that ran several rungs (different shapes, or before and after a fallback) is listed as
    'a+b' and counted under each; one that has not run yet is 'none'."""
    out: dict[str, Any] = {op: {} for op in OPS}
    modules: dict[str, str] = {}
    fallbacks: list[str] = []
    errors: dict[str, str] = {}
    for name, m in _sites(model):
        ran = sorted(m.rungs_ran) or ["none"]
        modules[name] = "+".join(ran)
        for rung in ran:
            out[m.op][rung] = out[m.op].get(rung, 0) + 1
        if m.fallback_error is not None:
            fallbacks.append(name)
            errors[name] = m.fallback_error
    out["fallbacks"] = fallbacks
    out["fallback_errors"] = errors
    out["modules"] = modules
    return out


def format_census(c: dict) -> str:
    """A compact multi-line text of a census, for the log."""
    lines = ["ladder census (modules per rung):"]
    for op in OPS:
        counts = c.get(op, {})
        text = "  ".join(f"{rung} {n}" for rung, n in sorted(counts.items())) or "-"
        lines.append(f"  {op:<16}{text}")
    if c.get("fallbacks"):
        lines.append("  fallbacks:")
        errors = c.get("fallback_errors", {})
        lines += [f"    {name}: {errors.get(name, '')}" for name in c["fallbacks"]]
    else:
        lines.append("  fallbacks: none")
    return "\n".join(lines)


def census_json(c: dict) -> str:
    return json.dumps(c, indent=2, sort_keys=True)
