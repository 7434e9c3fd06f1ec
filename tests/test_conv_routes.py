"""The conv route table: the tuner writes the keys the model's sites look up, and its block rewrite."""
import ast
import shutil

import pytest
import torch

from scaffold.bench import tune_routes
from scaffold.bench.conv import conv_sites
from scaffold.config import ModelConfig
from scaffold.model import routes
from scaffold.model import UNet3d


class _Recorder(dict):
    def __init__(self):
        super().__init__()
        self.asked = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)


@pytest.mark.filterwarnings("ignore::scaffold.model.ladder.LadderWarning")  # unrouted: vendor
def test_tuner_keys_are_the_keys_the_model_looks_up(monkeypatch):
    """Every conv site of a U-Net on the `routed` rung asks routes.py for exactly the key the tuner
    writes for that site (a mismatch would silently leave every site on vendor)."""
    recorder = _Recorder()
    monkeypatch.setattr(routes, "ROUTES", recorder)
    ladder = type("L", (), {"conv": "routed", "conv_transpose": "routed", "group_norm": "vendor",
                            "concat": "vendor"})()
    model = UNet3d(5, bottleneck=2, base_width=8, groups=2, n_classes=6, ladder=ladder)
    with torch.no_grad():
        model(torch.zeros(1, 3, 32, 32, 32))
    expected = {tune_routes.site_key(s, "cpu", torch.float32)
                for s in conv_sites(5, ModelConfig(bottleneck=2, base_width=8, groups=2))}
    assert recorder.asked == expected
    assert len(expected) == 15  # 18 sites; up1b, up2b, up3b repeat inc2, down1b, down2b


def test_choose_takes_triton_only_when_faster_by_the_margin():
    assert tune_routes.choose(0.90, 1.0, 0.02) == "triton"
    assert tune_routes.choose(0.99, 1.0, 0.02) == "vendor"
    assert tune_routes.choose(None, 1.0, 0.02) == "vendor"
    assert tune_routes.choose(1.0, None, 0.02) == "triton"


def test_choose_takes_the_faster_of_our_kernels_only_when_it_beats_cudnn():
    assert tune_routes.choose(0.90, 1.0, 0.02, g_ms=0.80) == "gluon"
    assert tune_routes.choose(0.80, 1.0, 0.02, g_ms=0.90) == "triton"
    assert tune_routes.choose(None, 1.0, 0.02, g_ms=0.90) == "gluon"
    assert tune_routes.choose(1.10, 1.0, 0.02, g_ms=0.99) == "vendor"  # within the margin
    assert tune_routes.choose(None, None, 0.02, g_ms=None) == "vendor"


def test_a_gluon_route_entry_is_ours_and_runs_triton_where_gluon_cannot(monkeypatch):
    """A 'gluon' entry comes back from the lookup as GLUON (truthy: not vendor); where the Gluon
    kernel declines the call (here: a CPU tensor) the Triton launchers compute that direction, with
    their own bits."""
    from scaffold.model import conv as C

    x = torch.randn(1, 64, 4, 4, 4).contiguous(memory_format=torch.channels_last_3d).requires_grad_()
    w = torch.randn(64, 64, 3, 3, 3).mul_(0.05).requires_grad_()
    key = routes.route_key("cpu", torch.float32, "conv", 64, 64, (3, 3, 3), (1, 1, 1), (1, 1, 1),
                           (1, 1, 1), (4, 4, 4))
    monkeypatch.setitem(routes.ROUTES, key, ("gluon", "gluon", "vendor"))
    route = routes.lookup(x, w, (1, 1, 1), (1, 1, 1), (1, 1, 1))
    assert route == (C.GLUON, C.GLUON, False)
    y = C.conv3d(x, w, None, (1, 1, 1), (1, 1, 1), (1, 1, 1), route)
    y.backward(torch.ones_like(y))
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = C.conv3d(x2, w2, None, (1, 1, 1), (1, 1, 1), (1, 1, 1), (True, True, False))
    y2.backward(torch.ones_like(y2))
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_a_gluon_kernel_that_fails_falls_back_to_triton_once_and_the_census_says_so(monkeypatch):
    """A Gluon kernel that raises (a compile error on the device, say) costs one warning per direction:
    that call and every later one in that direction run the Triton launchers, with their bits, and the
    Gluon kernel is not tried again; the census lists the failed directions."""
    from scaffold.kernels.conv import gluon as G
    from scaffold.kernels.conv import gluon_wgrad as GW
    from scaffold.model import conv as C
    from scaffold.model import ladder
    from scaffold.model.policy import LadderWarning

    tries = []

    def broken(name):
        def call(*a, **k):
            tries.append(name)
            raise RuntimeError(f"PTXASError: {name} failed\nsecond line")
        return call

    monkeypatch.setattr(C, "_GLUON_FAILED", {})
    monkeypatch.setattr(G, "supported", lambda *a, **k: True)  # as on an sm_90 GPU
    monkeypatch.setattr(GW, "supported", lambda *a, **k: True)
    for mod, name in ((G, "conv3d_forward"), (G, "conv3d_backward_data"), (GW, "conv3d_backward_weight")):
        monkeypatch.setattr(mod, name, broken(name))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 64, 4, 4, 4, generator=g).contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(64, 64, 3, 3, 3, generator=g).mul_(0.05)
    geom = ((1, 1, 1), (1, 1, 1), (1, 1, 1))

    def run(route):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = C.conv3d(xs, ws, None, *geom, route)
        y.backward(torch.ones_like(y))
        return y, xs.grad, ws.grad

    with pytest.warns(LadderWarning, match="Gluon conv") as caught:
        got = run((C.GLUON,) * 3)
    assert len([w_ for w_ in caught if issubclass(w_.category, LadderWarning)]) == 3
    assert sorted(tries) == ["conv3d_backward_data", "conv3d_backward_weight", "conv3d_forward"]
    want = run(C.ALL_TRITON)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    again = run((C.GLUON,) * 3)  # not tried again, no new warning
    assert len(tries) == 3 and all(torch.equal(a, b) for a, b in zip(again, want))
    failures = ladder.census()["gluon_failures"]
    assert failures == {"forward": "RuntimeError: PTXASError: conv3d_forward failed",
                        "backward-data": "RuntimeError: PTXASError: conv3d_backward_data failed",
                        "backward-weight": "RuntimeError: PTXASError: conv3d_backward_weight failed"}
    text = ladder.format_census(ladder.census())
    assert "gluon backward-weight failed, ran the Triton launchers: RuntimeError" in text


