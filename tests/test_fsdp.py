"""Parameters sharded over the ranks (parallel.fsdp, scaffold.fsdp) on the CPU over gloo: the sharded
step against one process, alone and composed with spatial shards; checkpoints that hold the unsharded
state; bitwise repeatability; resumes at the same and at other world sizes, with FSDP on and off; the
plan's `auto` and the memory model's FSDP terms. Every launch is bounded (a hang fails the test)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import REPO, cli, params, same_params, stable_rows
from scaffold.stats import read_rows
from test_spatial import LAUNCH_TIMEOUT, torchrun

# 12 instances x 2 classes / 3 per volume = 8 volumes of 16³: 5 train + 3 validation, which 2
# data-parallel ranks split unevenly (each evaluates 2 batches: one rank's second is padding)
SMALL = ["scale=4", "model.bottleneck=2", "model.base_width=8", "model.groups=4", "data.n_categories=2",
         "data.n_instances=12", "data.val_fraction=0.375", "data.workers=1", "warmup_steps=1", "progress=false",
         "device=cpu"]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within 1e-4 of the reference's largest magnitude (the sums' order differs, nothing else)."""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * max(scale, 1e-12), f"{what}: off by {err:.3g} (largest {scale:.3g})"


# ------------------------------------------------------------------------------------------ the step

@pytest.mark.parametrize("world, shards, recompute", [(2, 1, "off"), (4, 1, "off"), (2, 2, "off"), (4, 2, "off"),
                                                      (2, 1, "blocks")])
