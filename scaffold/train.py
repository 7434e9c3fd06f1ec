"""`python -m scaffold.train key=value ...`: the Hydra entry point.

    python -m scaffold.train                      # CPU quickstart (scale 4)
    python -m scaffold.train scale=7 epochs=2     # the GPU benchmark size, 128³
    python -m scaffold.train -m scale=4,5 seed=0,1   # a sweep; summary.md lands in the sweep directory
    python -m scaffold.train resume=outputs/2026-12-02/10-00-00   # continue a run bit for bit
    python -m scaffold.train -m hparams_search=optuna_lr   # Optuna search (pip install 'scaffold-unet[optuna]')

Overrides are checked against the schema (scaffold/config.py) before Hydra starts, so a typo or a bad value
costs one line and exit code 2, not a traceback. The run itself is scaffold.worker.run; the task returns
the configured `objective` (a float) for sweepers that optimize it.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import hydra

from scaffold import cli, rundir
from scaffold.checkpoint import CheckpointError
from scaffold.cli import register
from scaffold.config import OBJECTIVES, ConfigError

log = logging.getLogger("scaffold")

# The result.json field each objective reads.
OBJECTIVE_FIELDS = {"best_val_loss": "best_val_loss", "best_val_dice": "best_val_dice",
                    "final_val_dice": "final_val_dice", "time_to_target": "time_to_target_s"}


def worst(objective: str) -> float:
    """The value that ranks last in the objective's direction."""
    return -math.inf if OBJECTIVES.get(objective) == "maximize" else math.inf


def objective_value(result: dict, objective: str) -> float:
    """The objective of one run's result; the worst value where the run has none (a missed target)."""
    value = result.get(OBJECTIVE_FIELDS[objective])
    return worst(objective) if value is None else float(value)


