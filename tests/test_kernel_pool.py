"""2×2×2 max-pool Triton kernel: bitwise the vendor formulation (and F.max_pool3d) forward and backward,
ties and NaN as torch.max picks them, every output element written, any input strides."""
import pytest
import torch
import torch.nn.functional as F

from scaffold.kernels import pool as P
from scaffold.model.pool import max_pool2 as vendor_pool

CL = torch.channels_last_3d
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make(shape, dtype, seed=0, layout="cl", ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if ties:  # few distinct values: most windows hold their maximum more than once
        x = torch.randint(-2, 3, shape, generator=g).float()
    x = x.to(dtype)
    return x.contiguous(memory_format=CL) if layout == "cl" else x


def bits(t):
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


def run_both(x, seed=1):
    """(y, dx) of the Triton kernel and of the vendor formulation, for the same upstream gradient."""
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    ya, yb = P.max_pool2(a), vendor_pool(b)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(seed)).to(x.device, x.dtype)
    ya.backward(g)
    yb.backward(g)
    return ya, yb, a.grad, b.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ties", [False, True])
def test_bitwise_equal_to_vendor_and_max_pool3d(dtype, ties):
    x = make((2, 5, 6, 10, 14), dtype, ties=ties)  # odd channels, pooled 3 × 5 × 7
    ya, yb, ga, gb = run_both(x)
    assert ya.shape == (2, 5, 3, 5, 7) and ya.dtype == dtype and ya.is_contiguous(memory_format=CL)
    assert torch.equal(bits(ya), bits(yb.contiguous(memory_format=CL)))
    assert torch.equal(ya, F.max_pool3d(x.float(), 2).to(dtype))
    assert ga.dtype == dtype and ga.is_contiguous(memory_format=CL)
    assert torch.equal(bits(ga), bits(gb.contiguous(memory_format=CL)))
    assert (ga != 0).sum() <= ya.numel()  # at most one element per window (g may hold zeros)


def test_channel_blocks_and_layouts():
    # 160 channels: two channel blocks, the second partial; NCDHW input read through its strides
    for layout in ("cl", "ncdhw"):
        x = make((1, 160, 4, 2, 6), torch.bfloat16, seed=2, layout=layout, ties=True)
        ya, yb, ga, gb = run_both(x, seed=3)
        assert torch.equal(ya, yb) and torch.equal(ga, gb)


def test_first_maximum_in_window_order_nan_and_signed_zero():
    x = torch.zeros(1, 3, 2, 2, 2)
    x[0, 0, 1, 0, 1] = 1.0
    x[0, 0, 0, 1, 1] = 1.0  # earlier in (d, h, w) order: takes the gradient
    x[0, 1] = -1.0
    x[0, 1, 0, 1, 0] = float("nan")
    x[0, 1, 1, 1, 1] = float("nan")  # a later NaN: the first one is kept
    x[0, 2, 0, 0, 0] = -0.0  # -0.0 == +0.0: the first element's bits are the result
    for dtype in DTYPES:
        xc = x.to(dtype).contiguous(memory_format=CL)
        y, index = P.pool_forward(xc)
        assert index.flatten().tolist() == [3, 2, 0]
        assert y[0, 1].isnan().all() and torch.signbit(y[0, 2]).all()
        ya, yb, ga, gb = run_both(xc)
        assert torch.equal(bits(ya), bits(yb.contiguous(memory_format=CL)))
        assert torch.equal(ga, gb)


def test_every_output_element_written():
    x = make((2, 6, 4, 6, 2), torch.float32, seed=4)
    y = torch.full((2, 6, 2, 3, 1), float("nan")).contiguous(memory_format=CL)
    index = torch.full((2, 6, 2, 3, 1), 255, dtype=torch.uint8).contiguous(memory_format=CL)
    P.pool_forward(x, out=y, index=index)
    assert torch.equal(y, F.max_pool3d(x, 2)) and int(index.max()) <= 7
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    dx = torch.full(x.shape, float("nan")).contiguous(memory_format=CL)
    P.pool_backward(g, index, torch.float32, out=dx)
    xr = x.clone().requires_grad_()
    F.max_pool3d(xr, 2).backward(g)
    assert torch.equal(dx, xr.grad)


