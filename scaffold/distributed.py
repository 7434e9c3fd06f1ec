"""One process's place in a job: rank, world size, device, and reductions of device tensors.

Under torchrun (or plain srun, whose task variables scaffold.cli.ranks_from_slurm turns into torchrun's
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT) the process group is initialised from the environment: NCCL on CUDA, gloo on the CPU. A single process needs none of it.
Reductions take and return device tensors and never read them back to the host.

Failure is bounded: every collective waits at most `timeout_s` for the other ranks (the process group's
timeout; NCCL's watchdog then aborts the process), and torchrun's agent ends the other ranks as soon as
one exits with an error, so a dead or failing rank never leaves the job hanging. A hung rank (stopped, not
dead) is found by the others' timeout; on gloo they then call the roll (`roll_call`: torch's
monitored_barrier on a group kept for it) and the error names the ranks that did not arrive.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Place:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    joined: bool = False  # in a process group (launched by torchrun/Slurm, even with one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device_kind: str, timeout_s: float = 300.0) -> Place:
    """Join the process group when launched by torchrun/Slurm (RANK and WORLD_SIZE set; one process
    too, so that `torchrun --nproc-per-node=1` runs the data-parallel path); a lone process gets Place()."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Place()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(cuda_index(local_rank))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "gloo" and world > 1:  # for the roll call after a timeout (see roll_call)
            global _ROLL
            _ROLL = dist.new_group(backend="gloo")
    return Place(rank=rank, world=world, local_rank=local_rank, joined=True)


_ROLL: Any = None  # a gloo group of every rank that no step uses: it is intact when a collective timed out


class RankTimeout(RuntimeError):
    """A collective timed out; the one-line message names the ranks that did not arrive."""


def timed_out(error: BaseException) -> bool:
    """Whether `error` is a collective's timeout (gloo: "Timed out waiting ...", "Application timeout
    caused pair closure"): torch's own errors only (a plain RuntimeError or a DistError), never one of
    ours that mentions a timeout."""
    torch_error = isinstance(error, dist.DistError) or type(error) is RuntimeError
    return torch_error and re.search(r"time[sd]?[ -]?out", str(error), re.I) is not None


def roll_call(error: BaseException, timeout_s: float) -> Optional[RankTimeout]:
    """After a collective timed out (`error`) on this rank: which ranks did not arrive. Every rank that
    got there meets the others in torch's monitored_barrier on a group no step uses, for at most
    min(timeout_s, 30) s more (the live ranks time out within a step of each other); rank 0 names the
    ranks missing from it. None when there is no roll to call (one process, NCCL, another error).

    A rank stopped or hung (alive, never arriving) is named; a dead rank ends the job at once through
    torchrun's agent, before any timeout."""
    if _ROLL is None or not timed_out(error) or not dist.is_initialized():
        return None
    rank, window = dist.get_rank(), min(float(timeout_s), 30.0)
    what = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    head = f"rank {rank}: a collective timed out after parallel.timeout_s={timeout_s:g} s ({what})"
    try:
        dist.monitored_barrier(_ROLL, timeout=datetime.timedelta(seconds=window), wait_all_ranks=True)
    except RuntimeError as e:
        missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
        if missing:
            ranks = missing.group(1).strip()
            many = "," in ranks
            return RankTimeout(f"{head}: rank{'s' if many else ''} {ranks} did not arrive in a further "
                               f"{window:g} s ({'they are' if many else 'it is'} stopped or hung, not dead)")
        return RankTimeout(f"{head}: rank 0, which names the ranks that did not arrive, did not confirm "
                           f"every rank present in a further {window:g} s (rank 0 is hung, or names the "
                           "ranks that are)")
    return RankTimeout(f"{head}: every rank arrived afterwards (none is hung: a slow rank, or ranks in "
                       "different collectives)")


def cuda_index(local_rank: int) -> int:
    """The GPU a rank uses: its local rank among the node's GPUs (torchrun shows every rank all of them),
    or the one GPU a task sees (srun --gpus-per-task=1 binds each task its own)."""
    return 0 if torch.cuda.device_count() == 1 else local_rank


def all_reduce_sum(t: torch.Tensor, place: Place) -> torch.Tensor:
    if place.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


STOP_LAG = 2  # steps between a rank's vote to stop and the boundary where every rank reads it


