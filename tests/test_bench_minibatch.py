"""The step benchmark's breakdown sorts our kernels into the parts of the step they belong to."""
from scaffold.bench.minibatch import category
from scaffold.kernels import concat, groupnorm, norm_head, seg_loss


def test_our_kernels_land_in_their_parts():
    gn = [k for k in dir(groupnorm) if k.startswith("_gn_") and k.endswith("_kernel")]
    assert len(gn) == 7 and all(category(k) == "group_norm" for k in gn)
    loss = [k for k in dir(seg_loss) if k.endswith("_kernel")]
    assert loss and all(category(k) == "loss" for k in loss)
    cat = [k for k in dir(concat) if k.endswith("_kernel")]
    assert cat and all(category(k) == "concat" for k in cat)
    nh = [k for k in dir(norm_head) if k.startswith("_nh_") and k.endswith("_kernel")]
    assert len(nh) == 4 and all(category(k) == "norm_head" for k in nh)
    # Vendor kernels as the profiler names them.
    assert category("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "conv"
    assert category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert category("void at::native::elementwise_kernel<128, 2, ...>") == "other"


def test_the_separate_head_variant_builds_the_model_without_the_fusion():
    import torch

    from scaffold.bench.minibatch import build

    fused, _, _ = build("ladder", 4, 8, torch.device("cpu"))
    apart, _, cfg = build("ladder+separatehead", 4, 8, torch.device("cpu"))
    assert fused.fuse_head and not apart.fuse_head and cfg.model.recompute == "off"
    both, _, cfg = build("ladder+recompute+separatehead", 4, 8, torch.device("cpu"))
    assert not both.fuse_head and cfg.model.recompute == "blocks"


def test_breakdown_without_cuda_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    import torch

    from scaffold.bench import minibatch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "m.json"
    assert minibatch.main(["--scale", "3", "--width", "4", "--variants", "vendor", "--steps", "1", "--reps", "1",
                           "--warmup", "0", "--breakdown", "--out", str(out)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("--breakdown:") and "no CUDA device" in err[0]
    assert out.is_file()


def test_an_alt_variant_runs_with_the_other_route_table_and_puts_the_committed_one_back(tmp_path, monkeypatch,
                                                                                       capsys):
    import json

    import pytest
    import torch

    from scaffold.bench import minibatch
    from scaffold.model import routes

    committed = dict(routes.ROUTES)
    key = "sm90|bf16|conv|64>64|k3s1p1d1|128x128x128"
    other = {key: ("vendor", "triton", "vendor")}
    py = tmp_path / "routes.py"
    py.write_text(f"ROUTES = {other!r}\n")
    js = tmp_path / "routes.json"
    js.write_text(json.dumps({"device": "x", "routes": {key: list(other[key])}}))
    assert minibatch.load_routes(str(py)) == other == minibatch.load_routes(str(js))
    seen = []
    real = minibatch.make_step

    def spy(variant, *a, **k):
        seen.append((variant, dict(routes.ROUTES)))
        return real(variant, *a, **k)

    monkeypatch.setattr(minibatch, "make_step", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "m.json"
    assert minibatch.main(["--scale", "3", "--width", "4", "--variants", "ladder,ladder@alt", "--steps", "1",
                           "--reps", "1", "--warmup", "0", "--alt-routes", str(py), "--out", str(out)]) == 0
    assert seen == [("ladder", committed), ("ladder", other)]
    assert routes.ROUTES == committed
    assert [r["variant"] for r in json.loads(out.read_text())["results"]] == ["ladder", "ladder@alt"]
    with pytest.raises(SystemExit):  # an @alt variant without a table: one line, before any work
        minibatch.main(["--variants", "ladder@alt", "--out", str(out)])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for path in (bad, tmp_path / "missing.py"):
        with pytest.raises(SystemExit):
            minibatch.main(["--variants", "ladder@alt", "--alt-routes", str(path), "--out", str(out)])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert err[-1].count("--alt-routes") == 1 and str(path) in err[-1]
