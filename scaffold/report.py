"""What a user reads after a run: figures from train_stats.csv, and a sweep's summary table.

Figures need matplotlib (`pip install scaffold-unet[plots]`); without it a run says so in one line and goes on.
The sweep summary is a Hydra callback (configured in conf/config.yaml): when a multirun ends it collects
every job's result.json into summary.csv and summary.md in the sweep directory. A resumed job refreshes
its sweep's summary; `python -m scaffold.report DIR [--sort COLUMN]` rebuilds one for any sweep or tree
of runs (outputs/, multirun/) and prints it.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from scaffold.files import atomic_open, read_json, write_text
from scaffold.stats import read_rows

log = logging.getLogger("scaffold")

FIGURES = {  # file name -> (columns, y label)
    "train_loss.png": (("overall_loss",), "training loss (mean per volume)"),
    "val_loss.png": (("val_loss_avg",), "validation loss (mean per volume)"),
    "val_dice.png": (("val_dice", "train_dice"), "Dice (foreground)"),
}


RUN_ROOTS = ("outputs", "multirun")  # Hydra's run and sweep folders (conf/config.yaml)


def run_id(run_dir: Path) -> str:
    """A run's name in figure titles: its path below Hydra's outputs/ or multirun/ (date/time[/job]),
    else the directory's name."""
    parts = Path(run_dir).resolve().parts
    roots = [i for i, part in enumerate(parts) if part in RUN_ROOTS]
    return "/".join(parts[roots[-1] + 1:]) if roots and roots[-1] + 1 < len(parts) else parts[-1]


def _target_dice(run_dir: Path) -> float | None:
    try:
        return float(json.loads((run_dir / "run.json").read_text())["config"]["target_dice"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with one log line) where matplotlib is
    not installed: figures are an extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("figures skipped: matplotlib is not installed (pip install 'scaffold-unet[plots]')")
        return None
    return plt


def save_figure(plt, fig, path: Path) -> Path:
    """Write a figure as PNG under a temporary name and rename it (no half-written file), then close it."""
    try:
        fig.tight_layout()
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)
    return path


def plot_run(run_dir: Path, target_dice: float | None = None) -> list[Path]:
    """Write the figures of a run directory; returns the files written (none without matplotlib).

    Each title names the run; the loss figures mark the best epoch (lowest val_loss_avg, the last row
    with is_best = 1); the Dice figure draws the target (`target_dice`, else run.json's config)."""
    run_dir = Path(run_dir)
    stats = run_dir / "train_stats.csv"
    if not stats.exists():
        return []
    plt = pyplot()
    if plt is None:
        return []
    from matplotlib.ticker import MaxNLocator

    rows = read_rows(stats)
    if not rows:
        return []
    epochs = [int(r["epoch"]) for r in rows]
    best = [e for e, r in zip(epochs, rows) if r.get("is_best") == "1"]
    best_epoch = best[-1] if best else None
    target = target_dice if target_dice is not None else _target_dice(run_dir)
    title = run_id(run_dir)
    written = []
    for name, (columns, ylabel) in FIGURES.items():
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
        for col in columns:
            ax.plot(epochs, [float(r[col]) for r in rows], marker="o", ms=3, label=col)
        if "loss" in name and best_epoch is not None:
            ax.axvline(best_epoch, color="tab:green", ls="--", lw=1, label=f"best epoch {best_epoch}")
        if name == "val_dice.png" and target is not None:
            ax.axhline(target, color="tab:red", ls=":", lw=1, label=f"target {target:g}")
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.set_title(f"run {title}", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0][1:]:  # a legend only when there is more than one line
            ax.legend(fontsize=7)
        written.append(save_figure(plt, fig, run_dir / name))
    return written


SUMMARY_COLUMNS = ("job", "overrides", "epochs", "optimizer_steps", "final_val_dice", "best_epoch",
                   "best_val_loss", "time_to_target_s", "epoch_time_to_target_s", "upstream_fom",
                   "startup_s", "train_time_s", "status", "resumes")
SUMMARY_FILES = ("summary.csv", "summary.md")


def find_runs(root: Path) -> list[Path]:
    """The run directories at or below `root` (those holding a run.json or result.json), in job order.

    A sweep's jobs are its numbered subfolders; an outputs/ or multirun/ tree nests runs by date and
    time, and sweeps by job. A run's own subfolders (checkpoints/, .hydra/, tensorboard/) are not
    searched."""
    root = Path(root)
    runs = []
    for folder, subfolders, files in os.walk(root):
        if "run.json" in files or "result.json" in files:
            runs.append(Path(folder))
            subfolders[:] = []
        else:
            subfolders[:] = [d for d in subfolders if not d.startswith(".")]
    return sorted(runs, key=lambda run: _job_key(run.relative_to(root)))