class StopVote:
    """A stop request (SIGTERM from torchrun or a scheduler), made into a step boundary every rank agrees
    on, without a host sync in the step.

    After each step every rank posts its vote (1 when it was asked to stop) as a one-element device
    tensor and starts an asynchronous all-reduce of it; the sum is read `lag` steps later, before that
    step runs. Every rank posts and reads the same votes at the same steps, so all stop before the same
    step. On CUDA the vote's sum is copied to pinned host memory behind the all-reduce, and the read
    waits on that copy's event, posted `lag` steps earlier: the host waits only where it has run
    more than `lag` steps ahead of the device."""

    def __init__(self, place: Place, device: torch.device, lag: int = STOP_LAG):
        self.place, self.device, self.lag = place, device, max(1, lag)
        self.pending: list[tuple[torch.Tensor, Any, Any]] = []
        # On CUDA: pinned host slots for the sums, reused in turn (at most `lag` votes are in flight).
        self.slots = [torch.empty(1, pin_memory=True) for _ in range(self.lag + 1)] \
            if device.type == "cuda" else []
        self.posted = 0

    def post(self, requested: bool) -> None:
        vote = torch.full((1,), 1.0 if requested else 0.0, device=self.device)
        work = dist.all_reduce(vote, op=dist.ReduceOp.SUM, async_op=True)
        if self.device.type != "cuda":
            self.pending.append((vote, work, None))
            return
        work.wait()  # on CUDA: the current stream waits for the collective, the host does not
        host = self.slots[self.posted % len(self.slots)]
        self.posted += 1
        host.copy_(vote, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending.append((host, None, done))

    def agreed(self) -> bool:
        """Whether every rank stops before the next step (the votes posted `lag` steps ago, and
        earlier, are read)."""
        stop = False
        while len(self.pending) >= self.lag:
            stop = self._read(self.pending.pop(0)) or stop
        return stop

    def drain(self) -> None:
        """Wait for the votes still in flight (at the epoch's end, where the epoch's own all-reduce
        carries every rank's stop flag)."""
        while self.pending:
            self._read(self.pending.pop(0))

    @staticmethod
    def _read(item: tuple[torch.Tensor, Any, Any]) -> bool:
        value, work, done = item
        if work is not None:
            work.wait()
        if done is not None:
            done.synchronize()
        return bool(value.item() > 0)


def gather_rows(t: torch.Tensor, place: Place) -> torch.Tensor:
    """Every rank's `t` stacked along a new first dimension (rank order), on every rank."""
    if place.world <= 1:
        return t.unsqueeze(0)
    out = [torch.empty_like(t) for _ in range(place.world)]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def fingerprint(tensors) -> str:
    """A short hash of tensors' values in logical order, whatever their memory layout (read to the
    host: start-up checks only, never in a step). Each tensor is flattened before its bytes are read:
    a channels-last 1×1×1 conv weight counts as contiguous yet has a last stride > 1, which a byte
    view refuses."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def gather_objects(value: Any, place: Place) -> list[Any]:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    if place.world <= 1:
        return [value]
    values: list[Any] = [None] * place.world
    dist.all_gather_object(values, value)
    return values


def check_same(value: str, what: str, place: Place) -> None:
    """Raises on every rank when `value` differs between ranks (e.g. a parameter fingerprint)."""
    if place.world <= 1:
        return
    values = gather_objects(value, place)
    if len(set(values)) > 1:
        differ = [r for r, v in enumerate(values) if v != values[0]]
        raise RuntimeError(f"{what} differs between ranks: rank 0 has {values[0]}, ranks {differ} differ")


def agree(error: Optional[BaseException], place: Place) -> None:
    """Meets every rank (a barrier) and raises on all of them when any rank brings an error: a check that
    only some ranks ran (rank 0 probing the run directory, the leaders generating the dataset) then
    fails the whole job at once, with the first rank's one-line message, instead of leaving the other
    ranks waiting for a collective that never comes."""
    from scaffold.config import ConfigError

    if place.world <= 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else (isinstance(error, ConfigError), str(error).splitlines()[0])
    for rank, got in enumerate(gather_objects(mine, place)):
        if got is not None:
            is_config, message = got
            if rank == place.rank and error is not None:
                raise error
            raise (ConfigError(message) if is_config else RuntimeError(f"rank {rank}: {message}"))


def broadcast_object(obj: Any, place: Place) -> Any:
    """Rank 0's value on every rank (e.g. the run directory that only rank 0 decides)."""
    if place.world <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(place: Place) -> None:
    if place.world > 1:
        dist.barrier()


def shutdown(place: Place) -> None:
    """Leave the group together: a rank that tears down while another still works (rank 0 writing
    figures and results) can leave the group's teardown waiting forever."""
    global _ROLL
    if place.joined and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _ROLL = None
