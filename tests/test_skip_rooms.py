"""Skips written with room for their concat's other half (UNet3d._skip_rooms): a GroupNorm leaves channels
of room after its output, the transposed conv (Triton forward) writes into that room, and the concat
copies only what is not in place yet. The same values and gradients, bit for bit, as the plain concat;
these tests fail if the room is not used where it should be, used where it must not be, or changes a bit.
On CUDA they run on the GPU, elsewhere in Triton's interpreter."""
import pytest
import torch

from scaffold.kernels import concat as K
from scaffold.kernels import groupnorm as GN
from scaffold.kernels.lib.layout import room_base

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CL = torch.channels_last_3d


def bits(t):
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


def rand(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEV, dtype).contiguous(memory_format=CL)


def norm(x, room=0):
    w = torch.linspace(0.5, 1.5, x.shape[1], device=DEV)
    b = torch.linspace(-0.2, 0.2, x.shape[1], device=DEV)
    return GN.group_norm(x, 2, w, b, 1e-5, True, out_dtype=torch.bfloat16, room=room)


def test_group_norm_with_room_gives_the_same_values_inside_a_wider_buffer():
    x = rand((2, 4, 4, 4, 6), 0).requires_grad_()
    y = norm(x, room=3)
    plain = norm(x)
    assert y._base is not None and tuple(y._base.shape) == (2, 7, 4, 4, 6)
    assert y._base.is_contiguous(memory_format=CL) and y.data_ptr() == y._base.data_ptr()
    assert torch.equal(bits(y), bits(plain))
    g = rand(y.shape, 1, torch.bfloat16)
    (da,) = torch.autograd.grad(y, x, g)
    (db,) = torch.autograd.grad(plain, x, g)
    assert torch.equal(bits(da), bits(db))


def _both_ways(x_seed, b_dtype):
    """(out, grads) of cat([GroupNorm(x), b]) into the room and as the plain concat."""
    results = []
    for room in (True, False):
        x = rand((1, 4, 4, 6, 4), x_seed).requires_grad_()
        b = rand((1, 5, 4, 6, 4), x_seed + 1, b_dtype).requires_grad_()
        a = norm(x, room=5 if room else 0)
        out = K.concat_channels(a, b, torch.bfloat16, into_room=room)
        shared = out.data_ptr() == a.data_ptr()
        g = rand(out.shape, x_seed + 2, torch.bfloat16)
        out.backward(g)
        results.append((out.detach(), x.grad, b.grad, shared))
    return results


@pytest.mark.parametrize("b_dtype", [torch.bfloat16, torch.float32])
def test_concat_into_the_room_gives_torch_cat_and_the_same_gradients(b_dtype):
    (out, dx, db, shared), (out0, dx0, db0, shared0) = _both_ways(3, b_dtype)
    assert shared and not shared0  # the room was used, and only where asked for
    assert torch.equal(bits(out), bits(out0))
    assert torch.equal(out.float(), torch.cat([out0[:, :4], out0[:, 4:]], dim=1).float())
    assert torch.equal(bits(dx), bits(dx0)) and db.dtype == b_dtype
    assert torch.equal(db, db0)


def test_the_room_is_only_taken_where_it_is_exactly_there():
    a_plain = rand((1, 4, 2, 2, 2), 0, torch.bfloat16)
    assert room_base(a_plain, 3, torch.bfloat16) is None  # no buffer behind it
    wide = rand((1, 9, 2, 2, 2), 1, torch.bfloat16)
    assert room_base(wide[:, :4], 3, torch.bfloat16) is None  # 5 channels after it, not 3
    assert room_base(wide[:, 1:5], 5, torch.bfloat16) is None  # not the buffer's first channels
    assert room_base(wide[:, :4], 5, torch.float32) is None  # another dtype
    assert room_base(wide[:, :4], 5, torch.bfloat16) is not None
    # into_room asked for without a room: the plain copy, whose result is its own tensor
    b = rand((1, 3, 2, 2, 2), 2, torch.bfloat16)
    out = K.concat_channels(a_plain, b, torch.bfloat16, into_room=True)
    assert out.data_ptr() != a_plain.data_ptr()
    assert torch.equal(out, torch.cat([a_plain, b], dim=1))


