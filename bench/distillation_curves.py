"""Held-out accuracy of several training methods against steps and against seconds, and what each needs to reach a
fraction of the teacher's accuracy: a markdown table and a plot (docs/distillation.md).

    .venv/bin/python bench/distillation_curves.py --teacher 0.63 \
        --run "on-policy distillation=RUN_DIR[,RUN_DIR...]" --run "GRPO=RUN_DIR" \
        --points "off-policy (SFT)=POINTS.json" [--share 0.9] [--plot FILE]

``--run``: RL runs (their metrics.jsonl): the held-out accuracy is ``--metric`` (``val/score/mean``) at each
validation, the seconds the sum of ``timing_s/step`` up to that step (validation excluded). ``--metric
critic/score/mean`` reads the training samples' accuracy of every step instead. Several runs of one method (seeds) are
averaged per step. ``--points``: a method measured outside a run's validation (an SFT run's checkpoints, each
exported and scored by ``hybridflow measure``): a JSON list of ``{"step", "seconds", "accuracy"}``. ``--teacher``: the
teacher's held-out accuracy; a method reaches ``--share`` of it at the first validation at or above.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Curve = list[tuple[int, float, float]]  # (step, seconds of training up to it, held-out accuracy)


def run_curve(run_dir: Path, metric: str = "val/score/mean") -> Curve:
    """(step, seconds, accuracy) at each record of one RL run that has ``metric``."""
    seconds, points = 0.0, []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        seconds += record.get("timing_s/step", 0.0)
        if metric in record:
            points.append((int(record["step"]), seconds, record[metric]))
    return points


def mean_curve(curves: list[Curve]) -> Curve:
    """The steps every curve has, each with the mean seconds and accuracy over the curves."""
    steps = sorted(set.intersection(*({p[0] for p in curve} for curve in curves)))
    by_step = [{p[0]: p for p in curve} for curve in curves]
    return [
        (
            step,
            sum(c[step][1] for c in by_step) / len(by_step),
            sum(c[step][2] for c in by_step) / len(by_step),
        )
        for step in steps
    ]


def first_reaching(curve: Curve, target: float) -> tuple[int, float] | None:
    """(step, seconds) of the first point at or above ``target``."""
    return next(((step, seconds) for step, seconds, accuracy in curve if accuracy >= target), None)


def named(value: str) -> tuple[str, str]:
    name, sep, rest = value.rpartition("=")  # a name may hold "=", a path rarely does
    if not sep:
        raise argparse.ArgumentTypeError(f"{value!r}: give NAME=PATH")
    return name, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=named, action="append", default=[], help="NAME=RUN_DIR[,RUN_DIR...]")
    parser.add_argument("--points", type=named, action="append", default=[], help="NAME=POINTS.json")
    parser.add_argument("--teacher", type=float, required=True, help="the teacher's held-out accuracy")
    parser.add_argument("--share", type=float, default=0.9, help="the fraction of the teacher's accuracy to reach")
    parser.add_argument("--metric", default="val/score/mean", help="the accuracy key of the runs' metrics")
    parser.add_argument("--ylabel", default="held-out accuracy (greedy)", help="the plot's accuracy axis")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    methods: dict[str, tuple[Curve, list[Curve]]] = {}
    for name, dirs in args.run:
        seeds = [run_curve(Path(d), args.metric) for d in dirs.split(",")]
        methods[name] = (mean_curve(seeds), seeds)
    for name, file in args.points:
        points = json.loads(Path(file).read_text())
        curve = [(int(p["step"]), float(p["seconds"]), float(p["accuracy"])) for p in points]
        methods[name] = (curve, [curve])

    target = args.share * args.teacher
    steps = sorted({p[0] for curve, _ in methods.values() for p in curve})
    print("| method (seeds) | " + " | ".join(f"step {s}" for s in steps) + f" | reaches {target:.3f} at |")
    print("| --- |" + " ---: |" * (len(steps) + 1))
    for name, (curve, seeds) in methods.items():
        at = {p[0]: p for p in curve}
        cells = []
        for step in steps:
            if step not in at:
                cells.append("")
                continue
            each = [dict((p[0], p[2]) for p in seed).get(step) for seed in seeds]
            spread = f" ({', '.join(f'{v:.2f}' for v in each)})" if len(seeds) > 1 else ""
            cells.append(f"{at[step][2]:.2f}{spread}")
        reached = first_reaching(curve, target)
        where = f"step {reached[0]}, {reached[1] / 60:.1f} min" if reached else "not reached"
        print(f"| {name} ({len(seeds)}) | " + " | ".join(cells) + f" | {where} |")

    if args.plot:
        figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        for k, (name, (curve, _)) in enumerate(methods.items()):
            colour = f"C{k}"
            by_step.plot([p[0] for p in curve], [p[2] for p in curve], marker="o", color=colour, label=name)
            by_time.plot([p[1] / 60 for p in curve], [p[2] for p in curve], marker="o", color=colour, label=name)
        for axis in (by_step, by_time):
            axis.axhline(args.teacher, color="0.3", lw=1, ls="--")
            axis.axhline(target, color="0.6", lw=1, ls=":")
            axis.grid(alpha=0.3)
        by_step.text(0, args.teacher + 0.005, "teacher", fontsize=8, color="0.3")
        by_step.set_xlabel("step")
        by_time.set_xlabel("minutes of training (each run under its own load)")
        by_step.set_ylabel(args.ylabel)
        by_step.legend(fontsize=8, loc="lower right")
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
