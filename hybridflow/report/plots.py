"""The curves people check first, drawn from a run's metrics into PNG files (matplotlib, Agg, no pyplot)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hybridflow.report.data import Metrics, match


@dataclass(frozen=True)
class Panel:
    """One axes: every metric matching ``keys`` as a line; ``band`` shades <name>/min..<name>/max under a
    <name>/mean."""

    title: str
    keys: tuple[str, ...]
    band: bool = False
    by_source: bool = False  # keys are val/<source>/<metric>: one colour per source, one line style per metric


@dataclass(frozen=True)
class FigureSpec:
    """One PNG file: panels side by side (``stacked``: one stacked-area panel of the timing_s/* stages)."""

    name: str
    title: str
    panels: tuple[Panel, ...] = ()
    stacked: bool = False


FIGURES = (
    FigureSpec(
        "reward",
        "Reward / score",
        (Panel("train score (per step) and validation score", ("critic/score/mean", "val/score/mean"), band=True),),
    ),
    FigureSpec(
        "validation",
        "Validation by data source",
        (
            Panel("score mean", ("val/*/score_mean",), by_source=True),
            Panel("pass@k / mean@n", ("val/*/pass@*", "val/*/mean@*"), by_source=True),
        ),
    ),
    FigureSpec(
        "response_length",
        "Response length",
        (
            Panel("response length (tokens)", ("response_length/mean",), band=True),
            Panel("fraction hitting the length limit", ("response_length/clip_ratio",)),
        ),
    ),
    FigureSpec(
        "kl",
        "KL",
        (
            Panel("PPO KL (old vs new policy)", ("actor/ppo_kl",)),
            Panel("KL loss (to reference)", ("actor/kl_loss",)),
            Panel("KL penalty in reward", ("actor/reward_kl_penalty",)),
        ),
    ),
    FigureSpec("entropy", "Entropy", (Panel("policy entropy (per token)", ("actor/entropy",)),)),
    FigureSpec(
        "clip_fraction",
        "Clip fraction",
        (Panel("fraction of tokens clipped", ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac")),),
    ),
    FigureSpec(
        "grad_norm",
        "Gradient norm",
        (
            Panel("actor grad norm", ("actor/grad_norm",)),
            Panel("critic grad norm", ("critic/grad_norm",)),
            Panel("SFT grad norm", ("sft/grad_norm",)),
            Panel("DPO and reward-model grad norm", ("dpo/grad_norm", "rm/grad_norm")),
        ),
    ),
    FigureSpec(
        "loss",
        "Losses",
        (
            Panel("policy loss", ("actor/pg_loss",)),
            Panel("value loss", ("critic/vf_loss",)),
            Panel("SFT: train and validation loss (per trained token)", ("sft/loss", "val/loss")),
            Panel("SFT: validation perplexity", ("val/perplexity",)),
        ),
    ),
    FigureSpec(
        "preference",
        "Preference pairs (DPO, reward model)",
        (
            Panel("DPO: train and validation loss", ("dpo/loss", "val/dpo/loss")),
            Panel("DPO: reward accuracy", ("dpo/reward_accuracy", "val/dpo/reward_accuracy")),
            Panel(
                "DPO: implicit rewards of the chosen and rejected answers",
                ("dpo/chosen_reward", "dpo/rejected_reward", "val/dpo/chosen_reward", "val/dpo/rejected_reward"),
            ),
            Panel("reward model: train and validation loss", ("rm/loss", "val/rm/loss")),
            Panel("reward model: pair accuracy", ("rm/accuracy", "val/rm/accuracy")),
            Panel(
                "reward model: scores of the chosen and rejected answers",
                ("rm/chosen_score", "rm/rejected_score", "val/rm/chosen_score", "val/rm/rejected_score"),
            ),
        ),
    ),
    FigureSpec(
        "agent",
        "Multi-turn rollout",
        (
            Panel("tool calls", ("agent/tool_call_rate", "agent/tool_calls_per_sample")),
            Panel("turns per sample", ("agent/num_turns/mean",), band=True),
            Panel("tool errors", ("agent/tool_error_rate", "agent/tool_errors_per_sample")),
            Panel("why conversations ended (fraction)", ("agent/stop/*",)),
            Panel(
                "agent sessions: branches started and trained per session",
                ("agent/branches_per_session", "agent/trained_branches_per_session"),
            ),
            Panel("agent sessions: share of generated tokens in the update", ("agent/trained_token_share",)),
        ),
    ),
    FigureSpec(
        "staleness",
        "Asynchronous training",
        (
            Panel(
                "staleness (policy versions): groups, and tokens (partial rollout)",
                ("async/staleness/mean", "async/token_staleness/mean"),
                band=True,
            ),
            Panel("fraction of groups at each staleness", ("async/staleness/frac_*",)),
            Panel(
                "queue: groups ready, requeued, dropped; samples continued",
                ("async/queue_groups", "async/*_groups", "async/continued_samples"),
            ),
            Panel("waits (s)", ("async/trainer_wait_s", "async/rollouter_idle_s", "async/push_wait_s")),
        ),
    ),
    FigureSpec(
        "experts",
        "Mixture of experts",
        (
            Panel("routers' balancing loss (k when balanced)", ("*/router_aux_loss",)),
            Panel("busiest expert's share of a layer's choices (1: balanced)", ("*/expert_load_max/layer_*",)),
        ),
    ),
    FigureSpec("timing", "Time per stage", stacked=True),
    FigureSpec(
        "throughput",
        "Throughput",
        (Panel("tokens per second", ("perf/tokens_per_second", "perf/generated_tokens_per_second")),),
    ),
)

PANEL_WIDTH, PANEL_HEIGHT, DPI = 5.2, 3.6, 110


LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")


def _style(key: str, keys: list[str], by_source: bool) -> dict[str, object]:
    """Colour by source and line style/marker by metric for per-source panels; the default colour cycle otherwise."""
    if not by_source:
        return {}
    sources = list(dict.fromkeys(k.split("/")[1] for k in keys))
    names = list(dict.fromkeys(k.split("/", 2)[2] for k in keys))
    source, name = key.split("/")[1], key.split("/", 2)[2]
    i = names.index(name)
    return {"color": f"C{sources.index(source) % 10}", "linestyle": LINE_STYLES[i % 4], "marker": MARKERS[i % 6]}


def _draw_panel(ax: Axes, metrics: Metrics, panel: Panel, keys: list[str]) -> None:
    for key in keys:
        series = metrics[key]
        sparse = len(series.steps) <= 3 or key.startswith("val/")  # validation runs every few steps: show the points
        style = {"marker": "o" if sparse else None, **_style(key, keys, panel.by_source)}
        line = ax.plot(series.steps, series.values, markersize=4, linewidth=1.6, label=key, **style)[0]
        stem = key.removesuffix("/mean")
        if panel.band and key.endswith("/mean") and f"{stem}/min" in metrics and f"{stem}/max" in metrics:
            low, high = metrics[f"{stem}/min"], metrics[f"{stem}/max"]
            if np.array_equal(low.steps, series.steps) and np.array_equal(high.steps, series.steps):
                ax.fill_between(
                    series.steps, low.values, high.values, color=line.get_color(), alpha=0.15, label=f"{stem} min..max"
                )
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if len(keys) > 4:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7, loc="best")


