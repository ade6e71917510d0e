"""A run's step timelines (``<run_dir>/timeline.jsonl``) as a Gantt chart per resource pool.

Each line of the file is one span of work (``run_files.Span``, written by hybridflow/trainer/services/timeline.py),
times in seconds since the step began, lane a pool's name or ``driver``. One row per (lane, rank), bars
coloured by stage: which pools worked at the same time, and which waited, shows at a glance.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from hybridflow.run_files import Span

# a fixed colour per known stage, so a stage looks the same in every report
STAGE_COLOURS = {
    "gen": "#4c72b0",
    "old_log_prob": "#55a868",
    "ref": "#8172b2",
    "teacher": "#8c613c",
    "values": "#ccb974",
    "rm": "#64b5cd",
    "reward": "#c44e52",
    "adv": "#937860",
    "update_actor": "#dd8452",
    "update_critic": "#da8bc3",
    "validate": "#8c8c8c",
    "save_checkpoint": "#4d4d4d",
}
EXTRA_COLOURS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d")


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def overlap_summary(spans: list[Span]) -> dict[int, dict[str, float]]:
    """Per step: ``busy_s/<lane>`` (time the lane had any rank working), ``step_s`` (the last span's end),
    and ``overlap_s``: the time during which two or more different worker pools (not the driver) worked."""
    summary: dict[int, dict[str, float]] = {}
    for step in sorted({span.step for span in spans}):
        in_step = [span for span in spans if span.step == step]
        lanes = sorted({span.lane for span in in_step})
        row = {f"busy_s/{lane}": _union_length([(s.start, s.end) for s in in_step if s.lane == lane]) for lane in lanes}
        row["step_s"] = max(span.end for span in in_step)
        # sweep over the pools' busy intervals (each pool's ranks merged first)
        events = []
        for lane in lanes:
            if lane == "driver":
                continue
            merged: list[list[float]] = []
            for start, end in sorted((s.start, s.end) for s in in_step if s.lane == lane):
                if merged and start <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            events += [(start, 1) for start, _ in merged] + [(end, -1) for _, end in merged]
        overlap, active, last = 0.0, 0, 0.0
        for time, change in sorted(events, key=lambda e: (e[0], e[1])):
            if active >= 2:
                overlap += time - last
            active += change
            last = time
        row["overlap_s"] = overlap
        summary[step] = row
    return summary


def _colours(spans: list[Span]) -> dict[str, str]:
    colours, extra = {}, iter(EXTRA_COLOURS * 10)
    for span in spans:
        if span.stage not in colours:
            colours[span.stage] = STAGE_COLOURS.get(span.stage) or next(extra)
    return colours


def _rows(spans: list[Span]) -> list[tuple[str, int]]:
    """(lane, rank) rows: the driver first, then pools in order of first appearance, ranks ascending."""
    lanes = list(dict.fromkeys(span.lane for span in sorted(spans, key=lambda s: s.start)))
    lanes = sorted(lanes, key=lambda lane: (lane != "driver", lanes.index(lane)))
    return [(lane, rank) for lane in lanes for rank in sorted({s.rank for s in spans if s.lane == lane})]


def draw_timeline(spans: list[Span], path: Path, steps: list[int] | None = None) -> bool:
    """A Gantt chart of ``steps`` (default: the last three) into ``path``; False (no file) without spans."""
    if not spans:
        return False
    steps = steps or sorted({span.step for span in spans})[-3:]
    chosen = [span for span in spans if span.step in steps]
    if not chosen:
        return False
    rows = _rows(chosen)
    colours = _colours(chosen)
    summary = overlap_summary(chosen)
    figure = Figure(figsize=(11, 0.5 + len(steps) * (0.6 + 0.35 * len(rows))), dpi=110)
    FigureCanvasAgg(figure)
    for index, step in enumerate(steps):
        ax = figure.add_subplot(len(steps), 1, index + 1)
        for y, (lane, rank) in enumerate(rows):
            bars = [
                (s.start, s.end - s.start, s.stage)
                for s in chosen
                if s.step == step and (s.lane, s.rank) == (lane, rank)
            ]
            for start, width, stage in bars:
                ax.broken_barh([(start, max(width, 1e-3))], (y - 0.4, 0.8), facecolors=colours[stage])
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([lane if lane == "driver" else f"{lane} r{rank}" for lane, rank in rows], fontsize=8)
        ax.invert_yaxis()
        row = summary.get(step, {})
        ax.set_title(
            f"step {step} ({row.get('step_s', 0.0):.1f} s, pools at work together {row.get('overlap_s', 0.0):.1f} s)",
            fontsize=9,
            loc="left",
        )
        ax.grid(axis="x", alpha=0.3)
    figure.axes[-1].set_xlabel("seconds since the step began")
    handles = [Patch(facecolor=colour, label=stage) for stage, colour in colours.items()]
    figure.legend(handles=handles, loc="upper right", fontsize=8, ncol=min(len(handles), 6))
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    figure.savefig(path, format="png")
    return True