def test_write_routes_rewrites_only_the_block(tmp_path):
    path = tmp_path / "routes.py"
    shutil.copy(routes.__file__, path)
    before = path.read_text()
    table = {"sm90|bf16|conv|64>64|k3s1p1d1|128x128x128": ("triton", "vendor", "triton")}
    tune_routes.write_routes(table, str(path))
    after = path.read_text()
    assert '"sm90|bf16|conv|64>64|k3s1p1d1|128x128x128": (\'triton\', \'vendor\', \'triton\'),' in after
    head, tail = before.split("# BEGIN ROUTES")[0], before.split("# END ROUTES")[1]
    assert after.startswith(head) and after.endswith(tail)
    block = after.split("# BEGIN ROUTES")[1].split("= {", 1)[1].split("}\n# END ROUTES")[0]
    assert ast.literal_eval("{" + block + "}") == table
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


def test_table_covers_every_site_of_the_measured_models_and_nothing_else():
    """The H200 table holds every site key of the default U-Net at scales 7 and 8 (19 and 23 distinct
    shapes) and otherwise only scale 9's: no key the model never asks for (a stale or mistyped key
    routes nothing), and no site of those models left to the unrouted default."""
    want = {scale: {tune_routes.site_key(s, "sm90", torch.bfloat16) for s in conv_sites(scale)}
            for scale in (7, 8, 9)}
    assert len(want[7]) == 19 and len(want[8]) == 23
    sm90 = {k for k in routes.ROUTES if k.startswith("sm90|bf16|")}
    assert want[7] | want[8] <= sm90 <= want[7] | want[8] | want[9]
    assert all(len(v) == 3 and set(v) <= {routes.TRITON, routes.VENDOR, routes.GLUON}
               for v in routes.ROUTES.values())
    # the Gluon kernels take 3×3×3 convs only
    assert all("|k3s1p1d1|" in k or routes.GLUON not in v for k, v in routes.ROUTES.items())


def test_shapes_beyond_32_bit_indices_are_found_from_input_or_output():
    """cuDNN's int64 fallback is taken when the input or the output reaches 2^31 elements; the
    scale-9 sites on either side of that line."""
    s1, p1, d1 = (1, 1, 1), (1, 1, 1), (1, 1, 1)
    assert routes.beyond_int32((1, 3, 512, 512, 512), (64, 3, 3, 3, 3), s1, p1, d1)  # output 8.6e9
    assert routes.beyond_int32((1, 64, 256, 256, 256), (128, 64, 3, 3, 3), s1, p1, d1)  # output 2^31
    assert not routes.beyond_int32((1, 64, 256, 256, 256), (64, 64, 3, 3, 3), s1, p1, d1)  # 2^30
    assert not routes.beyond_int32((1, 128, 128, 128, 128), (256, 128, 3, 3, 3), s1, p1, d1)
    # transposed, kernel = stride 2: (Cin, Cout, 2, 2, 2); the output is twice the edge
    s2, p0 = (2, 2, 2), (0, 0, 0)
    assert routes.beyond_int32((1, 128, 256, 256, 256), (128, 64, 2, 2, 2), s2, p0, d1, transposed=True)
    assert not routes.beyond_int32((1, 256, 64, 64, 64), (256, 128, 2, 2, 2), s2, p0, d1, transposed=True)
    # batch counts: 2 x 2^30 elements is beyond
    assert routes.beyond_int32((2, 64, 256, 256, 256), (64, 64, 3, 3, 3), s1, p1, d1)