def test_second_derivative_raises():
    x = make((1, 2, 2, 2, 2), torch.float32).requires_grad_()
    (g,) = torch.autograd.grad(P.max_pool2(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_unsupported_input_names_the_shape():
    with pytest.raises(ValueError, match=r"max_pool2: unsupported input \(1, 1, 4, 3, 4\)"):
        P.max_pool2(torch.zeros(1, 1, 4, 3, 4))
    assert not P.max_pool2_supported(torch.zeros(1, 1, 4, 4, 4, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 64, 128, 128, 128), (1, 128, 64, 64, 64), (1, 256, 32, 32, 32),
                                   (1, 512, 16, 16, 16), (1, 1024, 8, 8, 8)])
def test_gpu_model_sites_bitwise_and_repeatable(shape):
    """The scale-7 and scale-8 pool sites' shapes (bf16, channels-last): the kernel gives bitwise the
    vendor formulation's values and gradient, and repeated calls give the same bits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=g).bfloat16().contiguous(memory_format=CL)
    ya, yb, ga, gb = run_both(x)
    assert torch.equal(bits(ya), bits(yb.contiguous(memory_format=CL)))
    assert torch.equal(bits(ga), bits(gb.contiguous(memory_format=CL)))
    assert torch.equal(ya, F.max_pool3d(x, 2))
    y2, i2 = P.pool_forward(x)
    y3, i3 = P.pool_forward(x)
    assert torch.equal(bits(y2), bits(y3)) and torch.equal(i2, i3)


# The tests below run on CUDA where there is a GPU, else on the CPU under Triton's interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["cl", "ncdhw"])
def test_the_skip_gradient_added_in_the_backward_gives_autograds_sum(dtype, layout):
    """(pool(x), x) from max_pool2_with_skip: the same values, and x's gradient bitwise the one
    autograd gives when the pool and the skip read x apart (its two gradients summed by an add),
    including a skip gradient in another layout, signed zeros, and one of the two gradients absent."""
    x = make((2, 5, 4, 6, 4), dtype, seed=3, layout=layout).to(DEV)
    gen = torch.Generator().manual_seed(4)
    gy = torch.randn(2, 5, 2, 3, 2, generator=gen).to(DEV, dtype)
    gs = torch.randn(x.shape, generator=gen).to(DEV, dtype)
    gs[0, 0] = -0.0  # 0 + (-0) is +0 in autograd's add: the fused sum must agree
    for upstream in ((gy, gs), (gy, gs.contiguous()), (gy, None), (None, gs)):
        a = x.clone().requires_grad_()
        b = x.clone().requires_grad_()
        ya, skip = P.max_pool2_with_skip(a)
        yb = P.max_pool2(b)
        assert torch.equal(bits(ya), bits(yb)) and torch.equal(bits(skip), bits(x))
        outs_a = [t for t, g in zip((ya, skip), upstream) if g is not None]
        outs_b = [t for t, g in zip((yb, b), upstream) if g is not None]
        grads = [g for g in upstream if g is not None]
        (da,) = torch.autograd.grad(outs_a, a, grads)
        (db,) = torch.autograd.grad(outs_b, b, grads)
        assert torch.equal(bits(da), bits(db))


def test_the_unet_with_the_fused_skip_gradient_gives_the_bits_of_the_plain_one(monkeypatch):
    """The U-Net reads its skips from the pool (Down.with_skip): its loss and every parameter's gradient
    are bitwise those of the model whose skips read x apart from the pool."""
    from scaffold import determinism
    from scaffold.config import LadderConfig
    from scaffold.model.blocks import Down
    from scaffold.model.ladder import set_ladder
    from scaffold.model.unet import UNet3d

    determinism.configure("default")  # on CUDA: deterministic cuDNN, no TF32, as a run has it
    torch.manual_seed(0)
    model = UNet3d(3, bottleneck=2, base_width=4, groups=2, n_classes=3).to_device(DEV)
    set_ladder(model, LadderConfig(pool="triton"))
    x = torch.randn(1, 3, 8, 8, 8, generator=torch.Generator().manual_seed(5)).to(DEV)

    def grads():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    fused = grads()
    monkeypatch.setattr(Down, "with_skip", lambda self, t, room=0: (t, self(t)))
    plain = grads()
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert {n for _, m in model.named_modules() for n in getattr(m, "rungs_ran", ())
            if type(m).__name__ == "FastMaxPool2"} == {"triton"}