def _draw_timing(ax: Axes, metrics: Metrics) -> bool:
    """Stacked seconds per stage (every timing_s/* except the step total, which is drawn as a line on top)."""
    stages = [k for k in metrics if k.startswith("timing_s/") and k != "timing_s/step"]  # in the order first logged
    if not stages:
        return False
    steps = np.unique(np.concatenate([metrics[k].steps for k in stages]))
    stacks = []
    for key in stages:
        series, column = metrics[key], np.zeros(len(steps))
        column[np.searchsorted(steps, series.steps)] = series.values
        stacks.append(column)
    colors = [f"C{i % 10}" for i in range(len(stages))] if len(stages) <= 10 else None
    ax.stackplot(
        steps, np.vstack(stacks), labels=[k.removeprefix("timing_s/") for k in stages], colors=colors, alpha=0.85
    )
    if "timing_s/step" in metrics:
        total = metrics["timing_s/step"]
        ax.plot(total.steps, total.values, color="black", linewidth=1.4, linestyle="--", label="step (total)")
    ax.set_title("seconds per step, by stage", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        handles[::-1], labels[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0)
    )  # top of legend = top of stack
    return True


def draw_figure(metrics: Metrics, spec: FigureSpec, path: Path) -> bool:
    """Write one PNG; False (and no file) when none of its metrics are in the run."""
    if spec.stacked:
        figure = Figure(figsize=(PANEL_WIDTH * 1.6, PANEL_HEIGHT), dpi=DPI)
        FigureCanvasAgg(figure)
        if not _draw_timing(figure.add_subplot(1, 1, 1), metrics):
            return False
    else:
        present = [(panel, keys) for panel in spec.panels if (keys := match(metrics, panel.keys))]
        if not present:
            return False
        figure = Figure(figsize=(PANEL_WIDTH * len(present), PANEL_HEIGHT), dpi=DPI)
        FigureCanvasAgg(figure)
        for i, (panel, keys) in enumerate(present):
            _draw_panel(figure.add_subplot(1, len(present), i + 1), metrics, panel, keys)
    figure.suptitle(spec.title, fontsize=12, fontweight="bold")
    figure.tight_layout()
    figure.savefig(path, format="png")
    return True


def draw_all(metrics: Metrics, out_dir: Path) -> list[tuple[FigureSpec, Path]]:
    """Every figure whose metrics the run has, as ``out_dir/<name>.png``; missing metrics are skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = []
    for spec in FIGURES:
        path = out_dir / f"{spec.name}.png"
        if draw_figure(metrics, spec, path):
            drawn.append((spec, path))
        else:
            path.unlink(missing_ok=True)  # a stale figure from an earlier report
    return drawn
