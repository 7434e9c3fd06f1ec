"""What a user reads after a run: figures from train_stats.csv, and a sweep's summary table.

Figures need matplotlib (`pip install scaffold[plots]`); without it a run says so in one line and goes on.
The sweep summary is a Hydra callback (configured in conf/config.yaml): when a multirun ends it collects
every job's result.json into summary.csv and summary.md in the sweep directory.
"""
from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any

from scaffold.files import atomic_open, write_text
from scaffold.stats import read_rows

log = logging.getLogger("scaffold")

FIGURES = {  # file name -> (columns, y label)
    "train_loss.png": (("overall_loss",), "training loss (mean per volume)"),
    "val_loss.png": (("val_loss_avg",), "validation loss (mean per volume)"),
    "val_dice.png": (("val_dice", "train_dice"), "Dice (foreground)"),
}


def plot_run(run_dir: Path) -> list[Path]:
    """Write the figures of a run directory; returns the files written (none without matplotlib)."""
    run_dir = Path(run_dir)
    stats = run_dir / "train_stats.csv"
    if not stats.exists():
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("figures skipped: matplotlib is not installed (pip install 'scaffold[plots]')")
        return []
    rows = read_rows(stats)
    if not rows:
        return []
    epochs = [int(r["epoch"]) for r in rows]
    written = []
    for name, (columns, ylabel) in FIGURES.items():
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
        for col in columns:
            ax.plot(epochs, [float(r[col]) for r in rows], marker="o", ms=3, label=col)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(columns) > 1:
            ax.legend()
        fig.tight_layout()
        out = run_dir / name
        try:
            with atomic_open(out, "wb") as f:
                fig.savefig(f, format="png")
        finally:
            plt.close(fig)
        written.append(out)
    return written


SUMMARY_COLUMNS = ("job", "overrides", "epochs", "optimizer_steps", "final_val_dice", "best_epoch",
                   "best_val_loss", "time_to_target_s", "train_time_s", "status")


def summarize_sweep(sweep_dir: Path) -> list[dict[str, Any]]:
    """Collect each job's result.json under a sweep directory into summary.csv and summary.md."""
    sweep_dir = Path(sweep_dir)
    rows = []
    for job in sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=_job_key):
        result_file = job / "result.json"
        run_file = job / "run.json"
        if not result_file.exists() and not run_file.exists():
            continue
        row: dict[str, Any] = {"job": job.name}
        if result_file.exists():
            res = json.loads(result_file.read_text())
            row.update({k: res.get(k) for k in SUMMARY_COLUMNS if k in res})
            row["overrides"] = " ".join(res.get("overrides", []))
            row["status"] = "reached target" if res.get("time_to_target_s") is not None else "epoch cap"
        else:
            run = json.loads(run_file.read_text())
            row["overrides"] = " ".join(run.get("overrides", []))
            row["status"] = "failed"
        rows.append(row)
    write_text(sweep_dir / "summary.csv", _as_csv(rows))
    write_text(sweep_dir / "summary.md", _as_markdown(rows))
    return rows


def _job_key(p: Path):
    return (0, int(p.name)) if p.name.isdigit() else (1, p.name)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _as_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(SUMMARY_COLUMNS)
    for r in rows:
        w.writerow([_fmt(r.get(c)) for c in SUMMARY_COLUMNS])
    return buf.getvalue()


def _as_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in SUMMARY_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


try:  # the Hydra callback; the rest of this module works without Hydra
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, write summary.csv / summary.md in the sweep directory."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists():
            return
        rows = summarize_sweep(sweep_dir)
        print(f"sweep summary ({len(rows)} jobs): {sweep_dir / 'summary.md'}")
        print((sweep_dir / "summary.md").read_text(), end="")
