"""The deterministic 2×2×2 max pool: bitwise forward, max_pool3d's gradient, strict mode, layouts."""
import pytest
import torch
import torch.nn.functional as F

from scaffold.model.pool import max_pool2


@pytest.fixture
def strict():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_bitwise_and_gradient(channels_last, dtype, strict):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, 8, 4, generator=g).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    ya, yb = max_pool2(a), F.max_pool3d(b, 2)
    assert ya.shape == yb.shape == (2, 5, 3, 4, 2)
    assert torch.equal(ya, yb)
    if channels_last:
        assert ya.is_contiguous(memory_format=torch.channels_last_3d)
    up = torch.randn(ya.shape, generator=g).to(dtype)
    ya.backward(up)
    yb.backward(up)
    assert torch.equal(a.grad, b.grad)
    assert a.grad.shape == x.shape and (a.grad != 0).sum() == ya.numel()  # one element per window


def test_ties_send_the_gradient_to_the_first_element_in_window_order():
    x = torch.zeros(1, 1, 2, 2, 2)
    x[0, 0, 1, 0, 1] = 1.0
    x[0, 0, 0, 1, 1] = 1.0  # earlier in (d, h, w) order than the one above
    a = x.clone().requires_grad_()
    max_pool2(a).sum().backward()
    expected = torch.zeros_like(x)
    expected[0, 0, 0, 1, 1] = 1.0
    assert torch.equal(a.grad, expected)
    b = x.clone().requires_grad_()
    F.max_pool3d(b, 2).sum().backward()
    assert torch.equal(b.grad, expected)  # the same choice as max_pool3d on this device


def test_nan_propagates_like_max_pool3d():
    x = torch.randn(1, 2, 4, 4, 4)
    x[0, 1, 2, 3, 0] = float("nan")
    assert torch.equal(max_pool2(x).isnan(), F.max_pool3d(x, 2).isnan())


def test_odd_size_is_rejected():
    with pytest.raises(ValueError, match=r"even D, H, W.*\(1, 1, 4, 3, 4\)"):
        max_pool2(torch.zeros(1, 1, 4, 3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True])
def test_matches_max_pool3d_on_cuda_under_strict_mode(channels_last, strict):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 16, 32, 32, 32, device="cuda", generator=g).bfloat16()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    a = x.clone().requires_grad_()
    y = max_pool2(a)
    assert torch.equal(y, F.max_pool3d(x, 2))
    up = torch.randn(y.shape, device="cuda", generator=g).bfloat16()
    y.backward(up)
    torch.use_deterministic_algorithms(False)  # max_pool3d's own CUDA backward is refused under strict
    b = x.clone().requires_grad_()
    F.max_pool3d(b, 2).backward(up)
    assert torch.equal(a.grad, b.grad)
