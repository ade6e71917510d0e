"""Held-out scores of several seeds of one run, per data source: a markdown table (the mean over seeds and each
seed's value) and a plot (one panel per data source, a line per seed, the mean in bold).

    .venv/bin/python bench/validation_seeds.py RUN_DIR [RUN_DIR ...] [--metric score_mean] [--plot FILE]

Each RUN_DIR is a run's trainer.default_local_dir (its metrics.jsonl); the data sources are those the runs'
validation reported (val/<source>/<metric>), plus val/score/mean as "all".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def validations(run_dir: Path, metric: str) -> dict[str, dict[int, float]]:
    """{source: {step: value}} of one run's validations."""
    curves: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "val/score/mean" not in record:
            continue
        step = int(record.get("step", record.get("training/global_step", 0)))
        curves.setdefault("all", {})[step] = record["val/score/mean"]
        for key, value in record.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "val" and parts[2] == metric and ":" in parts[1]:
                curves.setdefault(parts[1].split(":", 1)[1], {})[step] = value
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--metric", default="score_mean")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    runs = [validations(run, args.metric) for run in args.runs]
    sources = sorted({s for run in runs for s in run if s != "all"}) + ["all"]
    steps = sorted({step for run in runs for step in run["all"]})
    print(f"| held-out {args.metric} (mean of {len(runs)} seeds; each seed) | " + " | ".join(map(str, steps)) + " |")
    print("| --- |" + " ---: |" * len(steps))
    for source in sources:
        cells = []
        for step in steps:
            values = [run[source][step] for run in runs if step in run.get(source, {})]
            mean = sum(values) / len(values)
            cells.append(f"**{mean:.3f}** ({', '.join(f'{v:.3f}' for v in values)})")
        print(f"| {source} | " + " | ".join(cells) + " |")
    if args.plot:
        figure, axes = plt.subplots(1, len(sources), figsize=(3.2 * len(sources), 3.0), sharex=True)
        for axis, source in zip(axes, sources):
            for k, run in enumerate(runs):
                points = sorted(run.get(source, {}).items())
                axis.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    color="0.6",
                    lw=1,
                    label="seeds" if k == 0 else None,
                )
            means = [sum(run[source][s] for run in runs) / len(runs) for s in steps]
            axis.plot(steps, means, color="C0", lw=2.5, marker="o", label="mean")
            axis.set_title(source, fontsize=10)
            axis.set_xlabel("step")
        axes[0].set_ylabel(f"held-out {args.metric}")
        axes[0].legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