def summarize_sweep(sweep_dir: Path) -> list[dict[str, Any]]:
    """Collect the result.json of every run under a sweep directory (or an outputs/ tree) into
    summary.csv and summary.md there; returns the rows.

    A job is listed by the overrides it was started with; its resumes (the epoch each continued from
    and its own overrides) are a column of their own. Override keys whose values differ between the
    runs (the sweep's axes) get a column each, so the table can be sorted by them."""
    sweep_dir = Path(sweep_dir)
    rows = [_summary_row(run, sweep_dir) for run in find_runs(sweep_dir)]
    columns = summary_columns(rows)
    write_text(sweep_dir / "summary.csv", _as_csv(rows, columns))
    write_text(sweep_dir / "summary.md", _as_markdown(rows, columns) + seed_section(rows))
    return rows


def _summary_row(run: Path, root: Path) -> dict[str, Any]:
    rel = run.relative_to(root)
    row: dict[str, Any] = {"job": rel.as_posix() if rel.parts else run.name}
    res, record = read_json(run / "result.json"), read_json(run / "run.json") or {}
    if res is not None:
        row.update({k: res[k] for k in SUMMARY_COLUMNS if k in res})
        source = res
        row["status"] = "reached target" if res.get("time_to_target_s") is not None else "epoch cap"
    else:
        # No result: the run failed, was stopped or killed, or is still running.
        source = record
        row["status"] = "unreadable result.json" if (run / "result.json").exists() else _unfinished(run, row)
    overrides = list(source.get("overrides", []))
    row["overrides"] = " ".join(overrides)
    row["resumes"] = "; ".join(" ".join([f"@{r.get('at_epoch')}", *r.get("overrides", [])])
                               for r in source.get("resumes", []))
    row["_overrides"] = dict(_split_override(o) for o in overrides)
    return row


def _unfinished(run: Path, row: dict[str, Any]) -> str:
    """The status of a run without a result (running; interrupted, with what a resume continues; or
    failed), and its metrics so far from train_stats.csv into `row`."""
    from scaffold import checkpoint, rundir

    try:
        rows = read_rows(run / "train_stats.csv") if (run / "train_stats.csv").exists() else []
    except Exception:  # noqa: BLE001 - a damaged CSV only loses the metrics so far
        rows = []
    if rows:
        last, best = rows[-1], [r for r in rows if r.get("is_best") == "1"]
        row.update({"epochs": int(last["epoch"]), "optimizer_steps": int(last["total_optimizer_steps"]),
                    "final_val_dice": float(last["val_dice"])})
        if best:
            row.update({"best_epoch": int(best[-1]["epoch"]), "best_val_loss": float(best[-1]["val_loss_avg"])})
    try:
        rundir.check_free(run)
    except rundir.RunDirBusy:
        return "running"
    except OSError:
        pass
    folder = run / "checkpoints"
    if (folder / checkpoint.LAST).exists() or (folder / checkpoint.BEST).exists():
        return f"interrupted (resume={run})"
    return "failed"


def _split_override(item: str) -> tuple[str, str]:
    key, _, value = item.partition("=")
    return key.lstrip("+~"), value


def _varying(rows: list[dict[str, Any]]) -> list[str]:
    """The override keys whose values differ between the rows (a sweep's axes), in first-seen order."""
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r.get("_overrides", {})))
    return [k for k in keys if len({r.get("_overrides", {}).get(k) for r in rows}) > 1]


def summary_columns(rows: list[dict[str, Any]]) -> list[str]:
    """SUMMARY_COLUMNS, then one column per override key whose value differs between the rows; a key
    that is also a result column (epochs=...) is named `key (override)`."""
    varying = _varying(rows)
    extra = [f"{k} (override)" if k in SUMMARY_COLUMNS else k for k in varying]
    for r in rows:
        for key, name in zip(varying, extra):
            r[name] = r.get("_overrides", {}).get(key)
    return [*SUMMARY_COLUMNS, *extra]


def _job_key(rel: Path):
    # Numbered jobs in numeric order (2 before 10); dates and times sort as text.
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in Path(rel).parts)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _as_csv(rows: list[dict[str, Any]], columns=SUMMARY_COLUMNS) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(columns)
    for r in rows:
        w.writerow([_fmt(r.get(c)) for c in columns])
    return buf.getvalue()


def _as_markdown(rows: list[dict[str, Any]], columns=SUMMARY_COLUMNS) -> str:
    """A markdown table whose columns line up, so that it also reads as plain text in a terminal."""
    cells = [list(columns)] + [[_fmt(r.get(c)).replace("|", "\\|") for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])]) + "\n"


SEED_METRICS = ("time_to_target_s", "epochs", "optimizer_steps", "best_val_loss", "final_val_dice")
FINISHED = ("reached target", "epoch cap")


