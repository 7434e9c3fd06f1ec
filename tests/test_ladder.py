"""The ladder mechanism, driven by fake rungs: selection, forcing, fallback, census."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scaffold.config import ConfigError, LadderConfig
from scaffold.model import UNet3d, census, format_census, set_ladder
from scaffold.model import ladder as L
from scaffold.model import policy as P


@pytest.fixture
def fake_rungs():
    """Registers fake 'triton' rungs that compute the vendor result; restores the real ones after.
    `calls` counts calls per kind; `supports`/`fail` are per-kind switches the test may change."""
    ops = [op for op in P.OPS if op != "loss"]  # the model's kinds (the loss head has its own tests)
    state = {"calls": {op: 0 for op in ops}, "supports": {op: (lambda c: True) for op in ops},
             "fail": set()}
    vendor = {
        "conv": lambda c: F.conv3d(*c),
        "conv_transpose": lambda c: F.conv_transpose3d(*c[:8]),  # (the call's last field, `out`, is a hint)
        "group_norm": lambda c: (F.relu if c.relu else (lambda t: t))(
            F.group_norm(c.x, c.num_groups, c.weight, c.bias, c.eps)).to(c.out_dtype or c.x.dtype),
        "concat": lambda c: torch.cat([c.a, c.b], 1),
        "pool": lambda c: (F.max_pool3d(c.x, 2), c.x) if c.skip else F.max_pool3d(c.x, 2),
    }
    saved = {}
    for op in ops:
        def forward(call, op=op):
            state["calls"][op] += 1
            if op in state["fail"]:
                raise RuntimeError(f"fake {op} compile failure\nsecond line")
            out = vendor[op](call)
            return (out[0] * 1, out[1]) if isinstance(out, tuple) else out * 1

        saved[op] = P.register_rung(op, "triton", lambda c, op=op: state["supports"][op](c), forward)
    try:
        yield state
    finally:
        for op, rung in saved.items():
            P.unregister_rung(op, "triton")
            if rung is not None:
                P.register_rung(op, "triton", rung.supports, rung.forward)


def _model(ladder=None):
    torch.manual_seed(0)
    # 7 convs, 1 transposed, 6 norms, 1 concat, 1 pool
    model = UNet3d(4, base_width=4, groups=2, ladder=ladder)
    model.fuse_head = False  # each site through its (fake) rung: the fused head is not one of them
    return model


X = torch.randn(1, 3, 16, 16, 16, generator=torch.Generator().manual_seed(1))


def test_auto_on_cpu_is_vendor_even_with_a_rung(fake_rungs):
    model = _model()
    model(X)
    assert sum(fake_rungs["calls"].values()) == 0
    c = census(model)
    assert c["conv"] == {"vendor": 7} and c["conv_transpose"] == {"vendor": 1}
    assert c["group_norm"] == {"vendor": 6} and c["concat"] == {"vendor": 1} and c["fallbacks"] == []
    assert c["pool"] == {"vendor": 1}


def test_forced_triton_runs_the_rung_and_matches_vendor(fake_rungs):
    reference = _model(LadderConfig("vendor", "vendor", "vendor", "vendor", "vendor"))(X)
    model = _model(LadderConfig("triton", "triton", "triton", "triton", "triton"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = model(X)
    assert torch.equal(y, reference)
    assert fake_rungs["calls"] == {"conv": 7, "conv_transpose": 1, "group_norm": 6, "concat": 1, "pool": 1}
    c = census(model)
    assert c["conv"] == {"triton": 7} and c["group_norm"] == {"triton": 6} and c["concat"] == {"triton": 1}
    assert c["pool"] == {"triton": 1}
    assert c["modules"]["inc.conv1"] == "triton" and c["modules"]["outc"] == "triton"


def test_vendor_setting_never_asks_the_rung(fake_rungs):
    asked = []
    fake_rungs["supports"]["conv"] = lambda c: asked.append(1) or True
    _model(LadderConfig("vendor", "triton", "triton"))(X)
    assert asked == [] and fake_rungs["calls"]["conv"] == 0


def test_forced_but_unsupported_warns_once_per_module(fake_rungs):
    fake_rungs["supports"]["conv"] = lambda c: c.weight.shape[1] != 3  # no stem (Cin = 3)
    model = _model(LadderConfig(conv="triton"))
    with pytest.warns(L.LadderWarning, match=r"inc\.conv1 \(conv\).*does not support") as record:
        model(X)
        model(X)
    assert len(record) == 1
    c = census(model)
    assert c["conv"] == {"triton": 6, "vendor": 1} and c["modules"]["inc.conv1"] == "vendor"


def test_failing_rung_warns_once_falls_back_and_is_recorded(fake_rungs):
    fake_rungs["fail"].add("group_norm")
    reference = _model(LadderConfig("vendor", "vendor", "vendor"))(X)
    model = _model(LadderConfig("vendor", "vendor", "triton"))
    with pytest.warns(L.LadderWarning, match="fake group_norm compile failure") as record:
        y = model(X)
    assert len(record) == 6  # once per GroupNorm module
    assert torch.equal(y, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(X)  # vendor-only from now on: no new warnings, no new calls
    assert fake_rungs["calls"]["group_norm"] == 6
    c = census(model)
    assert c["group_norm"] == {"vendor": 6}
    assert len(c["fallbacks"]) == 6 and "inc.norm1" in c["fallbacks"]
    assert c["fallback_errors"]["inc.norm1"] == "triton: RuntimeError: fake group_norm compile failure"
    text = format_census(c)
    assert "group_norm" in text and "inc.norm1: triton: RuntimeError" in text


def test_select_rung_is_a_pure_function_of_device_and_metadata(fake_rungs, monkeypatch):
    x = torch.empty(1, 8, 4, 4, 4, device="meta")
    w = torch.empty(8, 8, 3, 3, 3, device="meta")
    one = (1, 1, 1)
    call = P.ConvCall(x, w, None, one, one, one, 1)
    on_cuda = call  # a meta tensor stands in for a CUDA one through the patched device check
    monkeypatch.setattr(P, "_on_cuda", lambda t: True)
    # `auto` runs the kind's AUTO_RUNG on CUDA: `routed` for convolutions, `triton` for the others.
    assert P.AUTO_RUNG["conv"] == "routed" and P.AUTO_RUNG["group_norm"] == "triton"
    monkeypatch.setitem(P.AUTO_RUNG, "conv", "triton")
    assert P.select_rung("conv", "auto", on_cuda) == "triton"
    monkeypatch.setattr(P, "_on_cuda", lambda t: False)
    assert P.select_rung("conv", "auto", call) == "vendor"
    assert P.select_rung("conv", "triton", call) == "triton"
    monkeypatch.setattr(P, "_on_cuda", lambda t: True)
    assert P.select_rung("conv", "vendor", on_cuda) == "vendor"
    fake_rungs["supports"]["conv"] = lambda c: c.x.dtype == torch.bfloat16
    assert P.select_rung("conv", "auto", on_cuda) == "vendor"
    P.unregister_rung("conv", "triton")
    assert P.select_rung("conv", "triton", on_cuda) == "vendor"


def test_auto_routes_convolutions_only_where_a_measured_route_takes_triton(monkeypatch):
    """The real `routed` rung: a shape without a route stays vendor under auto; one whose route sends
    a direction to Triton takes `routed`; a route that is all vendor is plain vendor."""
    from scaffold.model import routes

    x = torch.empty(1, 8, 4, 4, 4, device="meta", dtype=torch.bfloat16)
    w = torch.empty(16, 8, 3, 3, 3, device="meta", dtype=torch.bfloat16)
    one = (1, 1, 1)
    call = P.ConvCall(x, w, None, one, one, one, 1)
    monkeypatch.setattr(P, "_on_cuda", lambda t: True)  # meta tensors stand in for CUDA ones
    monkeypatch.setattr(routes, "ROUTES", {})
    monkeypatch.setattr("scaffold.kernels.conv.directions.triton_usable", lambda t: True)
    assert P.select_rung("conv", "auto", call) == "vendor"
    key = routes.route_key("cpu", torch.bfloat16, "conv", 8, 16, (3, 3, 3), (1,) * 3, (1,) * 3, (1,) * 3,
                           (4, 4, 4))
    assert key == "cpu|bf16|conv|8>16|k3s1p1d1|4x4x4"
    routes.ROUTES[key] = ("vendor", "vendor", "vendor")
    assert P.select_rung("conv", "auto", call) == "vendor"
    routes.ROUTES[key] = ("triton", "vendor", "vendor")
    assert P.select_rung("conv", "auto", call) == "routed"
    assert P.select_rung("conv", "auto", call._replace(x=x[..., :3])) == "vendor"  # other shape


def test_missing_kernel_module_makes_the_rung_unavailable():
    with pytest.warns(L.LadderWarning, match="unavailable.*no_such_kernel"):
        assert P._supported("scaffold.kernels.no_such_kernel", "f_supported", torch.zeros(1)) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, at the failed import
        assert P._supported("scaffold.kernels.no_such_kernel", "f_supported", torch.zeros(1)) is False


def test_config_rejects_unknown_rungs_naming_the_key_and_accepts_registered_ones(fake_rungs):
    from scaffold.config import Config
    from scaffold.plan import validate

    cfg = Config()
    cfg.ladder.conv_transpose = "fast"
    with pytest.raises(ConfigError, match=r"^ladder\.conv_transpose='fast': expected auto \| routed \| "):
        validate(cfg)
    P.register_rung("conv_transpose", "fast", lambda c: True, lambda c: F.conv_transpose3d(*c[:8]))
    try:
        validate(cfg)  # a registered rung is a valid setting
    finally:
        P.unregister_rung("conv_transpose", "fast")


def test_concat_has_its_own_setting():
    model = _model(LadderConfig("vendor", "vendor", "triton"))
    assert model.ups[0].concat.ladder_setting == "auto"
    set_ladder(model, LadderConfig("vendor", "vendor", "triton", concat="vendor"))
    assert model.ups[0].concat.ladder_setting == "vendor"
    assert model.ups[0].conv.norm1.ladder_setting == "triton"


def test_fast_modules_keep_torch_state_dict_keys():
    pairs = [(L.FastConv3d(4, 8, 3, bias=False), nn.Conv3d(4, 8, 3, bias=False)),
             (L.FastConvTranspose3d(8, 4, 2, stride=2), nn.ConvTranspose3d(8, 4, 2, stride=2)),
             (L.FastGroupNorm(2, 8, relu=True), nn.GroupNorm(2, 8))]
    for fast, stock in pairs:
        assert list(fast.state_dict()) == list(stock.state_dict())
        stock.load_state_dict(fast.state_dict())
        fast.load_state_dict(stock.state_dict())
    x = torch.randn(2, 8, 4, 4, 4)
    assert torch.equal(pairs[2][0](x), F.relu(pairs[2][1](x)))


def test_forward_paths_have_no_host_reads():
    import inspect
    import re

    from scaffold.model import blocks, pool, unet

    host_reads = re.compile(r"\.(item|tolist|cpu|numpy)\(|nonzero|unique|(?<![\w.])(bool|float|int)\(")
    fns = [P.select_rung, L.LadderSite._run, L.FastConv3d.forward, L.FastConvTranspose3d.forward,
           L.FastGroupNorm.forward, L.FastGroupNorm._vendor, L.FastConcat.forward, L.FastMaxPool2.forward,
           pool.max_pool2,
           pool._MaxPool2.forward, pool._MaxPool2.backward, blocks.DoubleConv.forward, blocks.Up.forward,
           blocks.Down.forward, unet.UNet3d.forward]
    for fn in fns:
        assert host_reads.findall(inspect.getsource(fn)) == [], fn.__qualname__
