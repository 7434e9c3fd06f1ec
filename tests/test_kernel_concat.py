"""Skip-concat Triton kernel: bitwise equal to torch.cat(...).to(dtype), and its gradient split."""
import pytest
import torch

from scaffold.kernels import concat as cc

CL = torch.channels_last_3d
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make(ca, cb, spatial, a_dtype, b_dtype, seed=0, layout="cl"):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn((2, ca) + spatial, generator=g) * 300).to(a_dtype)
    b = (torch.randn((2, cb) + spatial, generator=g) * 300).to(b_dtype)
    if layout == "cl":
        a, b = a.contiguous(memory_format=CL), b.contiguous(memory_format=CL)
    return a, b


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 3.3e38 -> fp16 is inf, as in torch
@pytest.mark.parametrize("a_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_bitwise_equal_to_torch_cat_then_cast(a_dtype, out_dtype):
    a, b = make(8, 24, (3, 5, 7), a_dtype, torch.bfloat16)
    a[0, 1, 0, 0, :3] = torch.tensor([float("inf"), -1e-40, 3.3e38]).to(a_dtype)  # edges of the cast
    out = cc.concat_channels(a, b, out_dtype)
    assert out.dtype == out_dtype and out.is_contiguous(memory_format=CL)
    assert torch.equal(out, torch.cat([a, b], dim=1).to(out_dtype))


@pytest.mark.parametrize("layout", ["cl", "ncdhw"])
def test_default_dtype_odd_channels_and_layouts(layout):
    a, b = make(5, 3, (2, 3, 5), torch.float32, torch.bfloat16, layout=layout)
    out = cc.concat_channels(a, b)
    assert out.dtype == torch.float32  # torch.cat's promotion
    assert torch.equal(out, torch.cat([a, b], dim=1))
    assert torch.equal(cc.concat_channels(b, a), torch.cat([b, a], dim=1))


def test_gradient_is_split_and_cast_back():
    a, b = make(8, 16, (3, 5, 7), torch.float32, torch.bfloat16)
    a.requires_grad_()
    b.requires_grad_()
    out = cc.concat_channels(a, b, torch.bfloat16)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ga, gb = torch.autograd.grad(out, (a, b), g)  # g is NCDHW: the split reads it through strides
    assert ga.dtype == torch.float32 and gb.dtype == torch.bfloat16
    assert torch.equal(ga, g[:, :8].float()) and torch.equal(gb, g[:, 8:])


def test_nan_stays_nan_and_every_element_written():
    a, b = make(4, 4, (3, 3, 3), torch.float32, torch.float32)
    a[1, 2, 1, 1, 1] = float("nan")
    out = torch.full((2, 8, 3, 3, 3), float("nan"), dtype=torch.bfloat16).contiguous(memory_format=CL)
    out = cc.concat_forward(a, b, torch.bfloat16, out=out)
    assert out.isnan().sum() == 1 and out[1, 2, 1, 1, 1].isnan()
    ga, gb = cc.split_backward(out.float(), 4, torch.float32, torch.bfloat16)
    assert ga.isnan().sum() == 1 and not gb.isnan().any()


def test_eager_path_gives_the_registered_ops_bits():
    """concat_channels runs eagerly as a plain autograd Function (no custom-op dispatch), the
    registered op under torch.compile: same output, same gradient parts."""
    a, b = make(8, 16, (3, 5, 7), torch.float32, torch.bfloat16)
    g = torch.randn(2, 24, 3, 5, 7, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    outs = []
    for eager in (True, False):
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = cc.concat_channels(a_, b_, torch.bfloat16) if eager else cc.concat_op(a_, b_, torch.bfloat16)
        assert (type(out.grad_fn).__name__ == "_ConcatFnBackward") == eager
        outs.append((out, *torch.autograd.grad(out, (a_, b_), g)))
    for e, r in zip(*outs):
        assert e.dtype == r.dtype and torch.equal(e, r)


def test_second_derivative_is_refused():
    a, b = make(2, 2, (2, 2, 2), torch.float32, torch.float32)
    a.requires_grad_()
    out = cc.concat_channels(a, b)
    g = torch.ones_like(out, requires_grad=True)
    (ga,) = torch.autograd.grad(out, a, g, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        ga.sum().backward()


def test_custom_ops_pass_opcheck():
    a, b = make(3, 5, (2, 2, 3), torch.float32, torch.bfloat16)
    a.requires_grad_()
    b.requires_grad_()
    torch.library.opcheck(torch.ops.scaffold.concat_channels.default, (a, b, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    g = torch.randn(2, 8, 2, 2, 3)
    torch.library.opcheck(torch.ops.scaffold.split_channels.default,
                          (g, 3, torch.float32, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))


def test_supported_and_one_line_error():
    a, b = make(4, 4, (2, 2, 2), torch.float32, torch.float32)
    assert cc.concat_supported(a, b)
    assert not cc.concat_supported(a, b[:, :, :1])
    assert not cc.concat_supported(a, b.double())
    with pytest.raises(ValueError, match="equal N, D, H, W"):
        cc.concat_channels(a, b[:, :, :1])
    with pytest.raises(ValueError, match="dtype=torch.int32"):
        cc.concat_channels(a, b, torch.int32)
