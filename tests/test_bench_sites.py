"""The benchmarks' sites, read off the model: checked against the architecture derived independently."""
from collections import Counter

from scaffold.bench.sites import distinct, model_sites
from scaffold.config import ModelConfig


def test_scale_7_has_the_models_sites():
    sites = model_sites(7)
    ops = Counter(s.op for s in sites)
    assert ops == {"conv": 19, "conv_transpose": 4, "group_norm": 18, "concat": 4, "pool": 4}
    kernels = Counter(s.weight[2:] for s in sites if s.op == "conv")
    assert kernels == {(3, 3, 3): 18, (1, 1, 1): 1}
    assert [s.name for s in sites if s.weight == (6, 64, 1, 1, 1)] == ["outc"]


def _expected_convs(scale: int, base: int = 64, bottleneck: int = 3, classes: int = 6) -> Counter:
    """(op, cin, cout, input edge, kernel, stride, padding, bias) of every conv: widths double per
    level from the base width while the edge halves; a DoubleConv per level down, the transposed conv
    and a DoubleConv per level up, then the 1×1×1 head."""
    levels = scale - bottleneck
    w = [base * 2**i for i in range(levels + 1)]
    e = [2 ** (scale - i) for i in range(levels + 1)]
    convs = [("conv", 3, w[0], e[0], 3, 1, 1, False), ("conv", w[0], w[0], e[0], 3, 1, 1, False)]
    for i in range(1, levels + 1):
        convs += [("conv", w[i - 1], w[i], e[i], 3, 1, 1, False),
                  ("conv", w[i], w[i], e[i], 3, 1, 1, False)]
    for i in range(levels, 0, -1):
        convs += [("conv_transpose", w[i], w[i - 1], e[i], 2, 2, 0, True),
                  ("conv", w[i], w[i - 1], e[i - 1], 3, 1, 1, False),
                  ("conv", w[i - 1], w[i - 1], e[i - 1], 3, 1, 1, False)]
    convs.append(("conv", w[0], classes, e[0], 1, 1, 0, True))
    return Counter(convs)


def _geometry(s) -> tuple:
    k, stride, pad = s.weight[2], s.stride, s.padding
    assert s.weight[2:] == (k,) * 3 and stride == (stride[0],) * 3 and pad == (pad[0],) * 3
    assert s.inputs[0][2:] == (s.edge,) * 3 and s.dilation == (1, 1, 1) and s.groups == 1
    return s.op, s.cin, s.cout, s.edge, k, stride[0], pad[0], s.bias


def test_distinct_conv_geometries_follow_the_architecture():
    small = ModelConfig(bottleneck=2, base_width=8)
    for scale, model in ((7, ModelConfig()), (8, ModelConfig()), (5, small)):
        convs = distinct(model_sites(scale, ("conv", "conv_transpose"), model))
        got = Counter({_geometry(s): s.count for s in convs})
        assert got == _expected_convs(scale, model.base_width, model.bottleneck), scale
        assert len(convs) == len(got)  # one record per geometry


def test_distinct_sites_count_the_modules_of_one_call():
    sites = model_sites(7)
    merged = distinct(sites)
    assert sum(s.count for s in merged) == len(sites)
    norms = [(s.cin, s.edge, s.groups, s.count) for s in merged if s.op == "group_norm"]
    assert norms == [(64, 128, 8, 4), (128, 64, 8, 4), (256, 32, 8, 4), (512, 16, 8, 4), (1024, 8, 8, 2)]
    pair = next(s for s in merged if s.name == "inc.conv2")
    assert pair.names == ("inc.conv2", "ups.3.conv.conv2")  # the same 64-channel conv at 128³


def test_concat_and_pool_sites():
    sites = model_sites(7, ("concat", "pool"))
    for s in sites:
        if s.op == "concat":  # the skip and the upsampled tensor, side by side
            assert len(s.inputs) == 2 and s.inputs[0] == s.inputs[1]
            assert s.output == (1, 2 * s.cin, s.edge, s.edge, s.edge)
        else:
            assert s.output == (1, s.cin) + (s.edge // 2,) * 3
    pools = [(s.cin, s.edge) for s in sites if s.op == "pool"]
    assert pools == [(64, 128), (128, 64), (256, 32), (512, 16)]


def test_sites_filter_by_module_name():
    sites = distinct(model_sites(7, ("conv", "conv_transpose")))
    assert [s.name for s in sites if s.matches(["outc", "ups.0.up"])] == ["ups.0.up", "outc"]
    assert [s.name for s in sites if s.matches(["ups.3.conv.conv2"])] == ["inc.conv2"]
    assert all(s.matches(None) for s in sites)
