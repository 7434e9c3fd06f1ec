"""Data parallelism on CPU ranks (gloo on 127.0.0.1 through torchrun --standalone), every launch bounded.

The dataset has 7 training and 7 validation volumes, a split that none of the world sizes 2-5 divides.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import LAUNCH_TIMEOUT, REPO, TINY, params, same_params, stable_rows, torchrun
from scaffold.stats import read_rows

UNEVEN = [*TINY, "data.n_instances=21", "data.val_fraction=0.5", "epochs=2"]  # 14 volumes: 7 + 7


def _run(nproc: int, cache: Path, tmp: Path, name: str, *extra: str) -> Path:
    res = torchrun(nproc, [*UNEVEN, f"data.cache_dir={cache}", f"hydra.run.dir={tmp / name}", *extra], tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / name


def _single_process_validation(run_dir: Path) -> tuple[float, float]:
    """(val_loss_epoch, val_dice) of the run's last parameters, evaluated by one process with the
    trainer's own evaluation."""
    from omegaconf import OmegaConf

    from scaffold.config import Config
    from scaffold.data.store import load_masks, read_info
    from scaffold.loss import SegmentationLoss, class_weights
    from scaffold.model import UNet3d
    from scaffold.trainer import Trainer, Volumes

    record = json.loads((run_dir / "run.json").read_text())
    cfg = OmegaConf.merge(OmegaConf.structured(Config), record["config"])
    info = read_info(record["dataset"])
    model = UNet3d.from_config(cfg, info.n_classes)
    model.load_state_dict(params(run_dir))
    vol = Volumes(torch.from_numpy(load_masks(record["dataset"], "train")),
                  torch.from_numpy(load_masks(record["dataset"], "val")), torch.from_numpy(info.palette))
    trainer = Trainer(cfg, model, SegmentationLoss(class_weights(info.class_counts)), vol,
                      torch.device("cpu"), run_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank ran (OMP_NUM_THREADS=1)
    try:
        loss_sum, dice_sum = trainer.evaluate().sum(1).tolist()
    finally:
        torch.set_num_threads(threads)
    return loss_sum, dice_sum / vol.val.shape[0]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_uneven_splits_complete_with_equal_steps_and_exact_validation(world, cache, tmp_path):
    run_dir = _run(world, cache, tmp_path, "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # one run directory, no stray files
    rows = read_rows(run_dir / "train_stats.csv")
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    # 7 training volumes: the remainder over the world size sits out each epoch, the rest is split evenly.
    assert [int(r["optimizer_steps"]) for r in rows] == [(7 - 7 % world) // world] * 2
    loss, dice = _single_process_validation(run_dir)
    assert float(rows[-1]["val_loss_epoch"]) == loss and float(rows[-1]["val_dice"]) == dice


@pytest.mark.slow
def test_same_world_size_gives_the_same_bits_and_strict_equals_default(cache, tmp_path):
    runs = [_run(3, cache, tmp_path, name, *extra) for name, extra in
            (("a", ()), ("b", ()), ("strict", ("determinism=strict",)))]
    for other in runs[1:]:
        assert stable_rows(other / "train_stats.csv") == stable_rows(runs[0] / "train_stats.csv")
        assert same_params(params(other), params(runs[0]))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_a_failing_rank_ends_the_job_within_a_bound(fault, cache, tmp_path):
    """Rank 1 dies (SIGKILL) or raises in its 5th step (epoch 2 with 3 ranks): every rank ends and the
    launch exits non-zero naming the rank, well inside the bound, never waiting out a collective."""
    t0 = time.monotonic()
    res = torchrun(3, [f"{fault}=1@5", *UNEVEN, "epochs=3", f"data.cache_dir={cache}",
                       f"hydra.run.dir={tmp_path / 'run'}", "parallel.timeout_s=60"], tmp_path,
                   entry=(str(REPO / "tests" / "faults.py"),), timeout=120)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0
    assert re.search(r"rank\s*:\s*1\b", res.stderr), res.stderr[-3000:]
    if fault == "raise":  # the summary's root cause is the rank's own error (it records it for torchrun)
        root = res.stderr.split("Root Cause (first observed failure)")[-1]
        assert re.search(r"rank\s*:\s*1\b", root) and "injected failure on rank 1 at step 5" in root, root
    assert elapsed < 90, elapsed


class _Signalled(BaseException):
    """What a stop signal's handler raises in a rank (scaffold.trainer's Interrupted, here by name)."""


def test_a_ranks_error_file_is_whole_or_absent_when_a_signal_lands_mid_write(tmp_path, monkeypatch):
    """Once a rank fails, torchrun's agent sends the others SIGTERM and then parses each one's error
    file. A signal landing while torch's handler writes its file in place leaves it torn, and the agent
    then fails on it (JSONDecodeError) instead of naming the rank. Injected here: the write raises after
    its first bytes. torch's handler leaves a torn file; ours leaves the file as it was (absent, or the
    last whole record), and a write that finishes is what the agent reads."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

    from scaffold.train import error_handler

    def torn_dump(obj, fp, **kwargs):
        fp.write('{"message": ')
        raise _Signalled()

    def record(handler, path):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        try:
            raise RuntimeError("injected failure on rank 1 at step 5")
        except RuntimeError as e:
            handler.record_exception(e)

    with monkeypatch.context() as m:
        m.setattr(json, "dump", torn_dump)
        with pytest.raises(_Signalled):
            record(ErrorHandler(), tmp_path / "torch.json")
        with pytest.raises(_Signalled):
            record(error_handler(), tmp_path / "ours.json")
    with pytest.raises(json.JSONDecodeError):  # the fault: what the agent met
        ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(tmp_path / "torch.json"))
    assert not (tmp_path / "ours.json").exists() and list(tmp_path.glob(".ours.json*")) == []

    record(error_handler(), tmp_path / "ours.json")  # a whole write, then a torn one over it
    with monkeypatch.context() as m:
        m.setattr(json, "dump", torn_dump)
        with pytest.raises(_Signalled):
            record(error_handler(), tmp_path / "ours.json")
    record(ErrorHandler(), tmp_path / "torch.json")  # torch's own record, whole: the format to match
    ours, theirs = (ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(tmp_path / name))
                    for name in ("ours.json", "torch.json"))
    assert ours.message["message"] == theirs.message["message"] == "RuntimeError: injected failure on rank 1 at step 5"
    assert ours.message["extraInfo"].keys() == theirs.message["extraInfo"].keys() and ours.timestamp > 0


def _kill_stopped_rank(pid_file: Path) -> None:
    """SIGKILL the rank that stopped itself (its pid in `pid_file`), if it is still there: a stopped
    process takes no SIGTERM. Only a process running tests/faults.py is killed (never a reused pid)."""
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        if b"faults.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


def test_a_hung_rank_is_named_and_the_job_ends_within_a_bound(cache, tmp_path):
    """Rank 1 stops (SIGSTOP) as its 3rd step begins: alive, never arriving. Rank 0's collective times
    out after parallel.timeout_s; the roll call (monitored_barrier on a group of its own) then names rank 1
    in rank 0's one-line error, which is also the summary's root cause (it named rank 0 alone, with gloo's
    message). Rank 0 ends within timeout_s + the roll call's window (5 + 5 s, and its step) of the stop; torchrun
    kills the stopped rank 30 s later (its SIGTERM waits while the process is stopped)."""
    from datetime import datetime

    pid_file = tmp_path / "stopped-1.pid"
    t0 = time.monotonic()
    try:
        res = torchrun(2, ["stop=1@3", *UNEVEN, "epochs=3", f"data.cache_dir={cache}",
                           f"hydra.run.dir={tmp_path / 'run'}", "parallel.timeout_s=5"], tmp_path,
                       entry=(str(REPO / "tests" / "faults.py"),), timeout=150)
    finally:
        _kill_stopped_rank(pid_file)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0 and pid_file.exists(), res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: a collective timed out after "
                                                     "parallel.timeout_s=5 s"), res.stderr[-3000:]
    assert errors[0].endswith("rank 1 did not arrive in a further 5 s (it is stopped or hung, not dead)")
    root = res.stderr.split("Root Cause (first observed failure)")[-1]
    assert re.search(r"rank\s*:\s*0\b", root) and "rank 1 did not arrive" in root, root
    failed = datetime.fromisoformat(re.search(r"time\s*:\s*(\S+)", root).group(1).replace("_", " ", 1))
    # The survivors' bound: rank 0's step, the 5 s timeout, its figures, the 5 s roll call (slack for a
    # busy machine).
    assert failed.timestamp() - pid_file.stat().st_mtime < 5 + 5 + 10, root
    assert elapsed < 100, elapsed  # start-up, the bound above, and torchrun's 30 s for the stopped rank


def test_only_torch_s_timeouts_call_the_roll():
    """The roll call follows a collective's timeout (gloo's messages, torch's DistError), never one of
    our errors that mentions a timeout (a config error about parallel.timeout_s, an interruption)."""
    import torch.distributed as dist

    from scaffold.config import ConfigError
    from scaffold.distributed import timed_out
    from scaffold.trainer import Interrupted

    assert timed_out(RuntimeError("Application timeout caused pair closure"))
    assert timed_out(dist.DistBackendError("[gloo] Timed out waiting 5000ms for recv operation to complete"))
    assert not timed_out(RuntimeError("Connection closed by peer"))
    assert not timed_out(ConfigError("parallel.timeout_s=-1: expected a finite number of seconds > 0"))
    assert not timed_out(Interrupted(15, "interrupted by SIGTERM: a timeout"))


def test_run_directory_probe_never_races(tmp_path):
    """Ranks (here threads) probing one run directory at once all succeed: each probe has its own name.
    (With one shared probe name, one prober deleted another's file and the launch failed.)"""
    from scaffold.worker import check_writable

    errors = []

    def probe():
        try:
            for _ in range(200):
                check_writable(tmp_path / "run")
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=probe) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and list((tmp_path / "run").iterdir()) == []


def test_rank_zero_alone_probes_and_every_rank_learns_its_failure(monkeypatch):
    """distributed.agree: a check only rank 0 ran fails on every rank with its one-line message."""
    from scaffold import distributed
    from scaffold.config import ConfigError

    place = distributed.Place(rank=1, world=2)
    monkeypatch.setattr(distributed.dist, "all_gather_object",
                        lambda out, mine: out.__setitem__(slice(None), [(True, "run directory x: not writable"),
                                                                        mine]))
    with pytest.raises(ConfigError, match=r"^run directory x: not writable$"):
        distributed.agree(None, place)
    monkeypatch.setattr(distributed.dist, "all_gather_object",
                        lambda out, mine: out.__setitem__(slice(None), [None, mine]))
    distributed.agree(None, place)  # nobody failed


@pytest.mark.slow
def test_hydra_submitit_local_launcher_runs_a_sweep(cache, tmp_path):
    """The Slurm path without Slurm: hydra-submitit-launcher's local executor runs two jobs of a sweep
    in their own processes and the sweep summary collects both."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="the slurm extra (pip install 'scaffold-unet[slurm]') is part of the test install")
    args = ["-m", "hydra/launcher=submitit_local", "seed=0,1", *TINY, "epochs=1", f"data.cache_dir={cache}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.launcher.timeout_min=5"]
    res = subprocess.run([sys.executable, "-m", "scaffold.train", *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=LAUNCH_TIMEOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "seed=0" in summary and "seed=1" in summary
    for job in ("0", "1"):
        assert len(read_rows(tmp_path / "sweep" / job / "train_stats.csv")) == 1


def test_sigterm_on_one_rank_stops_every_rank_at_the_epoch_end_and_resumes_bitwise(cache, tmp_path):
    """Preemption reaching one rank: the epoch's all-reduce tells every rank, all stop at its end,
    rank 0 checkpoints it, every rank exits with SIGTERM's code; the resume continues bit for bit."""
    args = [*UNEVEN, "epochs=3", f"data.cache_dir={cache}"]
    whole = _run(2, cache, tmp_path, "whole", "epochs=3")
    run = tmp_path / "run"
    res = torchrun(2, ["term=1@2", *args, f"hydra.run.dir={run}"], tmp_path,
                   entry=(str(REPO / "tests" / "faults.py"),))
    assert res.returncode != 0
    assert "interrupted by SIGTERM: stopped at the end of epoch 1" in res.stderr, res.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*143", res.stderr), res.stderr[-3000:]
    assert [r["epoch"] for r in read_rows(run / "train_stats.csv")] == ["1"]
    res = torchrun(2, [f"resume={run}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert stable_rows(run / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(run), params(whole))


def test_the_parameter_fingerprint_reads_any_layout_in_logical_order():
    """The start-up check that every rank holds the same parameters hashes values, not memory: on CUDA
    the model is channels-last, where a 1×1×1 conv weight (the head) counts as contiguous yet has a last
    stride of C, which a byte view refuses (a two-GPU run failed there before its first step)."""
    from scaffold.distributed import fingerprint
    from scaffold.model.unet import UNet3d

    head = torch.randn(6, 64, 1, 1, 1)
    cl = head.to(memory_format=torch.channels_last_3d)
    assert cl.is_contiguous() and cl.stride(-1) == 64  # the layout that broke the byte view
    assert fingerprint([cl]) == fingerprint([head])
    torch.manual_seed(0)
    model = UNet3d(scale=4, base_width=4, groups=2)
    plain = fingerprint(model.parameters())
    model = model.to(memory_format=torch.channels_last_3d)
    assert fingerprint(model.parameters()) == plain
    with torch.no_grad():
        first = next(model.parameters())
        first[(0,) * first.dim()] += 1
    assert fingerprint(model.parameters()) != plain
    assert fingerprint([torch.ones(3, dtype=torch.bfloat16)]) != fingerprint([torch.ones(3)])


@pytest.mark.slow
def test_four_rank_resume_launches_start_cleanly(cache, tmp_path):
    """Every rank of a 4-rank resume starts: only rank 0 locks the run directory (each rank used to take
    the exclusive lock to check it, and ranks refused each other in about half the launches). A few
    launches in a row here (each about 11 s on two cores); 30 in a row are in docs/reliability.md."""
    run = _run(4, cache, tmp_path, "run", "epochs=1")
    for i in range(2):
        res = torchrun(4, [f"resume={run}", "epochs=1"], tmp_path)
        assert res.returncode == 0, f"launch {i + 1}: {res.stderr[-3000:]}"
        assert "in use by another process" not in res.stderr
    assert len(json.loads((run / "run.json").read_text())["resumes"]) == 2


@pytest.mark.parametrize("world, extra", [
    (3, ()),
    pytest.param(4, ("parallel.spatial_shards=4",), marks=pytest.mark.slow),
])
def test_a_resume_at_three_ranks_or_more_is_bitwise(world, extra, cache, tmp_path):
    """Three ranks (or four spatial shards): one epoch, then a resume to two, equals two epochs in
    one launch. DDP rebuilds its gradient buckets after its first backward, and the bucket layout decides
    the all-reduce's sums at three ranks or more: every launch now settles the buckets before its first
    real step (with two ranks the order never mattered, which is all the older tests covered)."""
    whole = _run(world, cache, tmp_path, "whole", "epochs=2", *extra)
    part = _run(world, cache, tmp_path, "part", "epochs=1", *extra)
    res = torchrun(world, [f"resume={part}", "epochs=2"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert stable_rows(part / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(part), params(whole))


def test_sigterm_to_torchrun_mid_epoch_saves_the_position_and_resumes_bitwise(cache, tmp_path):
    """Preemption under torchrun: SIGTERM reaches the launcher (here sent by rank 0 in its 3rd step),
    which forwards it to every rank and kills them 30 s later. The ranks agree on a step boundary within
    a few steps, rank 0 saves every rank's position, all exit well inside the grace period; the resume
    finishes the epoch bit for bit. (The ranks used to run to the epoch's end, past the grace period.)"""
    long_epochs = [*TINY, "data.n_instances=30", "data.val_fraction=0.2", "epochs=2",
                   f"data.cache_dir={cache}"]  # 16 training volumes: 8 steps an epoch per rank
    whole = tmp_path / "whole"
    res = torchrun(2, [*long_epochs, f"hydra.run.dir={whole}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "run"
    t0 = time.monotonic()
    res = torchrun(2, ["agent=0@3", *long_epochs, f"hydra.run.dir={run}"], tmp_path,
                   entry=(str(REPO / "tests" / "faults.py"),))
    assert res.returncode != 0
    assert time.monotonic() - t0 < 60
    saved = re.search(r"interrupted by SIGTERM: epoch 1 stopped after (\d+) steps, position saved", res.stderr)
    assert saved and 3 <= int(saved.group(1)) < 8, res.stderr[-3000:]
    assert "every rank stops at a step boundary they agree on (within 2 steps)" in res.stdout + res.stderr
    assert not (run / "train_stats.csv").exists() or read_rows(run / "train_stats.csv") == []
    res = torchrun(2, [f"resume={run}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert stable_rows(run / "train_stats.csv") == stable_rows(whole / "train_stats.csv")
    assert same_params(params(run), params(whole))


def test_a_rank_launched_with_another_config_is_refused_in_one_line(cache, tmp_path):
    """Ranks started with different overrides (rank 1 with another learning rate) fail at start with one
    line, every rank, instead of training apart (or, for `epochs`, waiting out a collective's timeout)."""
    t0 = time.monotonic()
    res = torchrun(2, ["only=1:lr=0.002", *UNEVEN, f"data.cache_dir={cache}", f"hydra.run.dir={tmp_path / 'run'}",
                       "parallel.timeout_s=60"], tmp_path, entry=(str(REPO / "tests" / "faults.py"),))
    assert res.returncode != 0
    assert "error: the config's hash differs between ranks: rank 0 has" in res.stderr, res.stderr[-3000:]
    assert "launch every rank with the same overrides" in res.stderr
    assert time.monotonic() - t0 < 50
    assert not (tmp_path / "run" / "run.json").exists()


def test_a_sweep_under_torchrun_is_one_line_and_leaves_nothing(cache, tmp_path):
    """Each rank would run the sweep's jobs on its own (the second job failed at three ranks, leaving
    stray directories): refused by every rank before any work. torchrun ends the other ranks (SIGTERM)
    as soon as one exits, so a rank may be stopped before it says so itself: every rank either refused
    (exit 2, the message) or was ended by torchrun (-15), and at least one refused."""
    res = torchrun(3, ["-m", *UNEVEN, "epochs=1", "seed=0,1", f"data.cache_dir={cache}"], tmp_path, timeout=90)
    assert res.returncode != 0
    # Three ranks write to one stderr: a message and its newline may interleave with another rank's,
    # so count the messages rather than the lines.
    message = ("error: a sweep (-m) cannot run under torchrun: launch one torchrun job per configuration, "
               "or sweep with hydra/launcher=slurm")
    refused = res.stderr.count(message)
    exits = re.findall(r"exitcode\s*:\s*(-?\d+)", res.stderr)  # torchrun's report, one per rank it lists
    assert 1 <= refused <= 3 and exits and set(exits) <= {"2", "-15"} and "2" in exits, res.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


SLURM_STEP = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
              "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}


def test_plain_srun_tasks_form_one_job(cache, tmp_path):
    """`srun --ntasks=2 python -m scaffold.train` without torchrun (Slurm's task variables faked, every
    launch bounded): the two tasks are one job of two ranks, not two runs of one (they were: the second
    found the run directory taken)."""
    import socket

    with socket.socket() as s:  # a free port: other launches may run on this machine at the same time
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT") and not k.startswith("TORCHELASTIC")}
    base.update(SLURM_STEP, MASTER_PORT=port, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    args = [*TINY, "data.n_instances=12", "epochs=1", f"data.cache_dir={cache}", f"hydra.run.dir={tmp_path / 'run'}"]
    procs = [subprocess.Popen([sys.executable, "-m", "scaffold.train", *args], cwd=tmp_path, text=True,
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        outs = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["world_size"] == 2
    # 8 volumes: 6 train split over 2 ranks = 3 optimizer steps (one process would take 6).
    assert [int(r["optimizer_steps"]) for r in read_rows(tmp_path / "run" / "train_stats.csv")] == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # rank 1 created nothing of its own


def test_slurm_variables_become_torchrun_s_only_for_an_srun_step_of_several_tasks(monkeypatch):
    from scaffold import cli
    from scaffold.cli import ranks_from_slurm, slurm_port

    monkeypatch.setattr(cli, "FROM_SLURM", None)  # set below, given back after the test
    from scaffold.config import ConfigError

    # A batch script (or salloc's shell) asked for 4 tasks: SLURM_NTASKS=4, but no step: one process.
    batch = {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}
    assert ranks_from_slurm(batch) is None and "RANK" not in batch
    # torchrun under srun: its variables win.
    under_torchrun = {**SLURM_STEP, "SLURM_PROCID": "1", "RANK": "5", "WORLD_SIZE": "8"}
    assert ranks_from_slurm(under_torchrun) is None and under_torchrun["RANK"] == "5"
    one_task = {**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert ranks_from_slurm(one_task) is None and "RANK" not in one_task
    # A task of an srun step: rank, world, local rank, the launch host, a port of the job step's own.
    task = {**SLURM_STEP, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    assert "rank 1 of 2" in ranks_from_slurm(task)
    assert (task["RANK"], task["WORLD_SIZE"], task["LOCAL_RANK"], task["MASTER_ADDR"]) == ("1", "2", "1", "127.0.0.1")
    assert task["MASTER_PORT"] == str(slurm_port("4242", "0"))
    assert 10000 <= slurm_port("4242", "0") < 30000 and slurm_port("4242", "1") != slurm_port("4242", "0")
    # srun run from another host than rank 0's (a login node): rank 0 refuses in one line.
    elsewhere = {**SLURM_STEP, "SLURM_PROCID": "0", "SLURM_LAUNCH_NODE_IPADDR": "192.0.2.1"}
    with pytest.raises(ConfigError, match=r"^srun started 2 tasks without torchrun from another host .*"
                                          r"set MASTER_ADDR to rank 0's host, or launch `srun torchrun"):
        ranks_from_slurm(elsewhere)
    # MASTER_ADDR and MASTER_PORT given: used as they are.
    given = {**elsewhere, "MASTER_ADDR": "node1", "MASTER_PORT": "12345"}
    ranks_from_slurm(given)
    assert (given["MASTER_ADDR"], given["MASTER_PORT"], given["RANK"]) == ("node1", "12345", "0")
    nowhere = {k: v for k, v in elsewhere.items() if k != "SLURM_LAUNCH_NODE_IPADDR"}
    with pytest.raises(ConfigError, match="nothing says where rank 0 is"):
        ranks_from_slurm(nowhere)


def test_gradients_are_views_of_ddp_buckets_and_clear_in_place(tmp_path):
    """worker.data_parallel builds DDP with gradient_as_bucket_view: after a backward every `.grad` lies
    in DDP's buckets (no second copy of the gradients), clearing them in place (our Adam's zero_grad,
    as a graphed step does between shapes) works on such views, and the gradients are the same bits
    as without DDP."""
    import types

    import torch.distributed as dist

    from scaffold.kernels.adam import Adam
    from scaffold.worker import data_parallel

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv3d(2, 4, 3, padding=1), torch.nn.GroupNorm(2, 4),
                                   torch.nn.Conv3d(4, 3, 1))

    x = torch.randn(1, 2, 4, 4, 4)
    plain = net()
    plain(x).square().sum().backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = net()
        ddp = data_parallel(model, types.SimpleNamespace(device=torch.device("cpu"), cuda_graph=False))
        opt = Adam(model.parameters(), lr=1e-3)
        for _ in range(2):  # the second backward writes into the views the first left
            ddp(x).square().sum().backward()
            buckets = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
            assert len(buckets) == 1, "each gradient should be a view of the one bucket"
            assert all(p.grad.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                       for p in model.parameters())
            for p, q in zip(model.parameters(), plain.parameters()):
                assert torch.equal(p.grad, q.grad)
            opt.zero_grad(set_to_none=False)
            assert all(not p.grad.any() for p in model.parameters())
            assert {p.grad.untyped_storage().data_ptr() for p in model.parameters()} == buckets
    finally:
        dist.destroy_process_group()
