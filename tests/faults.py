"""Fault injection for the multi-process tests, run by torchrun in place of `-m scaffold.train`:

    torchrun --standalone --nproc-per-node=3 tests/faults.py kill=1@5 KEY=VALUE ...

`kill=R@N` SIGKILLs rank R when it begins its N-th optimizer step (counted from the first step of the
first epoch); `raise=R@N` makes it raise instead. The other arguments go to scaffold.train as they are.
"""
import os
import signal
import sys

from scaffold.trainer import Trainer
from scaffold.train import main


def _inject(kind: str, rank: int, at: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    real = Trainer.step
    calls = {"n": 0}

    def step(self, masks):
        calls["n"] += 1
        if calls["n"] == at:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {rank} at step {at}")
        return real(self, masks)

    Trainer.step = step


if __name__ == "__main__":
    args = []
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key in ("kill", "raise"):
            rank, at = value.split("@")
            _inject(key, int(rank), int(at))
        else:
            args.append(arg)
    sys.argv = [sys.argv[0], *args]
    main()
