"""Nothing lost, nothing silent: each guarantee of docs/reliability.md with its fault injected.

Run directories are claimed by one process; checkpoints are verified and `best` stands on its own; a
lost or damaged CSV is rebuilt from the checkpoint's records; SIGTERM and SIGINT save the position and
exit with the conventional code; a full or read-only disk and bad input cost one line. Where a resume
follows a fault, its bits are compared with an uninterrupted run's."""
from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from faults import flip_byte, full_disk_site, read_only_site
from helpers import LAUNCH_TIMEOUT, REPO, TINY, cli, lines_until, params, same_params, stable_rows, tiny_cfg
from scaffold import checkpoint, cli as scli, rundir, worker
from scaffold.config import ConfigError
from scaffold.stats import read_rows


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, cache):
    """An uninterrupted 3-epoch run to compare resumed runs with."""
    run_dir = tmp_path_factory.mktemp("baseline")
    worker.run(tiny_cfg(cache), run_dir)
    return run_dir


def copy_run(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def args(cache, *more):
    return [*TINY, "epochs=3", f"data.cache_dir={cache}", *more]


def one_error_line(res, *parts):
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def faults(*argv, cwd, env=None, timeout=300):
    """Run tests/faults.py (scaffold.train with an injected fault) in a subprocess."""
    full_env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}", **(env or {})}
    return subprocess.run([sys.executable, str(REPO / "tests" / "faults.py"), *argv], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------- 1. run directories
def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    now = dt.datetime(2026, 12, 3, 12, 0, 0)
    a = rundir.claim_new("outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}", now)
    b = rundir.claim_new("outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}", now)
    assert a == tmp_path.joinpath("outputs/2026-12-03/12-00-00").relative_to(tmp_path)
    assert b.name == "12-00-00-2" and a != b and a.is_dir() and b.is_dir()
    # The command line's pre-flight claims the directory and hands it to Hydra.
    argv = scli.preflight(["epochs=1"], claim=True)
    claimed = [x.split("=", 1)[1] for x in argv if x.startswith("hydra.run.dir=")]
    assert len(claimed) == 1 and os.path.isdir(claimed[0])
    again = scli.preflight(["epochs=1"], claim=True)
    assert again[-1] != argv[-1]


def test_two_concurrent_runs_in_one_working_directory(cache, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-m", "scaffold.train", *args(cache, "epochs=2")], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    runs = sorted(tmp_path.glob("outputs/*/*"))
    assert len(runs) == 2
    for run in runs:
        assert [r["epoch"] for r in read_rows(run / "train_stats.csv")] == ["1", "2"]
    assert stable_rows(runs[0] / "train_stats.csv") == stable_rows(runs[1] / "train_stats.csv")


def test_a_live_process_on_a_run_refuses_a_second(baseline, tmp_path):
    run = copy_run(baseline, tmp_path / "run")
    before = (run / "train_stats.csv").read_bytes()
    holder = rundir.RunLock(run)  # this test process stands for a live run
    try:
        res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)
        assert res.returncode == 2
        one_error_line(res, f"run directory {run} is in use by another process (pid {os.getpid()}")
        # Past the pre-flight (two resumes started at once), the worker's own claim refuses it too.
        with pytest.raises(ConfigError, match="in use by another process"):
            worker.run(scli.resumed_config(run, tiny_cfg(tmp_path), []), run, resume=True)
    finally:
        holder.release()
    assert (run / "train_stats.csv").read_bytes() == before
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)  # the lock goes with its process
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["epoch"] for r in read_rows(run / "train_stats.csv")] == ["1", "2", "3", "4"]


def test_a_new_run_in_a_directory_holding_one_is_refused(baseline, cache, tmp_path):
    run = copy_run(baseline, tmp_path / "run")
    hydra_record = sorted(p.name for p in run.iterdir())
    res = cli(*args(cache), f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 2
    one_error_line(res, f"hydra.run.dir={run} already holds a run (resume={run} continues it")
    assert sorted(p.name for p in run.iterdir()) == hydra_record
    with pytest.raises(ConfigError, match="already holds a run"):
        worker.run(tiny_cfg(cache), run)


def test_a_run_refused_by_the_lock_deletes_nothing_of_the_live_run(cache, tmp_path):
    """A live run in start-up (its lock held, Hydra's record and log written, no run.json yet): new runs
    pointed at its directory are refused in one line and leave every file of it as it was; the lock file
    stays the live run's, so a third run is refused too (it used to be deleted with the record, and the
    third run trained beside the live one)."""
    live = tmp_path / "live"
    (live / ".hydra").mkdir(parents=True)
    (live / ".hydra" / "config.yaml").write_text("the live run's record\n")
    (live / "train.log").write_text("the live run's log\n")
    holder = rundir.RunLock(live)  # this test process stands for the live run

    def snapshot():
        return {str(p.relative_to(live)): (p.stat().st_ino, p.read_bytes() if p.is_file() else None)
                for p in live.rglob("*")}

    before = snapshot()
    try:
        for _ in range(3):
            res = cli(*args(cache), f"hydra.run.dir={live}", cwd=tmp_path)
            assert res.returncode == 2, res.stderr[-3000:]
            one_error_line(res, f"run directory {live.absolute()} is in use by another process (pid {os.getpid()}")
            assert snapshot() == before
    finally:
        holder.release()


def test_a_run_that_never_began_removes_only_what_it_created(tmp_path):
    """The owner of a directory that ends before its run began (no run.json) removes the lock file, Hydra's
    record and log where it wrote them, and the folders it made; a user's file, and every folder above
    it, stay."""
    mine = rundir.own(tmp_path / "a" / "b" / "run", ours=rundir.HYDRA_FILES)
    (mine.path / ".hydra").mkdir()
    (mine.path / "train.log").write_text("log\n")
    assert rundir.owned(tmp_path / "a" / "b" / "run") is mine
    mine.release(remove_unused=True)
    assert list(tmp_path.iterdir()) == []  # a/, a/b/ and the run were all made by the claim
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("the user's\n")
    (theirs / "train.log").write_text("an older log\n")
    claim = rundir.own(theirs)  # Hydra's files there are not ours: only the lock file is
    claim.release(remove_unused=True)
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt", "train.log"]
    with pytest.raises(rundir.RunDirBusy):  # a lock on a file since removed would guard nothing
        held = rundir.RunLock(theirs)
        try:
            rundir.RunLock(theirs)
        finally:
            held.release()


def test_only_rank_zero_locks_a_resumed_run(baseline, tmp_path, monkeypatch):
    """Under torchrun rank 0 owns the run directory; the other ranks' pre-flight neither locks nor probes
    it, so a rank never refuses another (with every rank probing the lock, 4-rank resumes failed about
    every other launch). Here this test process holds the lock as rank 0 would."""
    run = copy_run(baseline, tmp_path / "run")
    holder = rundir.RunLock(run)
    try:
        monkeypatch.setenv("RANK", "1")
        scli.preflight([f"resume={run}", "epochs=4"], claim=True)  # no error
        assert rundir.owned(run) is None
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(ConfigError, match="in use by another process"):
            scli.preflight([f"resume={run}", "epochs=4"], claim=True)
    finally:
        holder.release()


# ------------------------------------------------------------------------- 2-3. verified checkpoints
def test_a_flipped_byte_in_last_is_caught_and_best_takes_over(baseline, tmp_path):
    run = copy_run(baseline, tmp_path / "run")
    ckpts = run / "checkpoints"
    assert os.stat(ckpts / "best.pt").st_ino != os.stat(ckpts / "last.pt").st_ino  # no shared bytes
    assert os.stat(ckpts / "best.pt").st_nlink == 1
    flip_byte(ckpts / "last.pt", len((ckpts / "last.pt").read_bytes()) // 2)
    with pytest.raises(checkpoint.CheckpointError, match="last.pt: checksum mismatch"):
        checkpoint.load_one(ckpts / "last.pt")
    res = cli(f"resume={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "last.pt: checksum mismatch" in out and "resuming from" in out and "best.pt" in out
    assert stable_rows(run / "train_stats.csv") == stable_rows(baseline / "train_stats.csv")
    assert same_params(params(run), params(baseline))


def test_both_checkpoints_damaged_is_one_line(baseline, tmp_path):
    run = copy_run(baseline, tmp_path / "run")
    for name in ("last.pt", "best.pt"):
        flip_byte(run / "checkpoints" / name, 100)
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)
    assert res.returncode == 2
    one_error_line(res, "last.pt: checksum mismatch", "best.pt: checksum mismatch")


def test_a_stale_best_is_rewritten_from_last(baseline, tmp_path):
    """A kill between writing `last` and its `best` copy leaves `best` an earlier epoch."""
    run = copy_run(baseline, tmp_path / "run")
    ckpts = run / "checkpoints"
    best = checkpoint.load_one(ckpts / "best.pt")
    assert best["progress"]["best_epoch"] == best["epoch"]
    # The moment after `last` was written at the best epoch: `best` still holds an earlier epoch.
    shutil.copy(ckpts / "best.pt", ckpts / "last.pt")
    checkpoint.save(ckpts / "best.pt", dict(best, epoch=1))
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (f"best.pt was epoch 1, the best epoch is {best['epoch']}: rewritten from last.pt"
            in res.stdout + res.stderr)
    result = json.loads((run / "result.json").read_text())
    assert checkpoint.load_one(ckpts / "best.pt")["epoch"] == result["best_epoch"]


def test_checkpoint_of_another_model_is_one_line(baseline, tmp_path):
    run = copy_run(baseline, tmp_path / "run")
    other = tmp_path / "other"
    worker.run(tiny_cfg(tmp_path / "cache2", "model.base_width=8", "epochs=1"), other)
    shutil.copy(other / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    shutil.copy(other / "checkpoints" / "best.pt", run / "checkpoints" / "best.pt")
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)
    assert res.returncode == 2
    one_error_line(res, "last.pt: holds a different model than this config builds (size mismatch for")


# ------------------------------------------------------------------------------------ 5. the CSV
@pytest.mark.parametrize("damage", ["deleted", "binary", "edited"])
def test_a_lost_or_damaged_csv_is_rebuilt_from_the_checkpoint(baseline, tmp_path, damage):
    run = copy_run(baseline, tmp_path / "run")
    csv_path = run / "train_stats.csv"
    original = csv_path.read_bytes()
    if damage == "deleted":
        csv_path.unlink()
    elif damage == "binary":
        csv_path.write_bytes(bytes(range(256)) * 4)
    else:
        csv_path.write_text(csv_path.read_text().replace("\n2,", "\n2,9", 1))
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "rebuilt from the checkpoint's records of epochs 1-3" in out
    rows = read_rows(csv_path)
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4"]
    assert csv_path.read_bytes().startswith(original)  # epochs 1-3 exactly as first written
    if damage != "deleted":  # the damaged file is kept, not overwritten
        assert (run / "train_stats.csv.damaged").exists()


def test_a_damaged_csv_with_an_old_checkpoint_is_refused(baseline, tmp_path):
    run = copy_run(baseline, tmp_path / "run")
    for name in ("last.pt", "best.pt"):
        state = checkpoint.load_one(run / "checkpoints" / name)
        del state["rows"]  # as written before checkpoints kept the CSV's rows
        checkpoint.save(run / "checkpoints" / name, state)
    (run / "train_stats.csv").unlink()
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)
    assert res.returncode == 2
    one_error_line(res, "train_stats.csv: missing, and the checkpoint holds no record")
    assert not (run / "train_stats.csv").exists()


def test_a_signal_before_the_run_began_leaves_no_directory_and_suggests_no_resume(cache, tmp_path):
    """SIGTERM while the dataset loads (no run.json yet): one line, exit 143, no `resume=` hint (there is
    no run to resume) and no run directory left."""
    res = faults("early=term", *args(cache), cwd=tmp_path)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-3000:]
    line = one_error_line(res, "interrupted by SIGTERM before training could save its position")
    assert "resume=" not in line
    assert not list(tmp_path.glob("outputs/*/*"))


def test_a_killed_checkpoint_write_leaves_no_temporary_file_after_the_resume(baseline, tmp_path):
    """A process SIGKILLed while writing a checkpoint leaves its unique temporary file; the next resume
    (the directory's owner) removes it in one line, and the run continues bitwise."""
    run = copy_run(baseline, tmp_path / "run")
    killed = subprocess.run([sys.executable, "-c", f"""
import os, signal
from scaffold.files import atomic_path
with atomic_path({str(run / "checkpoints" / "last.pt")!r}) as tmp:
    with open(tmp, "wb") as f:
        f.write(os.urandom(1 << 16))
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
"""], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    stale = list((run / "checkpoints").glob(".last.pt.*.tmp"))
    assert len(stale) == 1 and stale[0].stat().st_size == 1 << 16
    res = cli(f"resume={run}", cwd=tmp_path)  # epochs=3: already done, so nothing is trained
    assert res.returncode == 0, res.stderr[-3000:]
    assert "removed 1 temporary file(s) left by an interrupted write (0.1 MiB)" in res.stdout + res.stderr
    assert not list(run.rglob("*.tmp"))
    assert same_params(params(run), params(baseline))


def test_an_edited_run_record_is_refused_in_one_line(baseline, tmp_path):
    """run.json's config is what a resume continues: an edit (grad_clip 1.0 -> 0.01) is caught by the
    config's hash recorded beside it, before any work."""
    run = copy_run(baseline, tmp_path / "run")
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["optim"]["grad_clip"] == 1.0 and len(record["config_sha256"]) == 64
    record["config"]["optim"]["grad_clip"] = 0.01
    (run / "run.json").write_text(json.dumps(record, indent=2))
    before = (run / "checkpoints" / "last.pt").read_bytes()
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)
    assert res.returncode == 2
    one_error_line(res, f"{run / 'run.json'}: its config was edited after the run started")
    assert (run / "checkpoints" / "last.pt").read_bytes() == before


def test_a_resume_at_another_world_size_is_said_and_recorded(baseline, tmp_path, caplog):
    run = copy_run(baseline, tmp_path / "run")
    with caplog.at_level("WARNING", logger="scaffold"):
        worker.record_resume(run, 3, "last.pt", ["epochs=4"], world_size=2)
        worker.record_resume(run, 4, "last.pt", ["epochs=5"], world_size=2)  # as the resume before it
    assert [r.getMessage() for r in caplog.records] == [
        "resume: world size 1 -> 2: the run continues, not bitwise as it would have (the sampler deals the "
        "samples to another number of ranks)"]
    record = json.loads((run / "run.json").read_text())
    assert record["world_size"] == 1 and [r["world_size"] for r in record["resumes"]] == [2, 2]


def test_time_to_target_after_a_mid_epoch_resume_counts_the_interrupted_part(cache, tmp_path):
    """The wall clock (from which time to target is read) counts the part of an epoch run before the
    interruption, as the epoch's own timer does: here the saved position says it took 1000 s."""
    run = tmp_path / "run"
    res = faults("term=0@5", *args(cache), f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-3000:]
    state = checkpoint.load_one(run / "checkpoints" / "last.pt")
    state["position"]["seconds"] = 1000.0
    state.pop("format", None)
    checkpoint.save(run / "checkpoints" / "last.pt", state)
    res = cli(f"resume={run}", "target_dice=1e-6", cwd=tmp_path)  # reached at epoch 2
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["target_epoch"] == 2
    assert result["train_time_s"] >= 1000 and result["wall_time_s"] >= result["train_time_s"]
    assert result["time_to_target_s"] == result["wall_time_s"]


# ---------------------------------------------------------------------------------- 6. signals
@pytest.mark.parametrize("kind, signum", [("term", signal.SIGTERM), ("int", signal.SIGINT),
                                          ("hup", signal.SIGHUP)])
def test_a_signal_saves_the_position_and_the_resume_is_bitwise(baseline, cache, tmp_path, kind, signum):
    run = tmp_path / "run"
    # Step 5 is the second step of epoch 2 (3 steps per epoch): the epoch stops after it.
    res = faults(f"{kind}=0@5", *args(cache), f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 128 + signum, res.stderr[-3000:]
    name = signal.Signals(signum).name
    line = one_error_line(res, f"interrupted by {name}: epoch 2 stopped after 2 steps, position saved in")
    assert "Traceback" not in res.stderr and f"resume={run}" in line
    state = checkpoint.load_one(run / "checkpoints" / "last.pt")
    assert state["epoch"] == 1 and state["position"]["steps"] == 2
    assert [r["epoch"] for r in read_rows(run / "train_stats.csv")] == ["1"]
    res = cli(f"resume={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert stable_rows(run / "train_stats.csv") == stable_rows(baseline / "train_stats.csv")
    assert same_params(params(run), params(baseline))


@pytest.mark.parametrize("step, where", [(5, "in epoch 2"), (3, "at the end of epoch 1")])
def test_a_signal_without_checkpoints_saves_nothing_and_says_so(cache, tmp_path, step, where):
    """checkpoint_interval=-1 (upstream's: no checkpoint at all): a stop mid-epoch or at an epoch's end
    writes none, and its one line says nothing was saved."""
    run = tmp_path / "run"
    res = faults(f"term=0@{step}", *args(cache, "checkpoint_interval=-1"), f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-3000:]
    one_error_line(res, f"interrupted by SIGTERM", where, "checkpoint_interval=-1: nothing saved")
    ckpts = run / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())


@pytest.mark.parametrize("command", ["scaffold.data", "scaffold.train"])
def test_ctrl_c_during_dataset_generation_is_one_line_and_leaves_nothing(tmp_path, command):
    """Ctrl-C (SIGINT to the whole process group) once the generation's workers are rendering (its first
    progress line): the workers printed a KeyboardInterrupt traceback each (and the pool one of its own)
    while the parent waited for the rest of the work. Now the workers leave the signal to the parent,
    which stops them: one line beside the progress line, exit 130, no file in the cache, no run
    directory."""
    cache = tmp_path / "cache"
    argv = ["scale=5", "data.n_instances=100", "data.workers=2", f"data.cache_dir={cache}", "progress=true"]
    if command == "scaffold.train":
        argv += [*TINY[1:4], "epochs=1", "progress=true", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen([sys.executable, "-m", command, *argv], cwd=tmp_path, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)  # its own process group
    try:
        seen = lines_until(proc.stderr, "fractal volumes: ", LAUNCH_TIMEOUT)  # the workers are rendering
        if seen and seen[-1].startswith("fractal volumes: "):
            os.killpg(proc.pid, signal.SIGINT)
        _, rest = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = "".join(seen) + rest
    assert seen and seen[-1].startswith("fractal volumes: "), err[-3000:]
    assert proc.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()  # progress lines (more than one where the signal lands late), then one
    assert all(ln.startswith("fractal volumes: ") for ln in lines[:-1]), err[-3000:]
    assert lines[-1].startswith("interrupted by SIGINT"), err[-3000:]
    assert list(cache.iterdir()) == []  # neither the dataset nor its temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no run directory either


def _lost_in_a_lock(stop_handler):
    """A load that receives SIGINT and loses the handler's exception as a lock's __exit__ does when the
    signal lands while a condition wait releases its lock: "release unlocked lock" in its place."""
    def load(*args, **kwargs):
        try:
            stop_handler(signal.SIGINT)
        except BaseException:
            raise RuntimeError("release unlocked lock") from None
    return load


def test_a_stop_signal_whose_exception_surfaces_as_another_still_stops_dataset_generation(monkeypatch):
    """The data CLI: seen under load, Ctrl-C in a pool's wait gave a RuntimeError traceback and exit 1."""
    from scaffold.data import __main__ as data_cli
    from scaffold.data import store

    cfg = OmegaConf.create({"data": {}, "scale": 3, "seed": 0, "progress": False})

    def fails(*args, **kwargs):
        raise RuntimeError("other")

    monkeypatch.setattr(data_cli, "_RAISED", [])
    monkeypatch.setattr(store, "load", _lost_in_a_lock(data_cli._stop))
    with pytest.raises(data_cli.Stopped) as got:
        data_cli._load(cfg)
    assert got.value.signum == signal.SIGINT
    monkeypatch.setattr(data_cli, "_RAISED", [])
    monkeypatch.setattr(store, "load", fails)
    with pytest.raises(RuntimeError, match="other"):  # with no signal received, an error stays itself
        data_cli._load(cfg)


def test_a_stop_signal_whose_exception_surfaces_as_another_still_interrupts_the_run(monkeypatch, tmp_path):
    """The trainer outside its loop (dataset, model, warm-up): the run still ends Interrupted, so the
    CLI prints its one line and exits 128 + the signal."""
    from scaffold import worker
    from scaffold.trainer import Interrupted

    def run(cfg, run_dir, resume, overrides, stop, held):
        _lost_in_a_lock(stop)()

    monkeypatch.setattr(worker, "_run", run)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted) as got:
        worker.run(None, tmp_path)
    assert got.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # the handlers given back as before


# ------------------------------------------------------------------------------- full, read-only disks
def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(baseline, cache, tmp_path):
    run = tmp_path / "run"
    res = faults("enospc=2", *args(cache), f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    one_error_line(res, "last.pt: cannot write the checkpoint (No space left on device)")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "last.pt"]  # no temp
    assert checkpoint.load_one(run / "checkpoints" / "last.pt")["epoch"] == 1
    res = cli(f"resume={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert stable_rows(run / "train_stats.csv") == stable_rows(baseline / "train_stats.csv")
    assert same_params(params(run), params(baseline))


@pytest.mark.parametrize("where", ["fixed", "interpolated", "default"])
def test_a_full_disk_at_the_run_directory_s_creation_is_one_line_and_leaves_nothing(cache, tmp_path, where):
    """The run directory's filesystem is full (files are created, no byte is written: a full tmpfs). A
    fixed hydra.run.dir left a 0-byte lock file in a new folder; a directory Hydra made itself left a
    Hydra traceback and 0-byte .hydra/config.yaml and train.log. Now the output folder's probe writes a
    byte before anything is created: one line, exit 2, nothing left."""
    full = tmp_path / "full"
    full.mkdir()
    site = full_disk_site(tmp_path / "site", full)
    run_dir = {"fixed": [f"hydra.run.dir={full / 'run'}"], "interpolated": [f"hydra.run.dir={full}/run-${{seed}}"],
               "default": []}[where]
    res = cli(*args(cache, "epochs=1"), *run_dir, cwd=full if where == "default" else tmp_path,
              env={"PYTHONPATH": f"{site}:{REPO}"})
    assert res.returncode == 2, res.stderr[-3000:]
    one_error_line(res, "cannot create the run directory", f"{full} is not a writable folder: No space left "
                   "on device")
    assert list(full.rglob("*")) == []


def test_a_lock_that_cannot_be_written_leaves_no_lock_file(tmp_path, monkeypatch):
    """The disk fills between the probe and the lock: the pid cannot be written into the new lock file.
    The lock file and the folders made for it go; a lock file that was there before stays."""
    import errno

    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rundir.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        rundir.own(tmp_path / "a" / "run")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / rundir.LOCK_FILE).write_text("")
    with pytest.raises(OSError, match="No space left"):
        rundir.own(tmp_path / "b")
    assert [p.name for p in (tmp_path / "b").iterdir()] == [rundir.LOCK_FILE]


def test_resume_on_a_read_only_filesystem_is_one_line(baseline, tmp_path):
    run = copy_run(baseline, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    site = read_only_site(tmp_path / "site", run)
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path, env={"PYTHONPATH": f"{site}:{REPO}"})
    assert res.returncode == 2
    one_error_line(res, f"resume={run}: the run directory is not writable (Read-only file system)")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("override, expected", [
    ("optim.weight_decay=-1", "optim.weight_decay=-1.0: expected a finite number >= 0"),
    ("optim.weight_decay=nan", "optim.weight_decay=nan: expected a finite number >= 0"),
    ("lr=inf", "lr=inf: expected a number in (0, 10]"),
    ("lr=1e308", "lr=1e+308: expected a number in (0, 10]"),
    ("optim.eta_min=inf", "optim.eta_min=inf: expected a number in [0, lr]"),
    ("~scale", "~scale: a key of the schema cannot be deleted"),
    ("hydra.run.dir=/proc/nope", "hydra.run.dir=/proc/nope: cannot create the run directory"),
])
def test_bad_values_are_one_line_before_any_work(cache, tmp_path, override, expected):
    res = cli(override, *args(cache), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    one_error_line(res, expected)
    assert list(tmp_path.iterdir()) == []  # no run directory, no dataset


@pytest.mark.parametrize("setup, expected", [
    (lambda run: (run / "run.json").write_text("{not json"), "run.json: unreadable run record (JSONDecodeError"),
    (lambda run: (run / "run.json").write_text(json.dumps({"config": {"nonsense_key": 1}})),
     "run.json: its config does not fit this version's schema"),
])
def test_a_damaged_run_record_is_one_line(baseline, tmp_path, setup, expected):
    run = copy_run(baseline, tmp_path / "run")
    setup(run)
    res = cli(f"resume={run}", "epochs=4", cwd=tmp_path)
    assert res.returncode == 2
    one_error_line(res, expected)


@pytest.mark.parametrize("override, expected", [
    ("device=cuda", "device='cuda': no CUDA device is available here"),
    ("cuda_graph=on", "cuda_graph='on': expected a CUDA device"),
])
def test_runtime_config_errors_leave_no_run_directory(cache, tmp_path, override, expected):
    if torch.cuda.is_available():
        pytest.skip("these are errors only on a machine without a GPU")
    res = cli(*[a for a in args(cache) if a != "device=cpu"], override, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    one_error_line(res, expected)
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*/*"))


def test_divergence_in_the_first_epoch_names_no_missing_checkpoint(cache, tmp_path, monkeypatch):
    from scaffold.trainer import Diverged, Trainer

    real = Trainer.step

    def step(self, *a, **k):
        loss, dice = real(self, *a, **k)
        return loss * float("nan"), dice

    monkeypatch.setattr(Trainer, "step", step)
    with pytest.raises(Diverged, match="non-finite loss at epoch 1 .*; no checkpoint was written before it"):
        worker.run(tiny_cfg(cache), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_a_nan_epoch_reports_no_made_up_dice_and_is_never_best(cache, tmp_path, monkeypatch):
    """A parameter turned NaN after epoch 1 (a real divergence, not a patched loss): epoch 2's logits
    are NaN, and argmax over them picked a class of its own accord, so the row said a made-up val_dice
    (0.0 here, 0.5 with other classes). Now the row says nan, is not best, and the run stops as a non-finite loss does (exit 3 on the command line:
    no result.json), keeping epoch 1's checkpoints."""
    from scaffold.metrics import hard_dice
    from scaffold.trainer import Diverged, Trainer

    real, calls = Trainer.step, {"n": 0}

    def step(self, masks):
        calls["n"] += 1
        if calls["n"] == 4:  # the first step of epoch 2 (3 steps an epoch; warm-up runs on a copy)
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return real(self, masks)

    monkeypatch.setattr(Trainer, "step", step)
    run = tmp_path / "run"
    with pytest.raises(Diverged, match="non-finite loss at epoch 2"):
        worker.run(tiny_cfg(cache), run)
    rows = read_rows(run / "train_stats.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert 0 <= float(rows[0]["val_dice"]) <= 1 and rows[0]["is_best"] == "1"
    assert rows[1]["val_dice"] == "nan" and rows[1]["val_loss_avg"] == "nan" and rows[1]["is_best"] == "0"
    assert not (run / "result.json").exists()
    assert checkpoint.load_one(run / "checkpoints" / "best.pt")["epoch"] == 1
    # The metric itself: a sample with a non-finite logit scores nan, the others as before.
    logits = torch.randn(2, 3, 4, 4, 4)
    labels = torch.randint(0, 3, (2, 4, 4, 4), dtype=torch.uint8)
    before = hard_dice(logits, labels, 3)
    logits[1, 2, 0, 0, 0] = float("inf")
    after = hard_dice(logits, labels, 3)
    assert after[0] == before[0] and torch.isnan(after[1])


# ------------------------------------------------------------------------------------ 4. datasets
def _dataset_copy(cache, tmp_path):
    """A private copy of the tiny dataset cache (the shared one stays intact), and its one file."""
    from scaffold.data.store import prepare

    cfg = tiny_cfg(cache)
    src = prepare(cfg.data, cfg.scale, cfg.seed, progress=False)
    folder = tmp_path / "cache"
    folder.mkdir()
    return folder, shutil.copy(src, folder / src.name)


def _fingerprint(h5):
    import h5py
    import numpy as np

    with h5py.File(h5, "r") as f:
        return ([bytes(x) for x in f["train/sha256"][...]], [bytes(x) for x in f["val/sha256"][...]],
                np.asarray(f["palette"][...]).tobytes(), f.attrs["format_version"])


def _chunk_offset(h5, split, index):
    import h5py

    with h5py.File(h5, "r") as f:
        info = f[f"{split}/masks"].id.get_chunk_info(index)
        return info.byte_offset + info.size // 2


def _palette_offset(h5):
    import h5py

    with h5py.File(h5, "r") as f:
        return f["palette"].id.get_offset()


@pytest.mark.parametrize("damage, expected", [
    ("chunk", "train mask 1 fails its checksum; regenerating it"),
    ("palette", "palette fails its checksum; regenerating it"),
    ("rewrite", "val mask 0 fails its checksum; regenerating it"),
    ("format1", "format version 1, expected 2; regenerating it"),
])
def test_a_damaged_dataset_is_reported_in_one_line_and_regenerated(baseline, cache, tmp_path, damage, expected):
    import h5py

    folder, h5 = _dataset_copy(cache, tmp_path)
    good = _fingerprint(h5)
    if damage == "chunk":  # inside a volume's gzip stream: h5py itself would fail to inflate it
        flip_byte(h5, _chunk_offset(h5, "train", 1))
    elif damage == "palette":
        flip_byte(h5, _palette_offset(h5) + 5)
    elif damage == "rewrite":  # valid data, written through h5py (its own checksums would agree)
        with h5py.File(h5, "r+") as f:
            f["val/masks"][0] = 0
    else:  # written before datasets carried checksums
        with h5py.File(h5, "r+") as f:
            f.attrs["format_version"] = 1
            for split in ("train", "val"):
                del f[f"{split}/sha256"]
    res = cli(*args(folder), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert sum(expected in line for line in out.splitlines()) == 1, out[-3000:]
    assert _fingerprint(h5) == good  # regenerated: the same dataset as before the damage
    run = next(tmp_path.glob("outputs/*/*"))
    assert stable_rows(run / "train_stats.csv") == stable_rows(baseline / "train_stats.csv")


def test_a_read_only_cache_with_a_valid_dataset_is_read(baseline, cache, tmp_path):
    folder, h5 = _dataset_copy(cache, tmp_path)
    site = read_only_site(tmp_path / "site", folder)
    res = cli(*args(folder), cwd=tmp_path, env={"PYTHONPATH": f"{site}:{REPO}"})
    assert res.returncode == 0, res.stderr[-3000:]
    run = next(tmp_path.glob("outputs/*/*"))
    assert stable_rows(run / "train_stats.csv") == stable_rows(baseline / "train_stats.csv")
    # Generating into it is what needs a writable folder: one line then.
    res = cli(*args(folder, "seed=7"), cwd=tmp_path, env={"PYTHONPATH": f"{site}:{REPO}"})
    assert res.returncode == 2
    one_error_line(res, f"data.cache_dir={str(folder)!r}: cannot write there (Read-only file system)")


def test_a_bad_cache_dir_is_one_line_and_leaves_no_run_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = cli(*args(blocker), cwd=tmp_path)
    assert res.returncode == 2
    one_error_line(res, f"data.cache_dir={str(blocker)!r}")
    assert not list(tmp_path.glob("outputs/*/*"))
    assert blocker.read_text() == "not a folder"


def test_an_error_in_a_config_file_leaves_no_run_directory(cache, tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "mine.yaml").write_text("defaults:\n  - base_config\n  - _self_\nlr: -1.0\n")
    res = cli("--config-dir", str(conf), "--config-name", "mine", *args(cache), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    one_error_line(res, "lr=-1.0: expected a number in (0, 10]")
    assert not list(tmp_path.glob("outputs/*/*"))


@pytest.mark.parametrize("override, expected", [
    ("foo=1", "error: foo: unknown key"),
    ("more_determinism=1", "error: more_determinism is retired"),
    ("data.n_categories=0", "error: data.n_categories=0: expected a positive integer"),
])
def test_the_data_command_checks_its_input_first(tmp_path, override, expected):
    res = cli(override, f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path, module="scaffold.data")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[0].startswith(expected) and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()
