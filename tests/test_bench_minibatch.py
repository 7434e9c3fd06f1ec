"""The step benchmark's breakdown sorts our kernels into the parts of the step they belong to."""
from scaffold.bench.minibatch import category
from scaffold.kernels import concat, groupnorm, seg_loss


def test_our_kernels_land_in_their_parts():
    gn = [k for k in dir(groupnorm) if k.startswith("_gn_") and k.endswith("_kernel")]
    assert len(gn) == 7 and all(category(k) == "group_norm" for k in gn)
    loss = [k for k in dir(seg_loss) if k.endswith("_kernel")]
    assert loss and all(category(k) == "loss" for k in loss)
    cat = [k for k in dir(concat) if k.endswith("_kernel")]
    assert cat and all(category(k) == "concat" for k in cat)
    # Vendor kernels as the profiler names them.
    assert category("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "conv"
    assert category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert category("void at::native::elementwise_kernel<128, 2, ...>") == "other"
