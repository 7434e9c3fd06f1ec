"""Command-line plumbing shared by `scaffold.train` and `scaffold.data`: where the Hydra config lives,
the pre-flight check of overrides, and the config of a resumed run.

Hydra rejects unknown keys and wrong types too, but with a multi-line report; checking the overrides
against the schema first gives the one-line error a user needs, before any directory is created. A sweep
is checked value by value: every value of a choice or a range, and samples of an interval (what a sampler
such as Optuna's draws from), including the intervals of a preset's sweeper params.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from scaffold.config import RETIRED, Config, ConfigError, validate

# Keys a resumed run may change: they do not alter what has been computed so far.
RESUME_MUTABLE = {"epochs", "target_dice", "checkpoint_interval", "progress", "profile", "device",
                  "data.workers", "data.cache_dir", "warmup_steps", "cuda_graph", "parallel.timeout_s",
                  "objective", "logger"}


def conf_dir() -> str:
    """The repository's conf/ in a source checkout; the copy shipped as package data otherwise."""
    here = Path(__file__).resolve().parent.parent / "conf"
    return str(here) if (here / "config.yaml").is_file() else "pkg://scaffold.conf"


def _conf_root() -> Any:
    d = conf_dir()
    return importlib.resources.files("scaffold.conf") if d.startswith("pkg://") else Path(d)


def config_groups() -> dict[str, list[str]]:
    """conf/'s own config groups (e.g. hparams_search) and their options; hydra/ is Hydra's."""
    return {g.name: sorted(f.name[:-len(".yaml")] for f in g.iterdir() if f.name.endswith(".yaml"))
            for g in _conf_root().iterdir()
            if g.is_dir() and g.name != "hydra" and not g.name.startswith(("_", "."))}


OPTUNA_MISSING = "needs Hydra's Optuna sweeper (pip install 'scaffold[optuna]')"


def _has_plugin(module: str) -> bool:
    """Whether a Hydra plugin package (hydra_plugins.NAME) is installed. find_spec imports the parent
    namespace first, which is absent altogether when no plugin is installed."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _has_optuna() -> bool:
    return _has_plugin("hydra_plugins.hydra_optuna_sweeper")


# hydra/launcher choices served by hydra-submitit-launcher: conf/hydra/launcher/slurm.yaml and the
# plugin's own two. Without the plugin Hydra fails on them with a multi-line composition error.
SUBMITIT_LAUNCHERS = ("slurm", "submitit_slurm", "submitit_local")


def check_launcher(parsed: list) -> None:
    """A one-line error, before Hydra starts, for a launcher that cannot run here: a submitit one
    without its plugin, or a Slurm one where Slurm's srun is missing (submitit would fail on it only
    once the sweep is submitted, with a traceback)."""
    import shutil

    for o in parsed:
        if o.key_or_group != "hydra/launcher" or o.is_delete() or o.is_sweep_override():
            continue
        name = str(o.value())
        if name not in SUBMITIT_LAUNCHERS:
            continue
        if not _has_plugin("hydra_plugins.hydra_submitit_launcher"):
            raise ConfigError(f"hydra/launcher={name} needs hydra-submitit-launcher: "
                              "pip install 'scaffold[slurm]'")
        if name != "submitit_local" and shutil.which("srun") is None:
            raise ConfigError(f"hydra/launcher={name}: Slurm's srun is not on PATH here (submit from a "
                              "Slurm login node; hydra/launcher=submitit_local runs the sweep on this "
                              "machine)")


def _preset_params(parsed: list) -> dict[str, Any]:
    """The sweeper params of the presets chosen on the command line (hparams_search=NAME); a one-line
    error for an unknown preset, or for one whose sweeper is not installed."""
    groups, params = config_groups(), {}
    for o in parsed:
        key = o.key_or_group
        if key == "hydra/sweeper" and o.value() == "optuna" and not _has_optuna():
            raise ConfigError(f"{o.input_line}: {OPTUNA_MISSING}")
        if key not in groups or o.is_delete():
            continue
        for name in (_sweep_values(o) or []) if o.is_sweep_override() else [o.value()]:
            if name is None:  # the default: no preset
                continue
            if name not in groups[key]:
                raise ConfigError(f"{key}={name}: no such preset (choose from: {' | '.join(groups[key])})")
            preset = OmegaConf.create((_conf_root() / key / f"{name}.yaml").read_text())
            defaults = OmegaConf.to_container(preset).get("defaults", [])
            if {"override /hydra/sweeper": "optuna"} in defaults and not _has_optuna():
                raise ConfigError(f"{key}={name}: {OPTUNA_MISSING}")
            params.update(OmegaConf.select(preset, "hydra.sweeper.params", default=None) or {})
    return params


def _sweep_values(o: Any) -> Optional[list]:
    """The values to check a sweep with: all of a choice or a range; of an interval, its start, middle
    (geometric for tag(log, ...)) and the last float before its end: Hydra's intervals are [start, end)
    of floats, and so are the Optuna sweeper's samples of them (no cast to the key's type: an interval
    over an integer key fails in every trial, so it fails here). None for a sweep that cannot be listed
    here (a glob): the job then checks the value it gets."""
    from hydra.core.override_parser.types import IntervalSweep
    from hydra.errors import HydraException

    sweep = o.value()
    if isinstance(sweep, IntervalSweep):
        lo, hi, log = sweep.start, sweep.end, "log" in sweep.tags
        if lo > hi:
            raise ConfigError(f"{o.input_line}: the interval's start is above its end")
        if log and lo <= 0:
            raise ConfigError(f"{o.input_line}: a log interval needs a start > 0")
        return sorted({lo, math.sqrt(lo * hi) if log else (lo + hi) / 2, math.nextafter(hi, lo)})
    try:
        return list(o.sweep_iterator())
    except HydraException:
        return None


def _one_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _in_sweep(msg: str, sweep: Any) -> str:
    """A check's message, naming the sweep its value came from (the user wrote no such value); a fixed
    key that fails with every swept value is not the sweep's fault."""
    if sweep is None or not msg.startswith(f"{sweep.key_or_group}="):
        return msg
    return f"{msg} (a value of {sweep.input_line})"