def _unet_bits(conv_transpose: str, amp: bool):
    from scaffold import determinism
    from scaffold.config import LadderConfig
    from scaffold.model.ladder import set_ladder
    from scaffold.model.unet import UNet3d

    determinism.configure("default")  # on CUDA: deterministic cuDNN, no TF32, as a run has it
    torch.manual_seed(0)
    model = UNet3d(3, bottleneck=1, base_width=4, groups=2, n_classes=3).to_device(DEV)
    set_ladder(model, LadderConfig(pool="triton", group_norm="triton", concat="triton",
                                   conv_transpose=conv_transpose))
    x = torch.randn(1, 3, 8, 8, 8, generator=torch.Generator().manual_seed(5)).to(DEV)
    shared = []
    for up in model.ups:
        up.concat.register_forward_hook(lambda m, i, o: shared.append(i[0].data_ptr() == o.data_ptr()))
    copies = []
    real_copy = K.copy_channels

    def counting_copy(*args, **kw):
        copies.append(1)
        return real_copy(*args, **kw)

    out = {}
    for rooms in (True, False):
        model.skip_rooms = rooms
        model.zero_grad(set_to_none=True)
        shared.clear()
        copies.clear()
        K.copy_channels = counting_copy
        try:
            with torch.autocast(DEV, torch.bfloat16, enabled=amp):
                y = model(x)
            y.float().square().sum().backward()
        finally:
            K.copy_channels = real_copy
        out[rooms] = (y.detach().clone(), [p.grad.clone() for p in model.parameters()], list(shared),
                      len(copies))
    return out


@pytest.mark.parametrize("conv_transpose,amp", [("triton", True), ("vendor", False)])
def test_the_unet_with_skip_rooms_gives_the_bits_of_the_plain_concat(conv_transpose, amp):
    out = _unet_bits(conv_transpose, amp)
    (y, grads, shared, copies), (y0, grads0, shared0, copies0) = out[True], out[False]
    assert shared == [True, True] and shared0 == [False, False]
    # With the room: the backward copies the upsampled half's gradient out at each level; the forward
    # copies it in only where the transposed conv ran on vendor (a Triton forward writes into the room).
    assert copies == (2 if conv_transpose == "triton" else 4) and copies0 == 0
    assert torch.equal(y, y0)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads0))


def test_no_room_under_recompute_spatial_shards_or_when_turned_off():
    from scaffold.model.unet import UNet3d

    model = UNet3d(4, bottleneck=2, base_width=4, groups=2, n_classes=3)
    assert model._skip_rooms(None) == [4, 8, 0]  # every skip's width; the bottom is no skip
    model.set_recompute("blocks")
    assert model._skip_rooms(None) == [0, 0, 0]
    with torch.no_grad():  # nothing recomputes without autograd
        assert model._skip_rooms(None) == [4, 8, 0]
    model.set_recompute("off")
    assert model._skip_rooms(object()) == [0, 0, 0]  # a spatially split model
    model.skip_rooms = False
    assert model._skip_rooms(None) == [0, 0, 0]


def test_the_memory_model_counts_the_room_only_where_the_model_leaves_it():
    from scaffold.model.memory import StepShape, walk

    s = StepShape(scale=7)
    assert s.rooms
    assert not StepShape(scale=7, recompute="blocks").rooms
    assert not StepShape(scale=7, depth_shards=2).rooms
    assert not StepShape(scale=7, fused=False).rooms
    # the training step keeps the same bytes (the concat's result is the skip's buffer either way);
    # an evaluation forward holds less (no separate skip next to its concat)
    from dataclasses import replace

    import scaffold.model.memory as M

    with_rooms = walk(s)
    original = StepShape.rooms
    try:
        StepShape.rooms = property(lambda self: False)
        without = walk(s)
    finally:
        StepShape.rooms = original
    assert with_rooms.saved == without.saved
    assert with_rooms.backward_peak == without.backward_peak
    assert with_rooms.eval_peak < without.eval_peak
    assert replace(s, recompute="blocks").rooms is False and M.StepShape is StepShape
