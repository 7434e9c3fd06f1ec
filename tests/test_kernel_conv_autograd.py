"""The conv rung's entry points: autograd against F.conv3d / F.conv_transpose3d, autocast casting,
NDHWC outputs and the *_supported predicates."""
import pytest
import torch
import torch.nn.functional as F

from scaffold.kernels import conv as K
from scaffold.model import conv as C
from scaffold.model import policy as P
from scaffold.kernels.lib.device import triton_usable

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not triton_usable(torch.empty(0, device=DEV)):
    pytest.skip("Triton cannot run here", allow_module_level=True)
CL = torch.channels_last_3d


@pytest.fixture(autouse=True)
def full_fp32():
    """fp32 references in full fp32 on CUDA too (cuDNN and cuBLAS default to TF32 there, which is
    far outside these tolerances), as scaffold.determinism.configure sets them for a run."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def leaves(gen, *shapes, dtype=torch.float32):
    return [torch.randn(*s, generator=gen).to(DEV, dtype).requires_grad_() for s in shapes]


def grads_of(fn, tensors, dy):
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    out.backward(dy)
    return out.detach(), [t.grad.clone() for t in tensors]


def close(a, b, tol):
    return ((a.double() - b.double()).norm() / b.double().norm()).item() < tol


def test_conv3d_autograd_matches_torch():
    gen = torch.Generator().manual_seed(0)
    x, w, b = leaves(gen, (1, 5, 4, 3, 5), (6, 5, 3, 3, 3), (6,))
    dy = torch.randn(1, 6, 4, 3, 5, generator=gen).to(DEV)
    geom = ((1, 1, 1), (1, 1, 1), (1, 1, 1))
    y, g = grads_of(lambda *a: C.conv3d(*a, *geom), (x, w, b), dy)
    y_ref, g_ref = grads_of(lambda *a: F.conv3d(*a, *geom), (x, w, b), dy)
    assert y.is_contiguous(memory_format=CL)
    assert close(y, y_ref, 1e-5)
    for name, a, r in zip(("dx", "dw", "db"), g, g_ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert close(a, r, 1e-5), name


def test_conv_transpose3d_autograd_matches_torch():
    gen = torch.Generator().manual_seed(1)
    x, w, b = leaves(gen, (2, 4, 2, 3, 2), (4, 3, 2, 2, 2), (3,))
    x2 = x.detach().contiguous(memory_format=CL).requires_grad_()
    dy = torch.randn(2, 3, 4, 6, 4, generator=gen).to(DEV)
    y, g = grads_of(lambda *a: C.conv_transpose3d(*a, (2, 2, 2)), (x2, w, b), dy)
    y_ref, g_ref = grads_of(lambda *a: F.conv_transpose3d(*a, stride=2), (x, w, b), dy)
    assert y.is_contiguous(memory_format=CL)
    assert close(y, y_ref, 1e-5)
    for name, a, r in zip(("dx", "dw", "db"), g, g_ref):
        assert close(a, r, 1e-5), name


def test_conv3d_follows_autocast_like_vendor():
    """Under autocast the vendor op returns the autocast dtype and fp32 leaves get fp32 grads."""
    gen = torch.Generator().manual_seed(2)
    x, w, b = leaves(gen, (1, 3, 3, 5, 4), (6, 3, 1, 1, 1), (6,))
    geom = ((1, 1, 1), (0, 0, 0), (1, 1, 1))
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        y = C.conv3d(x, w, b, *geom)
        y_ref = F.conv3d(x, w, b, *geom)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32
    assert close(y, y_ref, 1e-2)


def test_conv_transpose3d_follows_autocast():
    gen = torch.Generator().manual_seed(3)
    x, w, b = leaves(gen, (1, 4, 2, 2, 2), (4, 3, 2, 2, 2), (3,))
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        y = C.conv_transpose3d(x, w, b, (2, 2, 2))
        y_ref = F.conv_transpose3d(x, w, b, stride=2)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert close(y, y_ref, 1e-2)


def test_supported_predicates():
    x = torch.zeros(1, 4, 3, 3, 3, device=DEV)
    w = torch.zeros(6, 4, 3, 3, 3, device=DEV)
    one, zero = (1, 1, 1), (0, 0, 0)
    assert K.conv3d_supported(x, w, None, one, one, one, 1)
    assert not K.conv3d_supported(x, w, None, one, one, one, 2)
    assert not K.conv3d_supported(x[0], w, None, one, one, one, 1)
    assert not K.conv3d_supported(x.double(), w.double(), None, one, one, one, 1)
    assert not K.conv3d_supported(x, w[:, :3], None, one, one, one, 1)
    assert not K.conv3d_supported(x, w, torch.zeros(5, device=DEV), one, one, one, 1)
    wt = torch.zeros(4, 6, 2, 2, 2, device=DEV)
    two = (2, 2, 2)
    assert K.conv_transpose3d_supported(x, wt, None, two, zero, zero, 1, one)
    assert not K.conv_transpose3d_supported(x, wt, None, one, zero, zero, 1, one)
    assert not K.conv_transpose3d_supported(x, wt, None, two, one, zero, 1, one)
    assert not K.conv_transpose3d_supported(x, wt, None, two, zero, one, 1, one)


def test_conv_transpose3d_rejects_kernel_not_stride():
    x = torch.zeros(1, 4, 2, 2, 2, device=DEV)
    with pytest.raises(ValueError, match="kernel .* must equal stride"):
        C.conv_transpose3d(x, torch.zeros(4, 3, 3, 3, 3, device=DEV), None, (2, 2, 2))


ROUTES = [(f, d, w) for f in (True, False) for d in (True, False) for w in (True, False)]


def _spy(monkeypatch, names):
    """Counts calls of the Triton launchers `names` (module globals of kernels.conv)."""
    calls = {n: 0 for n in names}
    for n in names:
        real = getattr(K, n)

        def spy(*a, _n=n, _real=real, **kw):
            calls[_n] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(K, n, spy)
    return calls


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "".join("tv"[not t] for t in r))
def test_conv3d_route_runs_each_direction_where_it_says(route, monkeypatch):
    """A route (forward, backward-data, backward-weight) on Triton or ATen: same values as F.conv3d
    for every mix, and the Triton launchers run exactly for the directions routed to Triton; the
    bias gradient runs on ours whatever the route."""
    calls = _spy(monkeypatch, ["conv3d_forward", "conv3d_backward_data", "conv3d_backward_weight",
                               "bias_grad"])
    gen = torch.Generator().manual_seed(4)
    x, w, b = leaves(gen, (1, 4, 3, 4, 5), (8, 4, 3, 3, 3), (8,))
    dy = torch.randn(1, 8, 3, 4, 5, generator=gen).to(DEV)
    geom = ((1, 1, 1), (1, 1, 1), (1, 1, 1))
    y, g = grads_of(lambda *a: C.conv3d(*a, *geom, route=route), (x, w, b), dy)
    y_ref, g_ref = grads_of(lambda *a: F.conv3d(*a, *geom), (x, w, b), dy)
    assert close(y, y_ref, 1e-5)
    for name, a, r in zip(("dx", "dw", "db"), g, g_ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert close(a, r, 1e-5), name
    assert calls == {"conv3d_forward": int(route[0]), "conv3d_backward_data": int(route[1]),
                     "conv3d_backward_weight": int(route[2]), "bias_grad": 1}


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "".join("tv"[not t] for t in r))
def test_conv_transpose3d_route_runs_each_direction_where_it_says(route, monkeypatch):
    calls = _spy(monkeypatch, ["conv_transpose3d_forward", "conv_transpose3d_backward_data",
                               "conv_transpose3d_backward_weight", "bias_grad"])
    gen = torch.Generator().manual_seed(5)
    x, w, b = leaves(gen, (1, 8, 2, 3, 2), (8, 4, 2, 2, 2), (4,))
    dy = torch.randn(1, 4, 4, 6, 4, generator=gen).to(DEV)
    y, g = grads_of(lambda *a: C.conv_transpose3d(*a, (2, 2, 2), route=route), (x, w, b), dy)
    y_ref, g_ref = grads_of(lambda *a: F.conv_transpose3d(*a, stride=2), (x, w, b), dy)
    assert close(y, y_ref, 1e-5)
    for name, a, r in zip(("dx", "dw", "db"), g, g_ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert close(a, r, 1e-5), name
    assert calls == {"conv_transpose3d_forward": int(route[0]),
                     "conv_transpose3d_backward_data": int(route[1]),
                     "conv_transpose3d_backward_weight": int(route[2]), "bias_grad": 1}


def test_routed_rung_follows_the_table(monkeypatch):
    """The `routed` rung looks its shape up in ROUTES (autocast's dtype under autocast): a listed shape
    runs the listed directions on Triton; it refuses unlisted and all-vendor shapes."""
    from scaffold.model import routes

    calls = _spy(monkeypatch, ["conv3d_forward", "conv3d_backward_data", "conv3d_backward_weight"])
    gen = torch.Generator().manual_seed(6)
    x, w = leaves(gen, (1, 8, 4, 4, 4), (8, 8, 3, 3, 3))
    one = (1, 1, 1)
    call = P.ConvCall(x, w, None, one, one, one, 1)
    routed = P.rung("conv", "routed")
    monkeypatch.setattr(routes, "ROUTES", {})
    assert not routed.supports(call)
    key = routes.route_key(routes.arch_key(DEV), torch.float32, "conv", 8, 8, (3, 3, 3), one, one, one,
                           (4, 4, 4))
    routes.ROUTES[key] = ("vendor", "vendor", "vendor")
    assert not routed.supports(call)
    routes.ROUTES[key] = ("vendor", "triton", "vendor")
    assert routed.supports(call)
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        assert not routed.supports(call)  # the bf16 key is not listed
    routed.forward(call).sum().backward()
    assert calls == {"conv3d_forward": 0, "conv3d_backward_data": 1, "conv3d_backward_weight": 0}


def test_routed_rung_takes_all_vendor_shapes_with_a_bias(monkeypatch):
    """An all-vendor route still goes through the routed rung when the conv has a bias, whose
    gradient then runs on our kernel (every direction on ATen, values as F.conv_transpose3d);
    without a bias the rung refuses it (the vendor rung runs it as it is)."""
    from scaffold.model import routes

    calls = _spy(monkeypatch, ["conv_transpose3d_forward", "conv_transpose3d_backward_data",
                               "conv_transpose3d_backward_weight", "bias_grad"])
    gen = torch.Generator().manual_seed(7)
    x, w, b = leaves(gen, (1, 8, 2, 3, 2), (8, 4, 2, 2, 2), (4,))
    two = (2, 2, 2)
    routed = P.rung("conv_transpose", "routed")
    key = routes.route_key(routes.arch_key(DEV), torch.float32, "convT", 8, 4, two, two, (0, 0, 0),
                           (1, 1, 1), (2, 3, 2))
    monkeypatch.setattr(routes, "ROUTES", {key: ("vendor", "vendor", "vendor")})
    z, one = (0, 0, 0), (1, 1, 1)
    assert not routed.supports(P.ConvTransposeCall(x, w, None, two, z, z, 1, one))
    call = P.ConvTransposeCall(x, w, b, two, z, z, 1, one)
    assert routed.supports(call)
    dy = torch.randn(1, 4, 4, 6, 4, generator=gen).to(DEV)
    y, g = grads_of(lambda *a: routed.forward(P.ConvTransposeCall(*a, two, z, z, 1, one)), (x, w, b), dy)
    y_ref, g_ref = grads_of(lambda *a: F.conv_transpose3d(*a, stride=2), (x, w, b), dy)
    assert close(y, y_ref, 1e-5)
    for name, a, r in zip(("dx", "dw", "db"), g, g_ref):
        assert close(a, r, 1e-5), name
    assert calls == {"conv_transpose3d_forward": 0, "conv_transpose3d_backward_data": 0,
                     "conv_transpose3d_backward_weight": 0, "bias_grad": 1}
