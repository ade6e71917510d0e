"""Reports of a training run: PNG curves and one self-contained HTML page from ``<run_dir>/metrics.jsonl``
(and the Gantt chart of its last steps per resource pool from ``<run_dir>/timeline.jsonl``).

hybridflow report runs/hybridflow/run        # or: python -m hybridflow.report runs/hybridflow/run
-> runs/hybridflow/run/report/report.html and runs/hybridflow/run/report/*.png
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.report.data import Series, load_metrics
from hybridflow.run_files import CONFIG_FILE, METRICS_FILE, TIMELINE_FILE
from hybridflow.validation import ArgumentParser, InputFileError

__all__ = ["Series", "load_metrics", "main", "write_report"]


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Draw the run's curves into ``out_dir`` (default ``<run_dir>/report``) and return the HTML page's path.

    Raises InputFileError when the run has no ``metrics.jsonl``.
    """
    from hybridflow.report.html import render_page
    from hybridflow.report.plots import draw_all

    run_dir = Path(run_dir)
    metrics_file = run_dir / METRICS_FILE
    if not metrics_file.is_file():
        raise InputFileError(
            metrics_file, "not found", f"give the run directory of a run with the jsonl logger (is {run_dir} one?)"
        )
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    metrics = load_metrics(metrics_file)
    figures = [(spec.title, path) for spec, path in draw_all(metrics, out)]
    figures += _timeline_figure(run_dir, out)
    config = run_dir / CONFIG_FILE
    page = out / "report.html"
    page.write_text(render_page(run_dir, metrics, figures, config.read_text() if config.is_file() else None))
    return page


def _timeline_figure(run_dir: Path, out: Path) -> list[tuple[str, Path]]:
    """The Gantt chart of the last steps' spans per pool, when the run wrote a timeline."""
    from hybridflow.report.timeline import draw_timeline
    from hybridflow.run_files import read_spans

    path = out / "timeline.png"
    source = run_dir / TIMELINE_FILE
    if source.is_file() and draw_timeline(read_spans(source), path):
        return [("Timeline per resource pool", path)]
    path.unlink(missing_ok=True)
    return []


def main(argv: list[str] | None = None) -> int:
    """``hybridflow report RUN_DIR [--out DIR]``; returns the exit code."""
    parser = ArgumentParser(
        prog="hybridflow report", description="PNG curves and an HTML page from a run's metrics.jsonl"
    )
    parser.add_argument("run_dir", type=Path, help="the run's output dir (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    page = write_report(args.run_dir, args.out)
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    print(f"wrote {page} ({len(pngs)} figures: {', '.join(pngs)})")
    return 0
