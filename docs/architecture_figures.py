"""Draw docs/images/layers.png and docs/images/dataflow.png, the two pictures of docs/architecture.md.

    .venv/bin/python docs/architecture_figures.py

The layers come from the import-linter contract in pyproject.toml (the rules `make test` checks) and
the arrows from the package's real imports (grimp, the graph import-linter reads), so the picture
shows the code as it is: an arrow from A to B means some module of A imports one of B, with the
number of such module pairs. The dataflow is the driver's step (trainer/loop/rl_trainer.py) drawn by hand.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import grimp
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "images"

ROLE = {  # one line per package, as docs/architecture.md's table says it
    "__main__": "python -m hybridflow",
    "cli": "the hybridflow command",
    "planner": "auto-mapping: hybridflow plan",
    "report": "hybridflow report",
    "trainer": "config, run plan, fit loop, checkpoints",
    "workers": "role classes of the worker groups",
    "hybrid_engine": "actor: training <-> generation layout",
    "engine": "one model under FSDP2 / TP: passes, update",
    "rollout": "generation backends, agent loops",
    "reward": "reward manager, scorers",
    "data": "datasets, loader, tasks",
    "tools": "tools, sandbox",
    "algorithms": "RL math, registries",
    "models": "built-in models, loaders, TP table",
    "controller": "single-controller runtime on Ray",
    "lengths": "tokens per row",
    "user_code": "a user's file.py:name",
    "run_files": "run directory format",
    "procfs": "process memory",
    "protocol": "DataProto",
    "batch_keys": "column names",
    "validation": "UserError, InvalidSetting",
}


def contract_layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    return [[name.strip() for name in layer.split("|")] for layer in layers]


def package_imports() -> Counter:
    """(importer package, imported package) -> how many module pairs import across them."""
    graph = grimp.build_graph("hybridflow", cache_dir=None)
    counts: Counter = Counter()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = module.split(".")[1:2], imported.split(".")[1:2]
            if a and b and a != b:
                counts[(a[0], b[0])] += 1
    return counts


def draw_layers(path: Path) -> None:
    layers = contract_layers()
    counts = package_imports()
    width, height = 15.0, 1.05 * len(layers) + 0.6
    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    centre: dict[str, tuple[float, float]] = {}
    box_h = 0.62
    for row, layer in enumerate(layers):
        y = height - 0.7 - row * 1.05
        box_w = min(2.35, (width - 1.6) / len(layer) - 0.2)
        start = (width - len(layer) * (box_w + 0.2)) / 2
        for index, name in enumerate(layer):
            x = start + index * (box_w + 0.2)
            ax.add_patch(
                FancyBboxPatch(
                    (x, y - box_h / 2),
                    box_w,
                    box_h,
                    boxstyle="round,pad=0.02",
                    fc="#dce6f2",
                    ec="#4c72b0",
                    lw=1,
                    zorder=2,
                )
            )
            ax.text(x + box_w / 2, y + 0.1, name, ha="center", va="center", fontsize=9, weight="bold", zorder=3)
            ax.text(x + box_w / 2, y - 0.16, ROLE.get(name, ""), ha="center", va="center", fontsize=6.5, zorder=3)
            centre[name] = (x + box_w / 2, y)
        if len(layer) > 1:
            ax.text(0.15, y, "independent", fontsize=6.5, color="#777777", va="center")
    for (a, b), count in counts.items():
        if a in centre and b in centre:
            (x0, y0), (x1, y1) = centre[a], centre[b]
            ax.add_patch(
                FancyArrowPatch(
                    (x0, y0 - box_h / 2),
                    (x1, y1 + box_h / 2),
                    arrowstyle="-|>",
                    mutation_scale=7,
                    color="#c44e52" if y1 > y0 else "#999999",
                    alpha=0.35,
                    lw=0.4 + 0.12 * min(count, 12),
                    connectionstyle="arc3,rad=0.08",
                    zorder=1,
                )
            )
    ax.text(
        width - 0.2,
        0.2,
        "arrows: real imports between packages (width: module pairs); every one points down (import-linter checks it)",
        ha="right",
        fontsize=7,
        color="#555555",
    )
    figure.savefig(path)


STAGES = [  # (column, row, label, who runs it); rows are 0 (top) to 4
    (0, 2, "prompts\n(data loader)", "driver"),
    (1, 2, "generate_sequences", "actor"),
    (2, 0, "reward\n(rule-based / custom)", "driver"),
    (2, 1, "compute_rm_score", "reward model"),
    (2, 2, "compute_log_prob\n(old log-probs)", "actor"),
    (2, 3, "compute_ref_log_prob", "reference"),
    (2, 4, "compute_values", "critic"),
    (3, 2, "KL penalty,\nadvantages", "driver"),
    (4, 1, "update_actor", "actor"),
    (4, 3, "update_critic", "critic"),
    (5, 2, "metrics, validation,\ncheckpoint", "driver"),
]
COLOURS = {
    "driver": "#eeeeee",
    "actor": "#dd8452",
    "reference": "#8172b2",
    "critic": "#ccb974",
    "reward model": "#64b5cd",
}
FLOWS = [(0, 1), *[(1, stage) for stage in range(2, 7)], *[(stage, 7) for stage in range(2, 7)], (7, 8), (7, 9)]
FLOWS += [(8, 10), (9, 10)]


def draw_dataflow(path: Path) -> None:
    figure = Figure(figsize=(14, 5.2), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.2, 14.0)
    ax.set_ylim(-1.3, 4.6)
    ax.axis("off")
    w, h = 1.9, 0.68
    where = {}
    for index, (column, row, label, who) in enumerate(STAGES):
        x, y = column * 2.4, 4.2 - row * 1.0
        ax.add_patch(FancyBboxPatch((x, y - h / 2), w, h, boxstyle="round,pad=0.03", fc=COLOURS[who], ec="#555555"))
        ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=8)
        where[index] = (x, y)
    for a, b in FLOWS:
        (xa, ya), (xb, yb) = where[a], where[b]
        ax.add_patch(
            FancyArrowPatch((xa + w, ya), (xb, yb), arrowstyle="-|>", mutation_scale=9, color="#555555", lw=0.8)
        )
    for index, (who, colour) in enumerate(COLOURS.items()):
        ax.add_patch(FancyBboxPatch((index * 2.6, -0.6), 0.3, 0.25, boxstyle="square,pad=0", fc=colour, ec="#555555"))
        ax.text(index * 2.6 + 0.4, -0.48, who if who == "driver" else f"{who} worker group", fontsize=8, va="center")
    ax.text(
        0,
        -1.05,
        "The stages of one column are issued together (group.method.future): on different pools (trainer.placement) "
        "they run at the same time, on one pool one after another.",
        fontsize=8,
        color="#555555",
    )
    figure.savefig(path)


if __name__ == "__main__":
    draw_layers(OUT / "layers.png")
    draw_dataflow(OUT / "dataflow.png")
    print(f"wrote {OUT / 'layers.png'} and {OUT / 'dataflow.png'}")