def test_a_sharded_step_matches_one_process(world, shards, recompute, tmp_path):
    """FSDP over 2 or 4 ranks (each data-parallel rank one volume; with spatial shards, 2 ranks a
    volume; with recompute, each block's forward run again inside its unit's backward; the model
    channels-last, as on CUDA): the logits, every parameter's gradient (FSDP's average over the world)
    and Adam's moments after a step, against one process averaging the volumes' gradients as DDP does. The unsharded
    state gathered before the step is the model's own, bit for bit; a one-process checkpoint (torch's
    layout, numbered parameters) loads into the shards and gathers back bit for bit."""
    from spatial_case import case

    scale, bottleneck = 4, 2
    data_world = world // shards
    # A one-process state to load: the model after an Adam step on the whole batch.
    model, loss_fn, x, labels = case(scale, batch=data_world, bottleneck=bottleneck)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn.terms(model(x), labels)[0].backward()
    opt.step()
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(saved, tmp_path / "one.pt")

    out = tmp_path / "sharded.pt"
    torchrun(world, [str(out), str(scale), str(bottleneck), str(shards), str(tmp_path / "one.pt"), recompute],
             tmp_path,
             entry=(str(REPO / "tests" / "fsdp_worker.py"),))
    got = torch.load(out, weights_only=False)

    model, loss_fn, x, labels = case(scale, batch=data_world, bottleneck=bottleneck)
    assert got["before"].keys() == initial.keys()
    assert all(torch.equal(got["before"][k], initial[k]) for k in initial)
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for v in range(data_world):  # DDP's mean of the per-volume gradients
        model.zero_grad()
        loss_fn.terms(model(x[v:v + 1]), labels[v:v + 1])[0].backward()
        for n, p in model.named_parameters():
            grads[n] += p.grad / data_world
    with torch.no_grad():
        logits = torch.cat([model(x[v:v + 1]) for v in range(data_world)])
    _close(got["logits"], logits, "logits")
    for n in grads:
        _close(got["grads"][n], grads[n], n)
    after = got["after"]
    names = [n for n, _ in model.named_parameters()]
    assert sorted(after["state"]) == list(range(len(names)))  # torch's layout: numbered parameters
    assert after["param_groups"][0]["params"] == list(range(len(names)))
    for i, n in enumerate(names):  # Adam's first step: m = 0.1 g, v = 0.001 g²
        _close(after["state"][i]["exp_avg"], 0.1 * grads[n], f"{n} exp_avg")
        _close(after["state"][i]["exp_avg_sq"], 0.001 * grads[n] ** 2, f"{n} exp_avg_sq")
    model_state, optimizer_state = got["reloaded"]
    assert all(torch.equal(model_state[k], saved["model"][k]) for k in saved["model"])
    want = saved["optimizer"]
    assert optimizer_state["param_groups"] == want["param_groups"]
    assert optimizer_state["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        assert all(torch.equal(optimizer_state["state"][i][k], v) for k, v in st.items()), i


# ------------------------------------------------------------------------------------- whole runs

@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def whole(cache, tmp_path_factory) -> Path:
    """Two epochs on 2 ranks with FSDP."""
    tmp = tmp_path_factory.mktemp("whole")
    run = tmp / "run"
    torchrun(2, [*SMALL, "epochs=2", f"data.cache_dir={cache}", f"hydra.run.dir={run}", "parallel.fsdp=on"], tmp)
    return run


def test_two_runs_are_bitwise_identical_and_close_to_ddp(whole, cache, tmp_path):
    """A second FSDP run gives the same bits (CSV and parameters); its validation (the ranks' batches
    padded to equal counts) is one process's evaluation of its parameters, bit for bit; DDP (fsdp=off)
    trains the same volumes with the same gradients up to rounding; both checkpoints hold the same
    unsharded layout."""
    from test_distributed import _single_process_validation

    again = tmp_path / "again"
    torchrun(2, [*SMALL, "epochs=2", f"data.cache_dir={cache}", f"hydra.run.dir={again}", "parallel.fsdp=on"],
             tmp_path)
    assert len(read_rows(whole / "train_stats.csv")) == 2
    assert stable_rows(again / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(again), params(whole))
    loss, dice = _single_process_validation(whole)
    last = read_rows(whole / "train_stats.csv")[-1]
    assert float(last["val_loss_epoch"]) == loss and float(last["val_dice"]) == dice
    record = json.loads((whole / "run.json").read_text())
    assert record["plan"]["fsdp"] is True and record["plan"]["optimizer"] == "torch"
    ddp = tmp_path / "ddp"
    done = torchrun(2, [*SMALL, "epochs=2", f"data.cache_dir={cache}", f"hydra.run.dir={ddp}", "parallel.fsdp=off"],
                    tmp_path)
    assert "plan: fsdp: off (parallel.fsdp=off)" in done.stdout + done.stderr
    for a, b in zip(read_rows(whole / "train_stats.csv"), read_rows(ddp / "train_stats.csv")):
        for key in ("overall_loss", "val_loss_avg", "train_dice", "val_dice"):
            assert math.isclose(float(a[key]), float(b[key]), rel_tol=1e-4, abs_tol=1e-6), key
        assert a["optimizer_steps"] == b["optimizer_steps"]
    sharded = torch.load(whole / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    replicated = torch.load(ddp / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert sharded["model"].keys() == replicated["model"].keys()
    assert all(sharded["model"][k].shape == v.shape for k, v in replicated["model"].items())
    assert sharded["optimizer"]["state"].keys() == replicated["optimizer"]["state"].keys()
    assert sharded["optimizer"]["param_groups"][0]["params"] == replicated["optimizer"]["param_groups"][0]["params"]


def test_a_resume_at_the_same_world_size_is_bitwise(whole, cache, tmp_path):
    """One epoch, then a resume to two, on 2 FSDP ranks: the bits of the uninterrupted run."""
    part = tmp_path / "part"
    torchrun(2, [*SMALL, "epochs=1", f"data.cache_dir={cache}", f"hydra.run.dir={part}", "parallel.fsdp=on"],
             tmp_path)
    torchrun(2, [f"resume={part}", "epochs=2"], tmp_path)
    assert stable_rows(part / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(part), params(whole))


def test_resumes_at_other_world_sizes_with_fsdp_on_and_off(cache, tmp_path):
    """FSDP on 2 ranks -> FSDP on 4 ranks (spatial shards 2 composed) -> one process (no FSDP) ->
    2 ranks with FSDP again: every launch continues the run from the unsharded checkpoint and says the
    continuation is not bitwise."""
    run = tmp_path / "run"
    torchrun(2, [*SMALL, "epochs=1", f"data.cache_dir={cache}", f"hydra.run.dir={run}", "parallel.fsdp=on"], tmp_path)
    done = torchrun(4, [f"resume={run}", "epochs=2", "parallel.spatial_shards=2"], tmp_path)
    said = done.stdout + done.stderr
    assert "world size 2 -> 4" in said and "FSDP over all 4" in said
    done = cli(f"resume={run}", "epochs=3", "parallel.spatial_shards=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan: fsdp: off (parallel.fsdp=on -> off: one process" in done.stdout + done.stderr
    done = torchrun(2, [f"resume={run}", "epochs=4"], tmp_path)
    assert "world size 1 -> 2" in done.stdout + done.stderr
    rows = read_rows(run / "train_stats.csv")
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(float(r["val_loss_avg"])) for r in rows)
    # 5 training volumes: 2 steps an epoch on 2 data-parallel ranks, 5 in one process
    assert [int(r["optimizer_steps"]) for r in rows] == [2, 2, 5, 2]
    assert len(json.loads((run / "run.json").read_text())["resumes"]) == 3


# ------------------------------------------------------------------------------- plan and memory

def _fake_memory(monkeypatch, total: int) -> None:
    from scaffold import plan
    from scaffold.model.memory import DeviceMemory

    monkeypatch.setattr(plan, "device_memory", lambda device, query_free=True: DeviceMemory("fake", total, total))


def test_auto_shards_the_parameters_where_the_memory_model_says_replicas_do_not_fit(tmp_path, monkeypatch):
    from dataclasses import replace

    from helpers import tiny_cfg

    from scaffold.distributed import Place
    from scaffold.model.memory import HEADROOM, estimate
    from scaffold.plan import resolve, step_shape

    cfg = tiny_cfg(tmp_path, *SMALL)
    two = Place(rank=0, world=2, local_rank=0, joined=True)
    replicated = estimate(replace(step_shape(cfg, "cpu", "off", world=2, fsdp=False)), warmup=True).need
    sharded = estimate(step_shape(cfg, "cpu", "off", world=2, fsdp=True), warmup=True).need
    assert sharded < replicated
    _fake_memory(monkeypatch, int(replicated / HEADROOM) + (1 << 20))  # replicas fit
    plan = resolve(cfg, two)
    assert not plan.fsdp and plan.data_parallel and "parallel.fsdp=auto -> off" in "\n".join(plan.lines())
    _fake_memory(monkeypatch, int(replicated / HEADROOM) - (1 << 10))  # they do not
    plan = resolve(cfg, two)
    assert plan.fsdp and not plan.skip_rooms and "parallel.fsdp=auto -> on" in "\n".join(plan.lines())
    assert plan.record()["fsdp"] is True
    assert not resolve(cfg, Place()).fsdp  # one process: nothing to shard over
    cfg.parallel.fsdp = "off"
    assert not resolve(cfg, two).fsdp
    cfg.parallel.fsdp = "on"
    _fake_memory(monkeypatch, 1 << 40)
    assert resolve(cfg, two).fsdp


def test_a_bad_fsdp_setting_is_one_line(tmp_path):
    from helpers import TINY

    done = cli(*TINY, "parallel.fsdp=maybe", f"data.cache_dir={tmp_path}", cwd=tmp_path)
    assert done.returncode != 0
    assert "parallel.fsdp='maybe': expected auto | on | off" in done.stderr.strip().splitlines()[-1]


def test_the_memory_model_shards_the_state_and_adds_the_whole_units():
    from dataclasses import replace

    from scaffold.model.memory import StepShape, estimate, fsdp_gathered, fsdp_units, param_count

    s = StepShape(7, recompute="blocks")
    units = fsdp_units(7)
    assert sum(units) == param_count(7) and len(units) == 2 * 4 + 2
    one = estimate(replace(s, data_parallel=True))
    eight = estimate(replace(s, fsdp_world=8))
    p = param_count(7)
    assert (eight.params, eight.grads, eight.adam) == (-(-4 * p // 8),) * 2 + (2 * -(-4 * p // 8),)
    assert eight.buckets == 0 and one.buckets == 4 * p
    assert eight.gathered == fsdp_gathered(units) > 4 * 2 * max(units)  # a unit's parameters and gradients
    assert eight.need < one.need


def test_the_whole_units_count_where_their_ops_run(monkeypatch):
    """The walk adds each unit's whole bytes while its ops run: more than without them, at most the
    worst unit's on top (less where the activations peak elsewhere than the largest unit)."""
    from dataclasses import replace

    from scaffold.model import memory
    from scaffold.model.memory import StepShape, walk

    s = replace(StepShape(7, recompute="blocks"), fsdp_world=8)
    with_units = walk(s)
    monkeypatch.setattr(memory, "_whole", lambda shape, backward: None)
    without = walk(s)
    gathered = memory.fsdp_gathered(memory.fsdp_units(7))
    for a, b in ((with_units.backward_peak, without.backward_peak), (with_units.forward_peak, without.forward_peak),
                 (with_units.eval_peak, without.eval_peak)):
        assert b < a <= b + gathered
    assert with_units.backward_peak < without.backward_peak + gathered  # the peaks are apart at scale 7


def test_the_scale_check_names_the_shard_count_that_fits_with_fsdp(monkeypatch):
    """Scale 11 with 8 levels (23 G parameters) on 140 GiB devices: no replicated split fits; with FSDP
    the check names the shard count, and with parallel.fsdp=off it says FSDP would shard them."""
    from helpers import tiny_cfg

    from scaffold import plan
    from scaffold.config import ConfigError
    from scaffold.model.memory import GiB

    monkeypatch.setattr(plan, "target_device", lambda setting: "cuda:0")
    _fake_memory(monkeypatch, 140 * GiB)
    cfg = tiny_cfg(Path("unused"), "scale=11", "model.bottleneck=3", "model.base_width=64", "model.groups=8",
                   "data.n_instances=145", "data.n_categories=5", "device=auto")
    with pytest.raises(ConfigError, match=r"^scale=11 needs .* parallel.spatial_shards >= (\d+) with FSDP"):
        plan.check_scale(cfg)
    cfg.parallel.fsdp = "off"
    with pytest.raises(ConfigError, match="no split of the volume fits either.*parallel.fsdp=off"):
        plan.check_scale(cfg)


def test_preemption_mid_epoch_saves_the_position_and_resumes_bitwise(cache, tmp_path):
    """SIGTERM to torchrun mid-epoch (sent by rank 0 in its 3rd step): the FSDP ranks agree on a step
    boundary, every rank takes part in gathering the state and rank 0 saves the position; the resume
    finishes the epoch bit for bit."""
    import re

    from helpers import torchrun as launch

    longer = [*SMALL, "data.n_instances=30", "data.val_fraction=0.2", "epochs=2", f"data.cache_dir={cache}",
              "parallel.fsdp=on"]  # 20 volumes: 16 training, 8 steps an epoch per rank
    whole = tmp_path / "whole"
    torchrun(2, [*longer, f"hydra.run.dir={whole}"], tmp_path)
    run = tmp_path / "run"
    res = launch(2, ["agent=0@3", *longer, f"hydra.run.dir={run}"], tmp_path,
                 entry=(str(REPO / "tests" / "faults.py"),), timeout=LAUNCH_TIMEOUT)
    assert res.returncode != 0
    saved = re.search(r"interrupted by SIGTERM: epoch 1 stopped after (\d+) steps, position saved", res.stderr)
    assert saved and 3 <= int(saved.group(1)) < 8, res.stderr[-3000:]
    torchrun(2, [f"resume={run}"], tmp_path)
    assert stable_rows(run / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(run), params(whole))


def test_fsdp_steps_are_never_captured():
    """cuda_graph=auto leaves a sharded step eager; cuda_graph=on with FSDP is one line."""
    from scaffold.config import ConfigError
    from scaffold.step import wants_graph

    cuda = torch.device("cuda", 0)
    assert wants_graph("auto", cuda) and not wants_graph("auto", cuda, fsdp=True)
    with pytest.raises(ConfigError, match=r"^cuda_graph='on': expected parameters not sharded, got FSDP"):
        wants_graph("on", cuda, fsdp=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_fsdp_on_two_gpus_is_repeatable_and_close_to_ddp(cache, tmp_path):
    """The GPU path (NCCL, torch's fused Adam over DTensor shards, a channels-last model whose weights
    FSDP keeps contiguous, bf16 autocast): two FSDP runs on 2 GPUs give the same bits, and DDP the same
    trajectory up to the rounding of another summation order (bf16 activations: 1e-2)."""
    from helpers import torchrun as launch

    gpu = [a for a in SMALL if a not in ("device=cpu", "scale=4")] + ["scale=5", "epochs=2", f"data.cache_dir={cache}"]
    runs = {}
    for name, fsdp in (("a", "on"), ("b", "on"), ("ddp", "off")):
        runs[name] = tmp_path / name
        res = launch(2, [*gpu, f"hydra.run.dir={runs[name]}", f"parallel.fsdp={fsdp}"], tmp_path,
                     timeout=LAUNCH_TIMEOUT)
        assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((runs["a"] / "run.json").read_text())["plan"]["optimizer"] == "torch-fused"
    assert stable_rows(runs["a"] / "train_stats.csv") == stable_rows(runs["b"] / "train_stats.csv")
    assert same_params(params(runs["a"]), params(runs["b"]))
    for a, b in zip(read_rows(runs["a"] / "train_stats.csv"), read_rows(runs["ddp"] / "train_stats.csv")):
        for key in ("overall_loss", "val_loss_avg"):
            assert math.isclose(float(a[key]), float(b[key]), rel_tol=1e-2), key