def _apply(node: Any, key: str, value: Any, sweep: Any = None) -> None:
    try:
        OmegaConf.update(node, key, value, merge=True)
    except OmegaConfBaseException as e:
        msg = _one_line(e)
        if "not in struct" in msg or "Missing key" in msg or "Key '" in msg and "not" in msg:
            raise ConfigError(f"{key}: unknown key (see scaffold/config.py for the schema)") from None
        raise ConfigError(_in_sweep(f"{key}={value!r}: {msg}", sweep)) from None


def preflight(argv: list[str], check_resume: bool = True) -> list[str]:
    """Check overrides against the schema; returns argv, with Hydra's run dir pointed at a resumed run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
        check_launcher(parsed)
        # A chosen preset's sweeper params are a search space too: checked like the command line's
        # sweeps, except where the command line replaces them (as the sweeper does).
        given = {o.key_or_group for o in parsed}
        params = {k: v for k, v in _preset_params(parsed).items() if k not in given}
        parsed += OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    except HydraException as e:
        raise ConfigError(_one_line(e)) from None
    cfg = OmegaConf.structured(Config)
    resume = None
    sweeps = []
    groups = config_groups()  # presets are chosen by name (checked above), not keys of the schema
    for o in parsed:
        key = o.key_or_group
        if key in RETIRED:
            raise ConfigError(RETIRED[key])
        if key.startswith("hydra") or o.is_delete() or key in groups:
            continue
        if o.is_sweep_override():
            values = _sweep_values(o)
            if values is None:
                continue
            for v in values:
                _apply(OmegaConf.structured(Config), key, v, o)
            sweeps.append((o, values))
            continue
        value = o.value()
        _apply(cfg, key, value)
        if key == "resume":
            resume = value
    # Semantic checks on the combination, for each swept value in turn.
    for o, values in sweeps or [(None, [None])]:
        for v in values:
            trial = OmegaConf.merge(cfg, {})
            if o is not None:
                _apply(trial, o.key_or_group, v)
            if trial.resume is None:
                try:
                    validate(trial)
                except ConfigError as e:
                    raise ConfigError(_in_sweep(str(e), o)) from None
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
