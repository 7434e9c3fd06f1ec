"""The ladder: drop-in torch modules whose every call runs on one rung that scaffold.model.policy picks.

`FastConv3d`, `FastConvTranspose3d`, `FastGroupNorm`, `FastConcat` and `FastMaxPool2` (and the loss head,
scaffold.loss.SegmentationLoss) are *sites*: each builds its kind's call (policy.ConvCall, ...), asks the
policy for a rung, and runs it. A rung that raises (typically a compile failure) makes its site warn
once, switch to vendor for good and record the failure; the call is re-run on vendor. The modules keep
torch's parameters and state-dict keys, and their ladder state is plain attributes, outside the state
dict. The census (`census`, `format_census`) says which rung every site ran and which fell back.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaffold.model import policy
from scaffold.model.policy import (AUTO, OPS, VENDOR, ConcatCall, ConvCall, ConvTransposeCall, GroupNormCall,
                                   LadderWarning, PoolCall)
from scaffold.model.pool import max_pool2


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
        self.unsupported: Optional[str] = None  # the first call the forced setting could not run

    def _run(self, call: tuple, vendor: Callable[[], Any]) -> Any:
        name = VENDOR
        if not self.vendor_only:
            name = policy.select_rung(self.op, self.ladder_setting, call)
            if name == VENDOR and self.ladder_setting not in (AUTO, VENDOR):
                self._warn_unsupported(call)
        if name != VENDOR:
            try:
                out = policy.rung(self.op, name).forward(call)
            except torch.OutOfMemoryError:  # the device is full, not the rung broken: vendor would be too
                raise
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

    def _warn_unsupported(self, call: tuple) -> None:
        """Record the site (the census lists it) and warn once per operator kind and setting: one
        line for `ladder.conv=triton` on a CPU, not one per conv."""
        if self.unsupported is not None:
            return
        x = call[0]
        self.unsupported = f"{tuple(x.shape)} {x.dtype} on {x.device}"
        key = (self.op, self.ladder_setting)
        if key in _WARNED:
            return
        _WARNED.add(key)
        warnings.warn(f"{self.ladder_name} ({self.op}): ladder setting {self.ladder_setting!r} does not "
                      f"support {self.unsupported}; running vendor there (and at any other such site: "
                      "the census lists them)", LadderWarning, stacklevel=4)


_WARNED: set[tuple[str, str]] = set()  # (op, setting) pairs warned about; set_ladder starts afresh


# --- bf16 working copies of the convolutions' weights -------------------------------------------------
#
# Under autocast every convolution casts its fp32 weight (and bias) to bf16 in the forward, and the
# backward casts the bf16 weight gradient back to fp32: two passes over the weights per step (0.46 ms of
# the scale-7 step on the H200). With working copies attached, a convolution reads a bf16 copy of its
# weight that the optimizer writes as it updates the parameter (scaffold.kernels.adam.Adam), and the
# gradient stays in the copy's `.grad`, bf16. The same values either way: the copy is the parameter
# rounded as autocast rounds it, and bf16 -> fp32 is exact. The copies are plain attributes (outside the
# state dict); loading a state dict makes them again from the loaded parameters.

def working_weights(site: nn.Module, x: torch.Tensor) -> tuple:
    """(weight, bias) a convolution site computes with: its working copies when it has them and
    autocast computes in their dtype, else its parameters."""
    copies = getattr(site, "working", None)
    if copies is not None:
        kind = x.device.type
        if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == copies[0].dtype:
            return copies
    return site.weight, site.bias


def _refresh_working(site: nn.Module, incompatible_keys) -> None:
    if site.working is not None:
        with torch.no_grad():
            for w, p in zip(site.working, (site.weight, site.bias)):
                if w is not None:
                    w.copy_(p)


def attach_working_copies(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Gives every convolution site of `model` a working copy of its weight and bias in `dtype` (leaf
    tensors that take the gradients; see above); returns {parameter: copy} for the optimizer, which
    must write the copies at each step."""
    out = {}
    for site in model.modules():
        if not isinstance(site, (FastConv3d, FastConvTranspose3d)):
            continue
        pair = []
        for p in (site.weight, site.bias):
            if p is None:
                pair.append(None)
                continue
            w = torch.empty_like(p, dtype=dtype)
            with torch.no_grad():
                w.copy_(p)
            w.requires_grad_(p.requires_grad)
            out[p] = w
            pair.append(w)
        site.working = tuple(pair)
        if not getattr(site, "_working_hook", False):
            site.register_load_state_dict_post_hook(_refresh_working)
            site._working_hook = True
    return out