def over_seeds(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Where the runs differ in `seed`: one row per setting of the other varying overrides, with how
    many runs finished and reached the target, and the median [min – max] of SEED_METRICS over the
    finished runs, a run that missed the target counting as inf in time_to_target_s (a time to target
    is stated over seeds: one run's epoch count moves with its bits). ([], []) without a seed axis."""
    varying = _varying(rows)
    if "seed" not in varying:
        return [], []
    axes = [k for k in varying if k != "seed"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r["_overrides"].get(k) for k in axes), []).append(r)
    table = []
    for key, runs in groups.items():
        done = [r for r in runs if r["status"] in FINISHED]
        row = {**dict(zip(axes, key)), "runs finished": f"{len(done)} of {len(runs)}",
               "reached target": sum(r["status"] == "reached target" for r in done)}
        for metric in SEED_METRICS:
            values = [math.inf if metric == "time_to_target_s" and r["status"] == "epoch cap"
                      else r.get(metric) for r in done]
            row[metric] = _spread([float(v) for v in values if v is not None])
        table.append(row)
    return [*axes, "runs finished", "reached target", *SEED_METRICS], table


def _spread(values: list[float]) -> str:
    """'median [min – max]' of the values; the value alone where there is one; '' where none."""
    if len(values) < 2:
        return _fmt(values[0]) if values else ""
    return f"{_fmt(statistics.median(values))} [{_fmt(min(values))} – {_fmt(max(values))}]"


def seed_section(rows: list[dict[str, Any]]) -> str:
    """summary.md's table over seeds (over_seeds), or "" where the runs do not differ in seed."""
    columns, table = over_seeds(rows)
    if not table:
        return ""
    return ("\nOver seeds: median [min – max] of the finished runs; a run that missed the target counts "
            "as inf in time_to_target_s.\n\n" + _as_markdown(table, columns))


def sort_rows(rows: list[dict[str, Any]], column: str, reverse: bool = False) -> list[dict[str, Any]]:
    """Rows ordered by one column: numbers numerically, text as text, blanks last either way."""
    def key(r):
        try:  # result values are numbers; override values are text such as "0.001"
            return (0, float(r[column]), "")
        except (TypeError, ValueError):
            return (1, 0.0, str(r[column]))
    filled = [r for r in rows if r.get(column) not in (None, "")]
    blank = [r for r in rows if r.get(column) in (None, "")]
    return sorted(filled, key=key, reverse=reverse) + blank


def refresh_summary(run_dir: Path) -> Path | None:
    """After a resume: rebuild the summary of the sweep the run is a job of (its parent folder holds
    one), so that it shows the resumed run's new results. Returns the sweep folder, or None."""
    sweep = Path(run_dir).resolve().parent
    if not (sweep / "summary.csv").is_file():
        return None
    try:
        summarize_sweep(sweep)
    except OSError as e:  # the run itself succeeded; a summary can be rebuilt with scaffold.report
        log.warning("sweep summary %s not updated (%s); rebuild it with python -m scaffold.report %s",
                    sweep / "summary.md", e, sweep)
        return None
    return sweep


def main(argv: list[str] | None = None) -> int:
    """`python -m scaffold.report DIR`: rebuild DIR's summary.csv / summary.md and print the table."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m scaffold.report",
        description="Rebuild summary.csv and summary.md from the runs' result.json files (after a resume, "
                    "or for a sweep that ended early) and print the table: one row per run, with the "
                    "overrides it was started with, its resumes, its results and a column per override "
                    "that differs between the runs.")
    parser.add_argument("directory", type=Path,
                        help="a sweep directory (multirun/DATE/TIME), a tree of runs (outputs/, multirun/) "
                             "or one run directory")
    parser.add_argument("--sort", metavar="COLUMN",
                        help="print the rows ordered by this column (e.g. best_val_loss, or an override "
                             "key such as lr); the files keep job order")
    parser.add_argument("--reverse", action="store_true", help="with --sort: largest first")
    args = parser.parse_args(argv)
    root = args.directory
    if not root.is_dir():
        print(f"error: {root}: no such directory", file=sys.stderr)
        return 2
    if not find_runs(root):
        print(f"error: {root}: no runs here (no run.json or result.json at or below it)", file=sys.stderr)
        return 2
    try:
        rows = summarize_sweep(root)
    except OSError as e:
        print(f"error: {root}: cannot write the summary ({e.strerror or e})", file=sys.stderr)
        return 2
    columns = summary_columns(rows)
    if args.sort is not None:
        if args.sort not in columns:
            print(f"error: --sort {args.sort}: no such column (choose from: {' | '.join(columns)})",
                  file=sys.stderr)
            return 2
        rows = sort_rows(rows, args.sort, args.reverse)
    print(f"{len(rows)} run(s); wrote {root / 'summary.csv'} and {root / 'summary.md'}")
    print(_as_markdown(rows, columns) + seed_section(rows), end="")
    return 0


try:  # the Hydra callback; the rest of this module works without Hydra
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]


def write_sweep_summary(sweep_dir: Path) -> None:
    """Write a sweep's summary.csv / summary.md and print the table (the end of a multirun, or of one
    stopped by a signal)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.exists():
        return
    rows = summarize_sweep(sweep_dir)
    print(f"sweep summary ({len(rows)} jobs): {sweep_dir / 'summary.md'}")
    print((sweep_dir / "summary.md").read_text(), end="")


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, write summary.csv / summary.md in the sweep directory.
    Hydra calls it only when every job has returned: a sweep stopped by a signal writes its summary
    from the stopped job instead (scaffold.train)."""

    def on_multirun_end(self, config, **kwargs) -> None:
        write_sweep_summary(Path(config.hydra.sweep.dir))


if __name__ == "__main__":
    sys.exit(main())
