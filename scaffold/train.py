"""`python -m scaffold.train key=value ...`: the Hydra entry point.

    python -m scaffold.train                      # CPU quickstart (scale 4)
    python -m scaffold.train scale=7 epochs=2     # the GPU benchmark size, 128³
    python -m scaffold.train -m scale=4,5 seed=0,1   # a sweep; summary.md lands in the sweep directory
    python -m scaffold.train resume=outputs/2026-12-02/10-00-00   # continue a run bit for bit

Overrides are checked against the schema (scaffold/config.py) before Hydra starts, so a typo or a bad value
costs one line and exit code 2, not a traceback. The run itself is scaffold.worker.run.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra

from scaffold import cli
from scaffold.checkpoint import CheckpointError
from scaffold.config import ConfigError, register

log = logging.getLogger("scaffold")


@hydra.main(config_path=cli.conf_dir(), config_name="config", version_base=None)
def _task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from scaffold import worker
    from scaffold.trainer import Diverged

    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task if not o.startswith("resume=")]
    run_dir = Path(hc.runtime.output_dir)
    try:
        if cfg.resume is not None:
            run_dir = Path(cfg.resume)
            cfg = cli.resumed_config(run_dir, cfg, overrides)
        worker.run(cfg, run_dir, resume=cfg.resume is not None, overrides=overrides)
    except (ConfigError, CheckpointError, Diverged) as e:
        log.error("%s", e)
        if hc.mode == RunMode.MULTIRUN:  # one failed job should not end the sweep
            return
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3 if isinstance(e, Diverged) else 2)


def main() -> None:
    try:
        sys.argv = [sys.argv[0]] + cli.preflight(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    register()
    _task()


if __name__ == "__main__":
    main()
