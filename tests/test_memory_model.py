"""The memory model (scaffold/model/memory.py): its parameter count and the bytes autograd saves,
against the real model on the CPU; what `model.recompute=auto` picks; the scale check's one line."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import saved_bytes, tiny_cfg
from scaffold.config import ConfigError
from scaffold import plan as run_plan
from scaffold.plan import validate
from scaffold.data.loader import make_input
from scaffold.loss import SegmentationLoss
from scaffold.model import memory
from scaffold.model.memory import StepShape, param_count, walk
from scaffold.model.unet import UNet3d


@pytest.mark.parametrize("scale, bottleneck, width", [(4, 3, 64), (7, 3, 64), (5, 2, 16), (6, 1, 8)])
def test_the_parameter_count_is_the_models(scale, bottleneck, width):
    model = UNet3d(scale, bottleneck, width, 8 if width >= 8 else 4, 3, 6)
    assert param_count(scale, bottleneck, width, 3, 6) == sum(p.numel() for p in model.parameters())


def _saved_bytes(scale: int, recompute: str, amp: bool, batch: int = 2, ladder=None, head=None) -> int:
    """Bytes of the distinct storages autograd saves in one forward + loss (parameters excluded), on
    the vendor rungs or those `ladder` sets (and `head` for the 1x1x1 head's conv)."""
    from scaffold.model import census, set_ladder

    torch.manual_seed(0)
    model = UNet3d(scale, 2, 8, 4, 3, 4)
    loss = SegmentationLoss(torch.ones(4))
    if ladder is not None:
        set_ladder(model, ladder)
        set_ladder(loss, ladder)
    if head is not None:
        model.outc.ladder_setting = head
        model.fuse_head = True
    model.set_recompute(recompute)
    edge = 2**scale
    labels = torch.randint(0, 4, (batch, edge, edge, edge), dtype=torch.uint8)
    with saved_bytes(model) as saved:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(make_input(labels, torch.rand(4, 3)))
        loss.terms(logits, labels)
    assert census(model)["fallbacks"] == []
    return saved["bytes"]


@pytest.mark.parametrize("scale", [3, 4, 5])
@pytest.mark.parametrize("recompute", ["off", "blocks"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_saved_bytes_are_what_autograd_saves(scale, recompute, amp):
    """Exact: the model lists every tensor the CPU forward saves (vendor rungs, fp32 or autocast)."""
    s = StepShape(scale, 2, 8, 4, 3, 4, 2, amp, "cpu", False, recompute, False)
    assert walk(s).saved == _saved_bytes(scale, recompute, amp)


def test_recompute_lowers_the_predicted_peak_and_scale_9_needs_it():
    off = memory.estimate(StepShape(9, graph=True), warmup=False)
    blocks = memory.estimate(StepShape(9, recompute="blocks", graph=True), warmup=False)
    assert blocks.step_peak < 0.6 * off.step_peak
    assert off.step_peak > 140 * memory.GiB  # more than an H200 holds


def test_auto_is_off_on_the_cpu(tmp_path):
    cfg = tiny_cfg(tmp_path, "model.recompute=auto")
    assert run_plan.recompute_mode(cfg, 3, "cpu")[0] == "off"


def test_auto_turns_recompute_on_when_the_run_would_not_fit(tmp_path):
    cfg = tiny_cfg(tmp_path, "model.recompute=auto", "scale=7", "model.bottleneck=3", "model.base_width=64",
                   "model.groups=8", "device=cuda")
    roomy = memory.DeviceMemory("cuda:0 (test)", 100 * memory.GiB, 140 * memory.GiB)
    tight = memory.DeviceMemory("cuda:0 (test)", 5 * memory.GiB, 140 * memory.GiB)
    big = run_plan.plan_recompute(cfg, "cpu", 6, memory=roomy)
    assert big.mode == "off"
    plan = run_plan.plan_recompute(cfg, "cpu", 6, memory=tight)
    assert plan.mode == "blocks" and plan.blocks.need < plan.off.need
    assert "model.recompute=auto -> blocks" in plan.line()
    assert run_plan.plan_recompute(tiny_cfg(tmp_path, "model.recompute=off"), "cpu", 6, memory=tight).mode == "off"


def test_the_scale_check_names_the_shard_count_it_would_need(tmp_path, monkeypatch):
    """scale 11 on 140 GiB devices. With 6 levels (model.bottleneck=5) refused in one line that names a
    shard count, and accepted at it; with the default 8 levels and the parameters replicated
    (parallel.fsdp=off) the model alone (23 G parameters) does not fit on one device however the
    volume is split, and the line says what to change (tests/test_fsdp.py: what FSDP changes)."""
    monkeypatch.setattr(run_plan, "target_device", lambda setting: "cuda:0")
    monkeypatch.setattr(run_plan, "device_memory",
                        lambda where, query_free=True: memory.DeviceMemory("cuda:0 (test)", 140 * memory.GiB,
                                                                           140 * memory.GiB))
    big = ["scale=11", "model.bottleneck=5", "model.base_width=64", "model.groups=8", "device=cuda"]
    with pytest.raises(ConfigError) as err:
        validate(tiny_cfg(tmp_path, *big))
    line = str(err.value)
    assert "\n" not in line and line.startswith("scale=11 needs ~")
    shards = int(line.rsplit("parallel.spatial_shards >= ", 1)[1])
    assert shards >= 2 and shards & (shards - 1) == 0
    validate(tiny_cfg(tmp_path, *big, f"parallel.spatial_shards={shards}"))
    with pytest.raises(ConfigError):
        validate(tiny_cfg(tmp_path, *big, f"parallel.spatial_shards={shards // 2}"))
    with pytest.raises(ConfigError, match="raise model.bottleneck"):
        validate(tiny_cfg(tmp_path, *big, "model.bottleneck=3", "parallel.spatial_shards=1024", "parallel.fsdp=off"))


def test_small_runs_pass_the_scale_check_on_this_machine(tmp_path):
    validate(tiny_cfg(tmp_path, "scale=7", "model.bottleneck=3", "model.base_width=64", "model.groups=8"))


def test_the_memory_benchmark_runs_on_the_cpu(tmp_path):
    import json

    from scaffold.bench.memory import main

    out = tmp_path / "memory.json"
    assert main(["--device", "cpu", "--scales", "4", "5", "--width", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scale"], r["variant"]) for r in rows] == [(4, "ladder"), (4, "ladder+recompute"),
                                                            (5, "ladder"), (5, "ladder+recompute")]
    assert all(r["predicted_gib"] > 0 for r in rows) and rows[3]["predicted_gib"] < rows[2]["predicted_gib"]


def test_graphs_give_way_to_eager_steps_only_where_they_would_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(run_plan, "device_memory",
                        lambda where, query_free=True: memory.DeviceMemory("cuda:0 (test)", 140 * memory.GiB,
                                                                           140 * memory.GiB))
    big = ["model.bottleneck=3", "model.base_width=64", "model.groups=8", "device=cuda"]
    assert run_plan.graph_plan(tiny_cfg(tmp_path, "scale=7", *big), "cuda:0", 6, "off")[0]
    fits, line = run_plan.graph_plan(tiny_cfg(tmp_path, "scale=9", *big), "cuda:0", 6, "blocks")
    assert not fits and line.endswith("cuda_graph=auto -> eager")


@pytest.mark.parametrize("recompute,head", [("off", "vendor"), ("blocks", "vendor"), ("off", "triton")])
def test_the_saved_bytes_of_our_rungs_are_what_autograd_saves(recompute, head):
    """The CUDA prediction's assumptions about our rungs (GroupNorm keeps its input and two statistics
    per group, the pool a uint8 index, the concat nothing, the loss its logits, labels and sums; the
    last GroupNorm fused with a Triton head keeps no normalized tensor), checked on the Triton
    interpreter at scale 3 (fp32; convs on vendor, which keep their input either way). The model leaves
    out the loss's class weights (4 bytes a class), which live as long as the run."""
    from scaffold.config import LadderConfig
    from scaffold.kernels.lib.device import triton_usable

    if not triton_usable(torch.empty(0)):
        pytest.skip("Triton cannot run here (no interpreter)")
    ladder = LadderConfig("vendor", "vendor", "triton", "triton", "triton", "triton")
    saved = _saved_bytes(3, recompute, False, ladder=ladder, head=head)
    s = StepShape(3, 2, 8, 4, 3, 4, 2, False, "cpu", True, recompute, False, fuse_head=True,
                  head_on_vendor=head == "vendor")
    assert s.fused_head == (head == "triton")
    assert saved == walk(s).saved + 4 * 4  # the class weights


def test_the_recompute_line_gives_the_eager_need_where_a_graph_would_not_fit(tmp_path):
    """Scale 9 on a 140 GiB device under cuda_graph=auto: recompute as a CUDA graph does not fit but
    eager steps do (the trainer falls back to them), so the start-up line gives both and does not call
    the run unfit; on a device where the eager need passes the headroom, it calls it tight."""
    cfg = tiny_cfg(tmp_path, "model.recompute=auto", "scale=9", "model.bottleneck=3", "model.base_width=64",
                   "model.groups=8", "device=cuda", "data_placement=host")
    h200 = memory.DeviceMemory("cuda:0 (test)", int(139.3 * memory.GiB), int(139.8 * memory.GiB))
    plan = run_plan.plan_recompute(cfg, "cuda", 6, memory=h200)
    assert plan.mode == "blocks" and plan.blocks_eager is not None
    assert plan.blocks_eager.need < h200.free < plan.blocks.need
    line = plan.line()
    assert "in eager steps" in line and "NOT to fit" not in line
    free = int(plan.blocks_eager.need / (memory.HEADROOM + 1) * 2)  # the need halfway into the headroom
    small = memory.DeviceMemory("cuda:0 (test)", free, free)
    line = run_plan.plan_recompute(cfg, "cuda", 6, memory=small).line()
    assert "in eager steps" in line and "NOT to fit" not in line and "tight" in line
    # graphs off: one figure, no fallback to mention
    cfg.cuda_graph = "off"
    assert run_plan.plan_recompute(cfg, "cuda", 6, memory=h200).blocks_eager is None


@pytest.mark.parametrize("scale, shards, amp, recompute", [
    (4, 2, False, "off"), (4, 4, True, "off"), (3, 4, False, "off"), (4, 2, True, "blocks"),
    (4, 8, True, "off"), (4, 16, False, "off")])
def test_the_saved_bytes_of_a_sharded_step_are_what_autograd_saves(scale, shards, amp, recompute, tmp_path):
    """Exact, per rank, for volumes split over 2, 4, 8 or 16 gloo ranks: the slabs with their halo planes,
    D-and-H blocks with their halo planes and rows where D runs out (scale 3 over 4 ranks: 2 x 2 at
    level 2), the moves between the two splits, the levels too small for either kept whole on every
    rank (scale 4 over 8: level 3), the gather where the split ends and the cut on the way up, the
    compact 4 x 4 blocks below one-plane slabs (scale 4 over 16)."""
    from test_spatial import torchrun

    from helpers import REPO

    torchrun(shards, [str(tmp_path), str(scale), str(shards), "bf16" if amp else "fp32", recompute], tmp_path,
             entry=(str(REPO / "tests" / "spatial_saved_worker.py"),))
    s = StepShape(scale, 2, 8, 4, 3, 4, 2, amp, "cpu", False, recompute, False, depth_shards=shards)
    got = {json.loads((tmp_path / f"{r}.json").read_text())["saved"] for r in range(shards)}
    assert got == {walk(s).saved}