class FastConv3d(LadderSite, nn.Conv3d):
    """nn.Conv3d on the ladder: same parameters, same state-dict keys."""

    op = "conv"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_site()
        self.working: Optional[tuple] = None  # (weight, bias) working copies: attach_working_copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding_mode != "zeros":
            self.rungs_ran.add(VENDOR)
            return self._conv_forward(x, *working_weights(self, x))
        return self.padded(x, self.padding)

    def padded(self, x: torch.Tensor, padding) -> torch.Tensor:
        """This site's convolution of x with zero padding `padding` (`forward`: its own; scaffold.spatial's
        halo'd blocks: none along the split dims), on its rungs and in its census."""
        weight, bias = working_weights(self, x)
        call = ConvCall(x, weight, bias, self.stride, padding, self.dilation, self.groups)
        return self._run(call, lambda: F.conv3d(x, weight, bias, self.stride, padding, self.dilation, self.groups))


class FastConvTranspose3d(LadderSite, nn.ConvTranspose3d):
    """nn.ConvTranspose3d on the ladder: same parameters, same state-dict keys."""

    op = "conv_transpose"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_site()
        self.working: Optional[tuple] = None  # (weight, bias) working copies: attach_working_copies

    def forward(self, x: torch.Tensor, output_size: Optional[list[int]] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`out`: where a Triton forward may write the output (the room a skip left for it, see
        blocks.Up); a hint: the result is what counts, and vendor returns a tensor of its own."""
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size,
                                              3, self.dilation)
        weight, bias = working_weights(self, x)
        call = ConvTransposeCall(x, weight, bias, self.stride, self.padding, tuple(output_padding),
                                 self.groups, self.dilation, out)
        return self._run(call, lambda: F.conv_transpose3d(
            x, weight, bias, self.stride, self.padding, output_padding, self.groups, self.dilation))


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

    def forward(self, x: torch.Tensor, room: int = 0) -> torch.Tensor:
        """With `room` > 0 a rung may leave that many channels of room after the output for the
        concat that reads it next (FastConcat, into_room); the same values either way (vendor leaves
        none)."""
        kind = x.device.type
        out_dtype = None
        if self.autocast_output and torch.is_autocast_enabled(kind):
            out_dtype = torch.get_autocast_dtype(kind)
        call = GroupNormCall(x, self.num_groups, self.weight, self.bias, self.eps, self.relu, out_dtype,
                             room)
        return self._run(call, lambda: self._vendor(x, out_dtype))

    def with_head(self, x: torch.Tensor, head: "FastConv3d") -> torch.Tensor:
        """head(self(x)) for a 1×1×1 convolution site `head` (the U-Net's output layer): where this site
        runs Triton and the head's rung is not vendor, one fused pass each way that never writes the
        normalized tensor nor its gradient (scaffold.kernels.norm_head; the order of two sums differs
        from the separate ops', see there); else, or if the fused kernels fail (warned once, then the
        separate ops for good), exactly head(self(x))."""
        fused = self._fused_head_call(x, head)
        if fused is not None:
            try:
                out = policy.kernel_module("scaffold.kernels.norm_head").norm_head(*fused)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # a compile failure or a kernel bug: the separate ops from now on
                self.head_fallback = f"{type(exc).__name__}: {exc}".splitlines()[0]
                warnings.warn(f"{self.ladder_name} (group_norm + head): fused kernels failed, running the "
                              f"separate ops from now on: {self.head_fallback}", LadderWarning, stacklevel=2)
            else:
                self.rungs_ran.add(policy.TRITON)
                head.rungs_ran.add(policy.TRITON)
                self.fused_head_ran = True
                return out
        return head(self(x))

    def _fused_head_call(self, x: torch.Tensor, head: "FastConv3d") -> Optional[tuple]:
        """The arguments of norm_head for this call, or None where it must run apart."""
        if (not self.relu or self.vendor_only or head.vendor_only or getattr(self, "head_fallback", None)
                or head.padding_mode != "zeros" or head.kernel_size != (1, 1, 1) or head.stride != (1, 1, 1)
                or head.padding != (0, 0, 0) or head.dilation != (1, 1, 1) or head.groups != 1):
            return None
        kind = x.device.type
        amp = torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind) if amp else x.dtype
        gn_call = GroupNormCall(x, self.num_groups, self.weight, self.bias, self.eps, True,
                                dtype if self.autocast_output or not amp else None)
        if policy.select_rung(self.op, self.ladder_setting, gn_call) != policy.TRITON:
            return None
        hw, hb = working_weights(head, x)
        conv_call = ConvCall(x, hw, hb, head.stride, head.padding, head.dilation, head.groups)
        if policy.select_rung(head.op, head.ladder_setting, conv_call) == VENDOR:
            return None
        mod = policy.kernel_module("scaffold.kernels.norm_head")
        if mod is None:
            return None
        if amp:  # as autocast casts the conv's weight and bias (a no-op on working copies)
            hw, hb = hw.to(dtype), None if hb is None else hb.to(dtype)
        if hw.dtype != dtype or not mod.norm_head_supported(x, self.num_groups, self.weight, self.bias, hw, hb):
            return None
        return x, self.num_groups, self.weight, self.bias, self.eps, hw, hb, dtype

    def extra_repr(self) -> str:
        return super().extra_repr() + (", relu=True" if self.relu else "")


class FastConcat(LadderSite, nn.Module):
    """cat([a, b], dim=1) on the ladder (the U-Net's skip concat); holds no parameters."""

    op = "concat"

    def __init__(self):
        super().__init__()
        self._init_site()

    def forward(self, a: torch.Tensor, b: torch.Tensor, into_room: bool = False) -> torch.Tensor:
        """With `into_room` (the caller asked a's GroupNorm for room after it, and nothing else uses
        that memory) the Triton rung writes b into the room when a has it, instead of copying both."""
        kind = a.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        return self._run(ConcatCall(a, b, dtype, into_room), lambda: torch.cat([a, b], dim=1))


class FastMaxPool2(LadderSite, nn.Module):
    """The 2×2×2 max pool on the ladder (the U-Net's Down blocks); holds no parameters. Every rung gives
    F.max_pool3d(x, 2)'s values and sends each window's gradient to its first maximal element, with a
    deterministic backward (see scaffold.model.pool)."""

    op = "pool"

    def __init__(self):
        super().__init__()
        self._init_site()

    def forward(self, x: torch.Tensor, skip: bool = False):
        """pool(x); with `skip`, (pool(x), x as the U-Net's skip connection reads it): the same values
        and gradients as (self(x), x), where on the Triton rung the input's two gradients are added in
        the pool's backward pass instead of in an add over the full-size tensor of their own."""
        if skip:
            return self._run(PoolCall(x, True), lambda: (max_pool2(x), x))
        return self._run(PoolCall(x), lambda: max_pool2(x))


# --- configuring a model, and its census ----------------------------------------------------------

def _sites(*modules: nn.Module):
    for module in modules:
        for name, m in module.named_modules():
            if isinstance(m, LadderSite):
                yield name or m.ladder_name, m


def ladder_settings(ladder: Any) -> dict[str, str]:
    """Setting per operator kind from a LadderConfig (None = all auto; a missing field = auto). The
    values are checked by scaffold.plan.validate against policy.settings."""
    return {op: getattr(ladder, op, AUTO) if ladder is not None else AUTO for op in OPS}


def set_ladder(model: nn.Module, ladder: Any) -> nn.Module:
    """Applies a LadderConfig to every site of a module (and names them for warnings). The census
    starts afresh; sites that fell back stay vendor-only and keep their record."""
    settings = ladder_settings(ladder)
    for name, m in _sites(model):
        m.ladder_setting = settings[m.op]
        m.ladder_name = name or type(m).__name__
        m.rungs_ran = set()
        m.unsupported = None
    _WARNED.clear()
    return model


def census(*modules: nn.Module) -> dict:
    """Which rung each site of `modules` ran: counts per kind, the sites that fell back, and detail.

    A site that ran several rungs (different shapes, or before and after a fallback) is listed as
    'a+b' and counted under each; one that has not run yet is 'none'. Beside the rungs: the GroupNorm
    sites that ran fused with the 1x1x1 head (`fused_head`; a fused pair that failed and fell back to
    the separate ops is a fallback named `<site> (group_norm + head)`), the sites that run on a
    spatially split volume (`sharded`: halo'd convolutions, slab GroupNorms), and the conv directions
    whose Gluon kernel failed in this process and ran on Triton since (`gluon_failures`)."""
    out: dict[str, Any] = {op: {} for op in OPS}
    sites: dict[str, str] = {}
    fallbacks: list[str] = []
    errors: dict[str, str] = {}
    unsupported: dict[str, str] = {}
    fused_head: list[str] = []
    sharded: list[str] = []
    for name, m in _sites(*modules):
        if m.unsupported is not None:
            unsupported[name] = f"{m.ladder_setting} does not support {m.unsupported}"
        ran = sorted(m.rungs_ran) or ["none"]
        sites[name] = "+".join(ran)
        for rung in ran:
            out[m.op][rung] = out[m.op].get(rung, 0) + 1
        if m.fallback_error is not None:
            fallbacks.append(name)
            errors[name] = m.fallback_error
        if getattr(m, "head_fallback", None):
            fallbacks.append(f"{name} (group_norm + head)")
            errors[fallbacks[-1]] = m.head_fallback
        if getattr(m, "fused_head_ran", False):
            fused_head.append(name)
        if getattr(m, "shards", None) is not None:
            sharded.append(name)
    out["fused_head"] = fused_head
    out["sharded"] = sharded
    out["fallbacks"] = fallbacks
    out["fallback_errors"] = errors
    out["unsupported"] = unsupported  # sites a forced setting could not run (they ran vendor)
    out["modules"] = sites
    conv = sys.modules.get("scaffold.model.conv")  # imported once a conv rung has run
    out["gluon_failures"] = conv.gluon_failures() if conv is not None else {}
    return out


def format_census(c: dict) -> str:
    """A compact multi-line text of a census, for the log."""
    lines = ["ladder census (sites per rung):"]
    for op in OPS:
        counts = c.get(op, {})
        text = "  ".join(f"{rung} {n}" for rung, n in sorted(counts.items())) or "-"
        lines.append(f"  {op:<16}{text}")
    lines.append(f"  {'fused head':<16}{', '.join(c.get('fused_head') or []) or 'none'}")
    if c.get("sharded"):
        lines.append(f"  {'sharded sites':<16}{len(c['sharded'])} (halo'd convolutions, slab GroupNorms)")
    if c.get("plan"):
        lines.append(f"  {'optimizer':<16}{c['plan'].get('optimizer')}")
    if c.get("fallbacks"):
        lines.append("  fallbacks:")
        errors = c.get("fallback_errors", {})
        lines += [f"    {name}: {errors.get(name, '')}" for name in c["fallbacks"]]
    else:
        lines.append("  fallbacks: none")
    for direction, error in (c.get("gluon_failures") or {}).items():
        lines.append(f"  gluon {direction} failed, ran the Triton launchers: {error}")
    if c.get("unsupported"):
        lines.append(f"  not supported by the chosen setting, ran vendor: {len(c['unsupported'])} sites")
        lines += [f"    {name}: {why}" for name, why in c["unsupported"].items()]
    return "\n".join(lines)
