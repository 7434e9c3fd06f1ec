"""Command-line plumbing shared by `scaffold.train` and `scaffold.data`: where the Hydra config lives,
the pre-flight check of overrides, and the config of a resumed run.

Hydra rejects unknown keys and wrong types too, but with a multi-line report; checking the overrides
against the schema first gives the one-line error a user needs, before any directory is created.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from scaffold.config import RETIRED_MORE_DETERMINISM, Config, ConfigError, validate

# Keys a resumed run may change: they do not alter what has been computed so far.
RESUME_MUTABLE = {"epochs", "target_dice", "checkpoint_interval", "progress", "profile", "device",
                  "data.workers", "data.cache_dir", "warmup_steps", "cuda_graph", "parallel.timeout_s"}


def conf_dir() -> str:
    """The repository's conf/ in a source checkout; the copy shipped as package data otherwise."""
    here = Path(__file__).resolve().parent.parent / "conf"
    return str(here) if (here / "config.yaml").is_file() else "pkg://scaffold.conf"


def _one_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _apply(node: Any, key: str, value: Any) -> None:
    try:
        OmegaConf.update(node, key, value, merge=True)
    except OmegaConfBaseException as e:
        msg = _one_line(e)
        if "not in struct" in msg or "Missing key" in msg or "Key '" in msg and "not" in msg:
            raise ConfigError(f"{key}: unknown key (see scaffold/config.py for the schema)") from None
        raise ConfigError(f"{key}={value!r}: {msg}") from None


def preflight(argv: list[str], check_resume: bool = True) -> list[str]:
    """Check overrides against the schema; returns argv, with Hydra's run dir pointed at a resumed run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except HydraException as e:
        raise ConfigError(_one_line(e)) from None
    cfg = OmegaConf.structured(Config)
    resume = None
    sweeps = []
    for o in parsed:
        key = o.key_or_group
        if key == "more_determinism":
            raise ConfigError(RETIRED_MORE_DETERMINISM)
        if key.startswith("hydra") or o.is_delete():
            continue
        if o.is_sweep_override():
            values = list(o.sweep_iterator())
            for v in values:
                _apply(OmegaConf.structured(Config), key, v)
            sweeps.append((key, values))
            continue
        value = o.value()
        _apply(cfg, key, value)
        if key == "resume":
            resume = value
    # Semantic checks on the combination, for each swept value in turn.
    for key, values in sweeps or [(None, [None])]:
        for v in values:
            trial = OmegaConf.merge(cfg, {})
            if key is not None:
                _apply(trial, key, v)
            if trial.resume is None:
                validate(trial)
    out_keys = ("hydra.run.dir", "hydra.sweep.dir")
    for o in parsed:
        if o.key_or_group in out_keys and not o.is_sweep_override():
            _check_output_dir(o.key_or_group, str(o.value()))
    if not any(o.key_or_group in out_keys for o in parsed):
        _check_output_dir("working directory", ".")  # outputs/ and multirun/ are created there
    if int(os.environ.get("RANK", "0")) > 0:
        # Under torchrun only rank 0 decides the run directory (the worker broadcasts it); the other
        # ranks must not create directories or logs of their own.
        argv = argv + ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                       "hydra/hydra_logging=disabled"]
    if resume is not None and check_resume:
        run_dir = Path(str(resume))
        if not run_dir.is_dir():
            raise ConfigError(f"resume={resume}: no such run directory")
        if not (run_dir / "run.json").is_file():
            raise ConfigError(f"resume={resume}: not a scaffold run directory (no run.json)")
        if not any(a.startswith("hydra.run.dir=") for a in argv):
            # Continue in the run's own directory; do not let Hydra overwrite its .hydra/ record.
            argv = argv + [f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"]
    return argv


def _check_output_dir(key: str, path: str) -> None:
    """The run directory can be created: its nearest existing ancestor is a writable folder."""
    if "${" in path:  # an interpolation Hydra resolves later: check the fixed part before it
        path = path.split("${", 1)[0] or "."
    ancestor = Path(path).absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: cannot create the run directory ({ancestor} is not a writable "
                          "folder)")


def resumed_config(run_dir: Path, cfg: Any, overrides: list[str]) -> Any:
    """The run's own config, with the overrides a resume may change; others must not differ."""
    saved = json.loads((Path(run_dir) / "run.json").read_text())["config"]
    base = OmegaConf.merge(OmegaConf.structured(Config), saved)
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra"):
            continue
        asked, had = OmegaConf.select(cfg, key), OmegaConf.select(base, key)
        if key in RESUME_MUTABLE:
            OmegaConf.update(base, key, asked, merge=True)
        elif asked != had:
            raise ConfigError(f"resume: {key} cannot change in an existing run (it has {had!r}, "
                              f"asked {asked!r}); start a new run instead")
    base.resume = str(run_dir)
    return base
