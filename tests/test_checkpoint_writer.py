"""Checkpoints written in the background: the snapshot is taken at submit (later training cannot leak
into it), at most one write is in flight, a failed write surfaces as one CheckpointError, and the
honest time to target counts everything from the first step."""
from __future__ import annotations

import errno
import json
import threading

import pytest
import torch

from helpers import params, same_params, stable_rows, tiny_cfg
from scaffold import checkpoint, worker


def _state(t: torch.Tensor) -> dict:
    return {"epoch": 1, "model": {"w": t}, "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}},
            "scheduler": {}, "rng": {}, "progress": {"best_epoch": 1}, "rows": []}


def _check_snapshot(device: str, tmp_path) -> None:
    w = torch.arange(1 << 20, dtype=torch.float32, device=device)
    writer = checkpoint.Writer(tmp_path)
    writer.submit(_state(w), best=True)
    w.mul_(-1)  # the next step changes the parameters at once; the snapshot must not see it
    writer.flush()
    for name in ("last.pt", "best.pt"):
        saved = checkpoint.load_one(tmp_path / name)["model"]["w"]
        assert torch.equal(saved, torch.arange(1 << 20, dtype=torch.float32)), name
    # The host buffers are reused by the next checkpoint, which holds the new values.
    writer.submit(_state(w), best=False)
    writer.flush()
    assert torch.equal(checkpoint.load_one(tmp_path / "last.pt")["model"]["w"], w.cpu())
    assert checkpoint.load_one(tmp_path / "best.pt")["model"]["w"][1] == 1  # best left as it was


def test_the_snapshot_is_taken_at_submit_on_the_cpu(tmp_path):
    _check_snapshot("cpu", tmp_path)


@pytest.mark.gpu
def test_the_snapshot_is_taken_at_submit_on_the_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _check_snapshot("cuda", tmp_path)


class _Gate:
    """checkpoint.save that records each write's epoch and holds the first one until released
    (optionally failing it with a full disk)."""

    def __init__(self, monkeypatch, fail_first: bool = False):
        self.calls, self.started, self.release = [], threading.Event(), threading.Event()
        self.real, self.fail_first = checkpoint.save, fail_first
        monkeypatch.setattr(checkpoint, "save", self)

    def __call__(self, path, state):
        self.calls.append(state["epoch"])
        if len(self.calls) == 1:
            self.started.set()
            assert self.release.wait(timeout=60)
            if self.fail_first:
                raise checkpoint.CheckpointError(f"{path}: cannot write the checkpoint "
                                                 f"({__import__('os').strerror(errno.ENOSPC)})")
        self.real(path, state)


def _epoch(n: int, value: float = 1.0) -> dict:
    return dict(_state(torch.full((4,), value)), epoch=n)


def test_one_write_in_flight_and_errors_surface_once(tmp_path, monkeypatch):
    writer = checkpoint.Writer(tmp_path)
    gate = _Gate(monkeypatch, fail_first=True)
    writer.submit(_epoch(1), best=False)
    assert gate.started.wait(timeout=60)
    writer.submit(_epoch(2), best=False)  # returns at once: pending behind the write in flight
    assert writer.thread.is_alive() and gate.calls == [1]  # one write in flight, not two
    gate.release.set()
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device"):
        writer.flush()
    assert gate.calls == [1]  # the pending one was not written on top of a failed write
    writer.flush()  # the error surfaced once
    writer.submit(_epoch(3), best=False)
    writer.flush()
    assert checkpoint.load_one(tmp_path / "last.pt")["epoch"] == 3


def test_the_host_does_not_wait_for_a_write_in_flight_and_the_newest_pending_wins(tmp_path, monkeypatch):
    """Two submits behind a held write both return; the newer replaces the older pending snapshot,
    and its values are those at its submit."""
    writer = checkpoint.Writer(tmp_path)
    gate = _Gate(monkeypatch)
    writer.submit(_epoch(1, 1.0), best=False)
    assert gate.started.wait(timeout=60)
    writer.submit(_epoch(2, 2.0), best=False)
    w = torch.full((4,), 3.0)
    writer.submit(dict(_state(w), epoch=3), best=False)
    w.fill_(-1.0)  # training goes on; the pending snapshot holds the value at submit
    assert writer.waited_s < 30 and gate.calls == [1]
    gate.release.set()
    writer.flush()
    assert gate.calls == [1, 3]
    saved = checkpoint.load_one(tmp_path / "last.pt")
    assert saved["epoch"] == 3 and torch.equal(saved["model"]["w"], torch.full((4,), 3.0))


