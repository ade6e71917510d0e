"""One self-contained HTML page: a table of final/best values and every figure embedded as base64 PNG."""

from __future__ import annotations

import base64
import datetime
import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridflow.report.data import Metrics, match

# (pattern, which way is better: "max", "min" or "" for neither)
SUMMARY = (
    ("critic/score/mean", "max"),
    ("val/score/mean", "max"),
    ("val/*/score_mean", "max"),
    ("val/*/mean@*", "max"),
    ("val/*/pass@*", "max"),
    ("response_length/mean", ""),
    ("response_length/clip_ratio", ""),
    ("actor/entropy", ""),
    ("actor/ppo_kl", ""),
    ("actor/kl_loss", ""),
    ("actor/reward_kl_penalty", ""),
    ("actor/pg_clipfrac", ""),
    ("actor/grad_norm", ""),
    ("actor/pg_loss", ""),
    ("critic/vf_loss", ""),
    ("val/dpo/reward_accuracy", "max"),
    ("val/dpo/loss", "min"),
    ("val/rm/accuracy", "max"),
    ("val/rm/loss", "min"),
    ("agent/tool_call_rate", ""),
    ("agent/num_turns/mean", ""),
    ("agent/tool_error_rate", "min"),
    ("agent/branches_per_session", ""),
    ("agent/trained_token_share", "max"),
    ("timing_s/step", "min"),
    ("perf/tokens_per_second", "max"),
)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; padding: 0 1em; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 1em 0 2em; font-size: 14px; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 14px; text-align: right; }
th:first-child, td:first-child { text-align: left; font-family: monospace; }
th { background: #f3f3f3; }
figure { margin: 0 0 2em; } figcaption { color: #888; font-size: 12px; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 12px; }
"""


@dataclass(frozen=True)
class SummaryRow:
    metric: str
    first: float
    final: float
    final_step: int
    best: float | None  # None: no better direction for this metric
    best_step: int | None


def summarize(metrics: Metrics) -> list[SummaryRow]:
    """First, final and (for metrics with a better direction) best value of each summary metric present."""
    rows = []
    for pattern, better in SUMMARY:
        for key in match(metrics, (pattern,)):
            series = metrics[key]
            best = best_step = None
            if better:
                index = int(np.argmax(series.values) if better == "max" else np.argmin(series.values))
                best, best_step = float(series.values[index]), int(series.steps[index])
            rows.append(
                SummaryRow(
                    key, float(series.values[0]), float(series.values[-1]), int(series.steps[-1]), best, best_step
                )
            )
    return rows


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def _table(rows: list[SummaryRow]) -> str:
    head = "<tr><th>metric</th><th>first</th><th>final</th><th>final step</th><th>best</th><th>best step</th></tr>"
    body = "".join(
        f"<tr><td>{html.escape(r.metric)}</td><td>{_number(r.first)}</td><td>{_number(r.final)}</td><td>{r.final_step}</td>"
        f"<td>{_number(r.best)}</td><td>{'—' if r.best_step is None else r.best_step}</td></tr>"
        for r in rows
    )
    return f"<table>{head}{body}</table>"


def _figure(title: str, png: Path) -> str:
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    alt = html.escape(f"{title} ({png.name})")
    image = f'<img alt="{alt}" src="data:image/png;base64,{data}">'
    return f'<figure id="{html.escape(png.stem)}">{image}<figcaption>{html.escape(png.name)}</figcaption></figure>'


def render_page(
    run_dir: Path, metrics: Metrics, figures: list[tuple[str, Path]], config_text: str | None = None
) -> str:
    """The page as a string; ``figures`` are (title, png path) pairs, embedded in that order."""
    steps = sorted({int(s) for series in metrics.values() for s in series.steps})
    span = f"steps {steps[0]}–{steps[-1]}" if steps else "no steps"
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>hybridflow report: {html.escape(run_dir.name)}</title><style>{STYLE}</style></head><body>",
        f"<h1>hybridflow run: {html.escape(run_dir.name)}</h1>",
        f"<p class='meta'>{html.escape(str(run_dir))} · {span} · {len(metrics)} metrics · made {now}</p>",
        "<h2>Summary</h2>",
        _table(summarize(metrics)) if metrics else "<p>No metrics logged yet.</p>",
        "<h2>Curves</h2>",
        *(_figure(title, png) for title, png in figures),
    ]
    if config_text:
        parts.append(
            f"<h2>Config</h2><details><summary>config.yaml</summary><pre>{html.escape(config_text)}</pre></details>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)
