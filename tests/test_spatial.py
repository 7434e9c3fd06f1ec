"""Spatial parallelism (parallel.spatial_shards) on the CPU over gloo: the sharded step against one
process, bitwise repeatability, sharded training runs, composition with data parallelism, slab reads
and the configuration errors. Every launch is bounded (a hang fails the test)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import REPO, TINY, cli, params, same_params, stable_rows
from scaffold.stats import read_rows

LAUNCH_TIMEOUT = 240


def torchrun(nproc: int, args: list[str], cwd: Path, entry: tuple[str, ...] = ("-m", "scaffold.train")
             ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--standalone", *entry, *args]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "TRITON_INTERPRET": "1", "HOME": str(cwd)}
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun with {nproc} ranks did not finish in {LAUNCH_TIMEOUT} s:\n{str(e.stderr)[-3000:]}")
    assert done.returncode == 0, done.stderr[-4000:]
    return done


# ------------------------------------------------------------------------------------------ the step

@pytest.mark.parametrize("scale, bottleneck, shards, norm", [(4, 2, 2, "auto"), (4, 2, 4, "auto"),
                                                             (3, 1, 4, "triton"), (4, 1, 8, "auto"),
                                                             (4, 2, 16, "auto")])
def test_a_sharded_step_matches_one_process(scale, bottleneck, shards, norm, tmp_path):
    """Forward output, loss, per-sample losses, hard Dice and every parameter gradient of a step whose
    volumes are split over 2 or 4 ranks, against the same step in one process (fp32, batch 2).
    (3, 1, 4): one plane per rank at level 1, then a bottleneck of 2 planes split along D and H (2 x 2
    blocks: the activations move between the splits both ways). (4, 1, 8): D slabs, then D and H
    (4 x 2) at level 2, then a bottleneck too small for either, which runs whole on every rank
    (gathered from the 4 x 2 blocks, then cut back). Bound: 1e-4 absolute on the logits and 1e-4 of each gradient's
    largest magnitude (summation order differs, nothing else); the hard Dice's counts are exact.
    `norm`: the GroupNorms' setting on both sides; `triton` runs the slab GroupNorm on the Triton
    kernels (in the interpreter: slow, so on the smallest case, whose blocks are split along D and H)."""
    from spatial_case import case

    from scaffold.metrics import hard_dice

    out = tmp_path / "sharded.pt"
    torchrun(shards, [str(out), str(scale), str(shards), "fp32", str(bottleneck), "cpu", norm], tmp_path,
             entry=(str(REPO / "tests" / "spatial_worker.py"),))
    got = torch.load(out)
    assert got["norm_rungs"] == [norm if norm == "triton" else "vendor"]  # the slab GroupNorms' rung
    model, loss_fn, x, labels = case(scale, bottleneck=bottleneck, norm=norm)
    logits = model(x)
    loss = loss_fn._eager(logits, labels)[0]
    loss.backward()
    assert (got["logits"] - logits).abs().max().item() < 1e-4
    assert math.isclose(got["loss"].item(), loss.item(), rel_tol=1e-5)
    assert torch.allclose(got["per_sample"], loss_fn.per_sample(logits, labels), rtol=1e-5, atol=1e-6)
    assert torch.equal(got["hard_dice"], hard_dice(logits.detach(), labels, loss_fn.n_classes))
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item()
        err = (got["grads"][name] - p.grad).abs().max().item()
        assert err <= 1e-4 * scale, f"{name}: gradient off by {err:.3g} (largest {scale:.3g})"


def test_one_plane_slabs_give_way_to_the_most_compact_blocks():
    """Full resolution is always D slabs (the data's); deeper, D slabs while they keep two planes, then
    the D x H blocks whose halo adds least (scale 11 over 256 ranks: 16 x 16 from level 3, where D then
    H gave one-plane slabs, 3x their input, and a move between splits at every level below), ties kept
    at the level above's split; a level with fewer voxels on a face than ranks runs whole."""
    from scaffold.model.grid import Grid, level_grids

    def grids(scale, levels, count):
        return [None if g is None else (g.pd, g.ph) for g in level_grids(scale, levels, count)]

    assert grids(11, 8, 256) == [(256, 1)] * 3 + [(16, 16)] * 5 + [None]
    assert grids(11, 7, 128) == [(128, 1)] * 4 + [(16, 8)] * 4
    assert grids(4, 2, 16) == [(16, 1), (4, 4), (4, 4)]  # (8, 2) halves: 4.5x against 4x
    assert grids(4, 3, 8) == [(8, 1), (8, 1), (4, 2), None]  # ties (3x at level 1) stay D slabs
    assert grids(9, 6, 4) == [(4, 1)] * 7
    for scale, levels, count in [(11, 8, 256), (11, 7, 128), (6, 4, 32), (4, 2, 16)]:
        for level, g in enumerate(level_grids(scale, levels, count)):
            if g is not None:  # every block keeps a plane and a row, and the pool's halving stays local
                edge = 2 ** (scale - level)
                assert g.pd * g.ph == count and edge % g.pd == 0 and edge % g.ph == 0
    assert level_grids(4, 1, 4)[0] == Grid(4, 1)


def test_halo_sends_each_neighbour_its_plane_and_returns_the_gradients(tmp_path):
    """The halo's forward and backward alone, 3 ranks: the planes each rank receives and the gradient
    each rank gets back (its own plus what its neighbours' halos received)."""
    out = tmp_path / "halo"
    out.mkdir()
    torchrun(3, [str(out)], tmp_path, entry=(str(REPO / "tests" / "spatial_halo_worker.py"),))
    for rank in range(3):
        got = torch.load(out / f"{rank}.pt")
        x = torch.arange(3 * 2, dtype=torch.float32).view(1, 1, 6, 1, 1) + 1  # the whole volume's planes
        whole = torch.cat([torch.zeros(1, 1, 1, 1, 1), x, torch.zeros(1, 1, 1, 1, 1)], 2)
        assert torch.equal(got["padded"], whole[:, :, 2 * rank:2 * rank + 4])
        # rank r's loss is sum(padded * (arange(4) + 10 r)): each plane's gradient is the sum of the
        # weights of every padded copy of it, on whichever rank holds that copy
        expect = torch.zeros(8)
        for r in range(3):
            expect[2 * r:2 * r + 4] += torch.arange(4, dtype=torch.float32) + 10 * r
        assert torch.equal(got["grad"].flatten(), expect[1 + 2 * rank:3 + 2 * rank])


# ------------------------------------------------------------------------------------- whole runs

def _run(nproc: int, cache: Path, tmp: Path, name: str, *extra: str) -> Path:
    run_dir = tmp / name
    torchrun(nproc, [*TINY, "epochs=2", f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}", *extra], tmp)
    return run_dir


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_gathers_backward_is_each_ranks_slab_of_the_summed_gradients(ranks, tmp_path):
    """Where the split ends, the backward of the gather sums the ranks' whole-volume gradients and
    keeps each rank's slab: a ring reduce-scatter (one slab in flight, not every rank's whole)."""
    torchrun(ranks, [str(tmp_path)], tmp_path, entry=(str(REPO / "tests" / "spatial_ring_worker.py"),))
    for r in range(ranks):
        out = torch.load(tmp_path / f"{r}.pt")
        assert torch.equal(out["got"], out["want"]), r
        assert torch.equal(out["grad"], out["want"]), r  # the gather's gradient, through autograd
        assert out["channels_last"]


def test_two_sharded_runs_are_bitwise_identical_and_close_to_one_process(cache, tmp_path):
    a = _run(2, cache, tmp_path, "a", "parallel.spatial_shards=2")
    b = _run(2, cache, tmp_path, "b", "parallel.spatial_shards=2")
    assert len(read_rows(a / "train_stats.csv")) == 2
    assert stable_rows(a / "train_stats.csv") == stable_rows(b / "train_stats.csv")
    assert same_params(params(a), params(b))
    record = json.loads((a / "run.json").read_text())
    assert record["spatial_shards"] == 2 and record["world_size"] == 2
    # One process trains the same volumes in the same order: the same trajectory up to rounding.
    one = tmp_path / "one"
    done = cli(*TINY, "epochs=2", f"data.cache_dir={cache}", f"hydra.run.dir={one}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for sharded, single in zip(read_rows(a / "train_stats.csv"), read_rows(one / "train_stats.csv")):
        for key in ("overall_loss", "val_loss_avg", "train_dice", "val_dice"):
            assert math.isclose(float(sharded[key]), float(single[key]), rel_tol=1e-4, abs_tol=1e-6), key
        assert sharded["optimizer_steps"] == single["optimizer_steps"]


def test_sharding_composes_with_data_parallelism(cache, tmp_path):
    """4 ranks = 2 data-parallel × 2 spatial: every epoch splits the training volumes over 2, and the
    whole validation set is counted once."""
    run = _run(4, cache, tmp_path, "dp", "parallel.spatial_shards=2", "data.n_instances=12")
    rows = read_rows(run / "train_stats.csv")
    n_train = 7  # 12 instances x 2 classes / 3 per volume = 8 volumes: 7 train + 1 validation
    assert [int(r["optimizer_steps"]) for r in rows] == [n_train // 2] * 2
    assert all(math.isfinite(float(r["val_loss_avg"])) for r in rows)


def test_a_sharded_run_resumed_at_the_same_shard_count_is_bitwise(cache, tmp_path):
    """Stopped after epoch 1 and resumed to epoch 2 on 2 shards: the bits of the uninterrupted run."""
    whole = _run(2, cache, tmp_path, "whole", "parallel.spatial_shards=2")
    part = tmp_path / "part"
    torchrun(2, [*TINY, "epochs=1", f"data.cache_dir={cache}", f"hydra.run.dir={part}",
                 "parallel.spatial_shards=2"], tmp_path)
    torchrun(2, [*TINY, "epochs=2", f"data.cache_dir={cache}", f"resume={part}", "parallel.spatial_shards=2"],
             tmp_path)
    assert stable_rows(part / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(part), params(whole))


def test_resume_at_another_shard_count_continues_and_says_it_is_not_bitwise(cache, tmp_path):
    run = _run(2, cache, tmp_path, "r", "parallel.spatial_shards=2")
    done = cli(*TINY, "epochs=3", f"data.cache_dir={cache}", f"resume={run}", "parallel.spatial_shards=1",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "parallel.spatial_shards 2 -> 1" in said and "not bitwise" in said
    assert len(read_rows(run / "train_stats.csv")) == 3


# ------------------------------------------------------------------------------------ data and config

def test_a_slab_read_is_the_slab_of_the_whole_volume(cache):
    from helpers import tiny_cfg

    from scaffold.data import store

    cfg = tiny_cfg(cache)
    path = store.prepare(cfg.data, cfg.scale, cfg.seed, progress=False)
    whole = store.load_masks(path, "train")
    for count in (2, 4):
        per = whole.shape[1] // count
        for index in range(count):
            slab = store.load_masks(path, "train", (index, count))
            assert np.array_equal(slab, whole[:, index * per:(index + 1) * per])
    with pytest.raises(ValueError, match="divisor of the depth"):
        store.load_masks(path, "train", (0, 3))


def test_a_slab_inflates_only_up_to_its_end():
    """The streamed inflate gives the same bytes as inflating everything, and stops early: a stream
    cut right after the slab's bytes still yields the slab (so the rest was never inflated)."""
    import zlib

    from scaffold.data.store import _inflate_range

    data = (np.random.default_rng(0).random(32**3) < 0.05).astype(np.uint8).tobytes()
    raw = zlib.compress(data, 6)
    plane = 32 * 32
    for first, depth in ((0, 8), (8, 8), (24, 8), (0, 32)):
        assert _inflate_range(raw, first * plane, depth * plane) == data[first * plane:(first + depth) * plane]
    cut = zlib.compressobj(6)
    head = cut.compress(data[:8 * plane]) + cut.flush(zlib.Z_SYNC_FLUSH)  # no end of stream
    assert _inflate_range(head, 0, 8 * plane) == data[:8 * plane]


@pytest.mark.parametrize("value, says", [
    ("3", "parallel.spatial_shards=3: expected a power of two >= 1"),
    ("16", "parallel.spatial_shards=16: expected at most 8"),
])
def test_bad_shard_counts_are_one_line(value, says, tmp_path):
    done = cli(*TINY, f"parallel.spatial_shards={value}", f"data.cache_dir={tmp_path}", cwd=tmp_path)
    assert done.returncode != 0
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert says in lines[-1] and "Traceback" not in done.stderr


def test_one_process_cannot_shard_and_says_how_to_launch(tmp_path):
    done = cli(*TINY, "parallel.spatial_shards=2", f"data.cache_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'x'}",
               cwd=tmp_path)
    assert done.returncode != 0 and "torchrun --nproc-per-node=2" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_a_failing_rank_ends_a_sharded_job_within_a_bound(fault, cache, tmp_path):
    """Rank 1 of a volume's two shards dies (SIGKILL) or raises in its 2nd step, while rank 0 is in
    the step's halo exchanges: the launch ends non-zero naming rank 1, never waiting out a collective."""
    import re
    import time

    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           str(REPO / "tests" / "faults.py"), f"{fault}=1@2", *TINY, "epochs=2", f"data.cache_dir={cache}",
           f"hydra.run.dir={tmp_path / 'run'}", "parallel.spatial_shards=2", "parallel.timeout_s=60"]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert res.returncode != 0
    assert re.search(r"rank\s*:\s*1\b", res.stderr), res.stderr[-3000:]
    assert time.monotonic() - t0 < 90


# ---------------------------------------------------------------- on a GPU, before a multi-GPU machine

@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("placement", [
    "cuda",  # both ranks on one GPU, over gloo
    pytest.param("cuda-each", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                        reason="needs two CUDA GPUs")),  # one each, NCCL
])
def test_two_ranks_sharing_a_volume_on_gpus_match_one_process(placement, precision, tmp_path):
    """The sharded step on the GPU's own rungs (Triton convolutions on halo'd slabs), 2 ranks on one
    GPU over gloo (exchanges staged through host memory), or each on its own GPU over NCCL
    (`cuda-each`: the exchanges device to device), against one process on the first GPU.
    fp32 (summation order only): the logits within 1e-4 of their largest; the gradients against a
    float64 reference of the same step (on the CPU), the sharded step's worst error at most twice the
    one process's (both measured against the model's largest gradient: at 64^3 with random labels
    the deep layers' gradients are sums that cancel to ~1e-3 of the largest, so each tensor's own
    largest is no yardstick for rounding); the hard Dice's counts exact. bf16 (activations rounded
    where the two differ): logits and each gradient within 3e-2 of their own largest. Prints the
    agreement and each rank's peak memory."""
    from helpers import torchrun as launch
    from spatial_case import case

    from scaffold.metrics import hard_dice

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    scale, bottleneck, shards = 6, 3, 2
    out = tmp_path / "sharded.pt"
    res = launch(shards, [str(out), str(scale), str(shards), precision, str(bottleneck), placement], tmp_path,
                 entry=(str(REPO / "tests" / "spatial_worker.py"),), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(out)
    assert got["norm_rungs"] == ["triton"]
    from scaffold import determinism

    dev = torch.device("cuda")
    determinism.configure("default")  # as the trainer and the ranks: no TF32 in cuDNN's fp32 convolutions
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model, loss_fn, x, labels = case(scale, bottleneck=bottleneck, device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(x)
    loss = loss_fn.terms(logits.float(), labels)[0]
    loss.backward()
    whole_peak = torch.cuda.max_memory_allocated(dev) - base
    logits = logits.detach().float().cpu()
    err = (got["logits"].float() - logits).abs().max().item() / logits.abs().max().item()
    one = {n: p.grad.cpu() for n, p in model.named_parameters()}
    # The memory model's peak for a rank of this step (scaffold.model.memory; no optimizer here): the
    # parameters, their gradients and the step's live activations at its peak (its input and labels
    # slabs among them), plus the whole batch each rank built on the device before taking its slab.
    from scaffold.model.memory import StepShape, estimate

    est = estimate(StepShape(scale, bottleneck, 8, 4, 3, 4, 2, precision == "bf16", "cuda", True,
                             depth_shards=shards), evaluate=False)
    model_peak = est.params + est.grads + est.activation_peak + x.numel() * x.element_size() + labels.numel()
    ratios = [b / model_peak for b in got["peak_bytes"]]
    peaks = (f"peak memory per rank {[round(b / 2**20, 1) for b in got['peak_bytes']]} MiB, the memory model "
             f"{model_peak / 2**20:.1f} MiB (measured/model {[round(r, 2) for r in ratios]}), one process "
             f"{whole_peak / 2**20:.1f} MiB")
    # Loose on purpose (gloo's staging copies and the allocator's rounding are not modelled): it catches
    # a rank holding the whole volume's activations (one process's peak is ~1.5x a rank's here).
    assert all(0.7 <= r <= 1.35 for r in ratios), peaks
    if precision == "bf16":
        worst = max(((got["grads"][n] - g).abs().max().item() / g.abs().max().item(), n) for n, g in one.items())
        print(f"\nbf16: logits off by {err:.2e} of their largest, worst gradient {worst[1]} off by "
              f"{worst[0]:.2e} of its largest; {peaks}")
        assert err <= 3e-2 and worst[0] <= 3e-2
        return
    ref_model, ref_loss, ref_x, ref_labels = case(scale, bottleneck=bottleneck)
    ref_model, ref_loss = ref_model.double(), ref_loss.double()
    ref_loss.terms(ref_model(ref_x.double()), ref_labels)[0].backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    top = max(g.abs().max().item() for g in ref.values())

    def worst_of(grads):
        return max(((grads[n].double() - g).abs().max().item() / top, n) for n, g in ref.items())

    sharded, single = worst_of(got["grads"]), worst_of(one)
    print(f"\nfp32: logits off by {err:.2e} of their largest; against float64, of the largest gradient: "
          f"sharded {sharded[0]:.2e} ({sharded[1]}), one process {single[0]:.2e} ({single[1]}); {peaks}")
    assert err <= 1e-4
    assert sharded[0] <= 2 * single[0] + 1e-7, (sharded, single)
    assert torch.equal(got["hard_dice"], hard_dice(logits, labels.cpu(), loss_fn.n_classes))


@pytest.mark.parametrize("ranks, edge, pd, ph, planes", [
    (2, 8, 2, 1, 4),   # D slabs of 4 planes: each rank one neighbour
    (4, 12, 4, 1, 3),  # 3 planes, the fewest the overlap takes: the middle ranks have two
    (4, 8, 2, 2, 4),   # 2 x 2 blocks: the rows' halo first, then the planes' overlapped
    (4, 8, 4, 1, 2),   # 2 planes: the halo first, then one conv (with or without `overlap`)
])
def test_a_halo_conv_overlapped_or_not_is_the_whole_volumes_conv(ranks, edge, pd, ph, planes, tmp_path):
    """HaloConv3d over each rank's block (float64, gloo): output, input gradient and the weight and
    bias gradients (summed over ranks) equal the one-process conv's to rounding, with the D halo's
    exchange overlapping the interior's conv and without; the overlapped run twice, and through host
    buffers (as ranks sharing a GPU exchange), gives the same bits. Where it overlaps, the conv runs on the block's own planes (its interior output planes) and
    on the 3 planes around each edge output plane, never on a halo'd copy of the block."""
    out = tmp_path / "halo_conv.pt"
    torchrun(ranks, [str(out), str(edge), str(pd), str(ph)], tmp_path,
             entry=(str(REPO / "tests" / "spatial_halo_conv_worker.py"),))
    got = torch.load(out)
    overlapped, again, plain, staged = got["runs"]
    assert overlapped["planes"] == ([planes, 3, 3] if planes >= 3 else [planes + 2])
    assert plain["planes"] == [planes + 2]
    for run in (overlapped, plain):
        for key in ("y", "dx", "dw", "db"):
            ref = got[key]
            err = (run[key] - ref).abs().max().item()
            assert err <= 1e-12 * ref.abs().max().item(), (key, err)
    for key in ("y", "dx", "dw", "db"):
        assert torch.equal(overlapped[key], again[key]), key
        assert torch.equal(overlapped[key], staged[key]), key  # through host buffers: the same exchange