def test_a_pending_best_is_written_before_a_newer_non_best_replaces_anything(tmp_path, monkeypatch):
    """A best snapshot pending behind a write is never dropped for a later non-best one: that submit
    waits until the writer has taken the best, then queues behind it."""
    writer = checkpoint.Writer(tmp_path)
    gate = _Gate(monkeypatch)
    writer.submit(_epoch(1, 1.0), best=True)
    assert gate.started.wait(timeout=60)
    writer.submit(_epoch(2, 2.0), best=True)
    third = threading.Thread(target=writer.submit, args=(_epoch(3, 3.0), False))
    third.start()  # blocks until epoch 2 is taken; the held first write keeps it pending
    gate.release.set()
    third.join(timeout=60)
    assert not third.is_alive()
    writer.flush()
    assert gate.calls == [1, 2, 3]
    assert checkpoint.load_one(tmp_path / "best.pt")["epoch"] == 2
    assert checkpoint.load_one(tmp_path / "last.pt")["epoch"] == 3
    # a newer best does replace a pending best
    gate2 = _Gate(monkeypatch)
    writer.submit(_epoch(4), best=False)
    assert gate2.started.wait(timeout=60)
    writer.submit(_epoch(5), best=True)
    writer.submit(_epoch(6), best=True)
    gate2.release.set()
    writer.flush()
    assert gate2.calls == [4, 6]
    assert checkpoint.load_one(tmp_path / "best.pt")["epoch"] == 6


def test_time_to_target_is_the_wall_clock_from_the_first_step(cache, tmp_path):
    result = worker.run(tiny_cfg(cache, "target_dice=0.01", "epochs=3"), tmp_path)
    assert result["target_epoch"] == 1
    rows = json.loads((tmp_path / "result.json").read_text())
    assert rows["time_to_target_s"] == result["time_to_target_s"]
    # Everything of the epoch counts: at least its training and evaluation, plus what came after.
    assert result["time_to_target_s"] >= result["train_time_s"] > 0
    assert 0.0 <= result["checkpoint_final_wait_s"] <= result["checkpoint_wait_s"]
    assert 0.0 < result["checkpoint_submit_s"] < result["time_to_target_s"]  # counted in it, every epoch
    assert set(result["startup"]) == {"dataset_s", "model_s", "warmup_s", "capture_s", "buckets_s"}
    assert result["startup_s"] >= sum(result["startup"].values())


@pytest.mark.gpu
def test_a_graphed_run_resumed_from_its_checkpoint_is_bitwise(cache, tmp_path):
    """The captured step reads Adam's learning rate from its device tensor: after a resume (state
    loaded, the graph captured again) the trajectory is the uninterrupted one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    small = ["scale=5", "model.bottleneck=3", "model.base_width=16", "model.groups=8", "device=cuda",
             "warmup_steps=1", "optim.t0=1"]  # the rate changes every epoch
    whole, part = tmp_path / "whole", tmp_path / "part"
    worker.run(tiny_cfg(cache, *small, "epochs=3"), whole)
    worker.run(tiny_cfg(cache, *small, "epochs=2"), part)
    cfg = tiny_cfg(cache, *small, "epochs=3")
    cfg.resume = str(part)
    worker.run(cfg, part, resume=True)
    rows = stable_rows(whole / "train_stats.csv")
    assert rows == stable_rows(part / "train_stats.csv")
    assert len({r["lr"] for r in rows}) > 1  # the rate moved across the resume
    assert same_params(params(whole), params(part))


def test_a_wait_for_the_previous_write_counts_in_the_time_to_target(cache, tmp_path, monkeypatch):
    """The host's wait inside a checkpoint's submit (for the write before it) is the user's time too.
    A fake clock makes each submit take 100 s without anything waiting."""
    import time as real_time
    import types

    from scaffold import trainer as trainer_module

    offset = {"s": 0.0}
    clock = types.SimpleNamespace(perf_counter=lambda: real_time.perf_counter() + offset["s"],
                                  process_time=real_time.process_time)
    monkeypatch.setattr(trainer_module, "time", clock)
    real_submit = checkpoint.Writer.submit

    def slow_submit(self, state, best):
        offset["s"] += 100.0
        return real_submit(self, state, best)

    monkeypatch.setattr(checkpoint.Writer, "submit", slow_submit)
    result = worker.run(tiny_cfg(cache, "target_dice=0.01", "epochs=3"), tmp_path)
    assert result["target_epoch"] == 1
    assert result["time_to_target_s"] >= 100.0 > result["train_time_s"]