def _recorded(fn, *args, **kwargs):
    """fn(...); under torchrun a rank's error also goes to the file torchrun's agent reads, so the job's
    summary names the rank that failed first with its error (Hydra turns an error into exit code 1,
    which the summary could only show as such)."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return fn(*args, **kwargs)
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn, error_handler=error_handler())(*args, **kwargs)


def error_handler():
    """torch's elastic ErrorHandler with its error file written whole or not at all. torch writes the
    file in place; once one rank has failed the agent sends the others SIGTERM, and a signal landing
    while a rank was writing its own error left the file empty, on which torchrun's agent failed
    itself (JSONDecodeError) instead of naming the rank. Here the record goes to a temporary file
    that is renamed into place (scaffold.files)."""
    import json
    import time
    import traceback

    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from scaffold.files import atomic_open

    class WholeFileErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            path = self._get_error_file_path()
            if not path:
                return super().record_exception(e)
            record = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": {
                "py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}
            with atomic_open(path) as f:
                json.dump(record, f)

    return WholeFileErrorHandler()


@hydra.main(config_path=cli.conf_dir(), config_name="config", version_base=None)
def _task(cfg) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from scaffold import worker
    from scaffold.data.store import DatasetCorrupt
    from scaffold.distributed import RankTimeout
    from scaffold.stats import StatsError
    from scaffold.trainer import Diverged, Interrupted

    hc = HydraConfig.get()
    if cli.FROM_SLURM:
        log.info("%s", cli.FROM_SLURM)
    overrides = [o for o in hc.overrides.task if not o.startswith("resume=")]
    run_dir = Path(hc.runtime.output_dir)
    try:
        if hc.mode == RunMode.MULTIRUN:
            cfg.resume = _job_resume(cfg.resume, run_dir)
        if cfg.resume is None and hc.mode != RunMode.MULTIRUN and int(os.environ.get("RANK", "0")) == 0:
            # A directory Hydra chose (another config file, an interpolated name): owned from here on.
            # With no lock file in it no run has claimed it, so Hydra's record and log are this run's.
            cli.own_run_dir(run_dir, hydra_files_ours=not (run_dir / ".lock").exists())
        if cfg.resume is not None:
            run_dir = Path(cfg.resume)
            cfg = cli.resumed_config(run_dir, cfg, overrides)
        result = _recorded(worker.run, cfg, run_dir, resume=cfg.resume is not None, overrides=overrides)
    except Interrupted as e:
        # Preemption or Ctrl-C: what could be saved is saved; the sweep (if any) ends here too.
        log.warning("%s", e)
        if int(os.environ.get("RANK", "0")) == 0:  # the other ranks do not know the run's directory
            # Before run.json exists there is no run to resume: the directory goes (see main).
            hint = f" (resume={run_dir} continues it)" if (run_dir / "run.json").exists() else ""
            print(f"{e}{hint}", file=sys.stderr)
            if hc.mode == RunMode.MULTIRUN:
                _summary_of_a_stopped_sweep(hc)
        if os.environ.get("SUBMITIT_EXECUTOR"):
            _pass_on_to_submitit(e.signum)
        sys.exit(128 + e.signum)
    except RankTimeout as e:  # a hung rank: the surviving ranks name it in one line
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (ConfigError, CheckpointError, StatsError, DatasetCorrupt, Diverged, OSError) as e:
        if isinstance(e, OSError) and e.errno not in cli.STORAGE_ERRORS:
            raise  # not a full or read-only disk: a bug to see whole
        if isinstance(e, OSError):
            e = ConfigError(f"{e.filename or run_dir}: {e.strerror} (files are written to a temporary name "
                            "and renamed: none is left half-written)")
        log.error("%s", e)
        if cfg.resume is None and hc.mode != RunMode.MULTIRUN:
            cli.remove_unused_run_dir(run_dir)  # a run that never started leaves no directory behind
        if hc.mode == RunMode.MULTIRUN:
            # One failed job should not end the sweep. Optuna's sweeper ends the whole study on a job
            # that raises or returns a non-number (NaN included; max_failure_rate defaults to 0), but
            # takes an infinity as an ordinary value: ranked last, it also steers the sampler away from
            # what failed (a diverging learning rate, say).
            return worst(str(cfg.objective))
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3 if isinstance(e, Diverged) else 2)
    value = objective_value(result, str(cfg.objective))
    log.info("objective %s = %s", cfg.objective, value)
    return value


def _job_resume(resume, run_dir: Path):
    """A sweep job's `resume`: with `resume=auto`, and in every job a submitit launcher runs (which runs a
    job again only when it was requeued: preempted, or past its time limit), the job continues the run
    its directory holds, else starts one there."""
    if resume != "auto" and not (resume is None and os.environ.get("SUBMITIT_EXECUTOR")):
        return resume
    if (run_dir / rundir.RUN_FILE).exists():
        log.info("resume=auto: %s holds a run: continuing it", run_dir)
        return str(run_dir)
    return None


def _pass_on_to_submitit(signum: int) -> None:
    """In a job of a submitit launcher: once training has stopped and saved its position, the signal
    goes on to the handler submitit installed (the run's own handler stood in for it meanwhile). For
    submitit's warning signal (USR2) that handler resubmits the job (the launcher's checkpoint(): the same
    job, whose directory now holds the run) and requeues it; it exits. Where submitit will not requeue
    (a time limit reached too often), it says why in one line and the job ends here."""
    import signal

    handler = signal.getsignal(signum)
    if not callable(handler) or handler is signal.default_int_handler:
        return
    try:
        handler(signum, None)
    except Exception as e:  # noqa: BLE001 - submitit's UncompletedJobError: not requeued
        print(f"{signal.Signals(signum).name}: {e}", file=sys.stderr)


def _summary_of_a_stopped_sweep(hc) -> None:
    """A sweep that a signal stops ends in this job: Hydra calls no end-of-sweep callback then, so the
    summary of the jobs so far (this one `interrupted (resume=...)`) is written here, where the sweep's
    summary callback is configured. Not in a job of a submitit launcher: there the job is requeued (or
    fails) and the sweep goes on in the submitting process, which writes the summary at its end."""
    from scaffold import report

    if os.environ.get("SUBMITIT_EXECUTOR"):
        return
    targets = {str((c or {}).get("_target_", "")) for c in (hc.callbacks or {}).values()}
    if f"{report.SweepSummary.__module__}.{report.SweepSummary.__name__}" not in targets:
        return
    try:
        report.write_sweep_summary(Path(hc.sweep.dir))
    except OSError as e:
        log.warning("sweep summary not written (%s); python -m scaffold.report %s writes it", e, hc.sweep.dir)
    print(f"the same command with resume=auto hydra.sweep.dir={hc.sweep.dir} continues the sweep (each job "
          "the run its directory holds)", file=sys.stderr)


def _one_line_warnings() -> None:
    """Our own warnings (a ladder rung that cannot run, say) as one line each, without the source line
    Python's default format appends."""
    import warnings

    default = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):
        if category.__module__.startswith("scaffold."):
            return f"warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = fmt


def main() -> None:
    _one_line_warnings()
    try:
        cli.ranks_from_slurm()  # plain srun: its tasks are one job's ranks (before anything reads RANK)
        sys.argv = [sys.argv[0]] + cli.preflight(sys.argv[1:], claim=True, hydra_checks=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    register()
    try:
        _task()
    finally:
        # The directories this process owns, given back; a run that never began (Hydra failed, say)
        # leaves no stray folder, and nothing this process did not create is removed.
        rundir.release_all(remove_unused=True)
        cli.release_sweep_dir()


if __name__ == "__main__":
    main()