def test_an_unmeasured_shape_beyond_32_bit_indices_routes_to_triton(monkeypatch):
    """A shape missing from the table stays on vendor, unless cuDNN would index it with 64 bits: then
    every direction goes to Triton (scale 9 spent a minute a step in cuDNN's int64 kernels)."""
    monkeypatch.setattr(routes, "ROUTES", {})
    big = torch.empty(1, 1, 1, 1, 1).expand(1, 3, 512, 512, 512)  # 4e8 elements, no memory
    w = torch.empty(64, 3, 3, 3, 3)
    assert routes.lookup(big, w, (1, 1, 1), (1, 1, 1), (1, 1, 1)) == (True, True, True)
    small = torch.empty(1, 1, 1, 1, 1).expand(1, 3, 64, 64, 64)
    assert routes.lookup(small, w, (1, 1, 1), (1, 1, 1), (1, 1, 1)) is None
    # a measured key wins over the rule
    key = routes.route_key("cpu", torch.float32, "conv", 3, 64, (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1),
                           (512, 512, 512))
    monkeypatch.setattr(routes, "ROUTES", {key: ("vendor", "triton", "vendor")})
    assert routes.lookup(big, w, (1, 1, 1), (1, 1, 1), (1, 1, 1)) == (False, True, False)


def test_every_scale9_site_beyond_32_bit_indices_leaves_cudnn(monkeypatch):
    """Each scale-9 conv site as the H200 looks it up (sm90, bf16): those past 2^31 elements that
    the table never measured run every direction on Triton, those it measured on ours (never cuDNN's
    64-bit-index kernels); the others keep the table's word."""
    from scaffold.bench.conv import transposed

    monkeypatch.setattr(routes, "arch_key", lambda device: "sm90")
    large = 0
    for s in conv_sites(9):
        x = torch.empty((1,) * 5, dtype=torch.bfloat16).expand(*s.inputs[0])
        w = torch.empty(s.weight, dtype=torch.bfloat16)
        route = routes.lookup(x, w, s.stride, s.padding, s.dilation, transposed(s))
        entry = routes.ROUTES.get(tune_routes.site_key(s, "sm90", torch.bfloat16))
        beyond = routes.beyond_int32(s.inputs[0], s.weight, s.stride, s.padding, s.dilation, transposed(s))
        large += beyond
        if entry is not None:
            assert route == tuple(routes.GLUON if r == routes.GLUON else r == routes.TRITON for r in entry)
            assert not beyond or all(route), s.name
        elif beyond:
            assert route == (True, True, True), s.name
        else:
            assert route is None, s.name
    # inc.conv1, inc.conv2, downs.0.conv1/conv2, ups.4.up, ups.4.conv.conv1, ups.5.up, ups.5.conv.conv1, outc
    assert large >= 7


def test_the_tuner_times_only_our_kernels_where_an_operand_passes_int32_and_routes_to_the_faster(monkeypatch):
    """Scale 8's 128>64 conv at 256³ has a 2^31-element input: the tuner does not time cuDNN there (its
    64-bit-index kernels take seconds a call at scale 9) and gives each direction to the faster of
    ours; a site below 2^31 still races cuDNN, which wins where ours are slower."""
    from scaffold.bench import conv as bench_conv

    asked = {}

    def fake_bench_site(site, rungs=(), timer="wall", **_):
        asked[site.name] = tuple(rungs)
        row = {f"triton_{d}_ms": 2.0 for d in bench_conv.DIRECTIONS}
        row.update({f"gluon_{d}_ms": 1.0 for d in ("fwd", "bwd_data")})
        if "cudnn_det" in rungs:
            row.update({f"cudnn_det_{d}_ms": 0.5 for d in bench_conv.DIRECTIONS})
        return row

    monkeypatch.setattr(tune_routes, "bench_site", fake_bench_site)
    monkeypatch.setattr(tune_routes, "site_key", lambda s: s.name)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    table, report = tune_routes.tune(8, reps=1, margin=0.02, names=["ups.4.conv.conv1", "inc.conv2"],
                                     log=lambda *_: None)
    assert tune_routes.past_int32(next(s for s in conv_sites(8) if s.name == "ups.4.conv.conv1"))
    assert not tune_routes.past_int32(next(s for s in conv_sites(8) if s.name == "inc.conv2"))
    assert "cudnn_det" not in asked["ups.4.conv.conv1"] and "cudnn_det" in asked["inc.conv2"]
    assert table["ups.4.conv.conv1"] == ("gluon", "gluon", "triton")
    assert table["inc.conv2"] == ("vendor", "vendor", "vendor")
