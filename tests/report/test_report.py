import base64
import json
import re

import pytest

from hybridflow.cli import main as cli
from hybridflow.report import load_metrics, main, write_report
from hybridflow.report.html import summarize
from hybridflow.report.plots import FIGURES

ALL_FIGURES = {
    "reward",
    "agent",
    "validation",
    "response_length",
    "kl",
    "entropy",
    "clip_fraction",
    "grad_norm",
    "loss",
    "preference",
    "staleness",
    "experts",
    "timing",
    "throughput",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_load_metrics_keeps_last_value_per_step_and_skips_junk(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 0, "val/score/mean": 0.1},
        {"step": 1, "critic/score/mean": 0.2, "note": "text", "bad": "nan"},
        {"step": 2, "critic/score/mean": 0.3},
        {"step": 2, "critic/score/mean": 0.35},  # a resumed run logged step 2 again
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + '\n{"step": 3, "critic/sc')  # killed mid-write
    metrics = load_metrics(path)
    assert set(metrics) == {"val/score/mean", "critic/score/mean"}
    assert metrics["critic/score/mean"].steps.tolist() == [1, 2]
    assert metrics["critic/score/mean"].values.tolist() == [0.2, 0.35]
    assert metrics["val/score/mean"].at(0) == 0.1


def test_report_renders_every_figure_and_embeds_it(run_dir, report_page):
    page = report_page
    assert page == run_dir / "report" / "report.html"
    pngs = {p.stem: p for p in page.parent.glob("*.png")}
    assert set(pngs) == ALL_FIGURES == {spec.name for spec in FIGURES}
    html = page.read_text()
    for name, png in pngs.items():
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
        assert f'id="{name}"' in html and base64.b64encode(data).decode() in html, name
    assert 'src="http' not in html and "<link" not in html  # one self-contained file
    assert "adv_estimator: grpo" in html  # config.yaml shown


def test_summary_table_final_and_best(run_dir, report_page):
    rows = {row.metric: row for row in summarize(load_metrics(run_dir / "metrics.jsonl"))}
    val = rows["val/score/mean"]
    assert (val.first, val.final_step) == (pytest.approx(0.2), 24)
    assert val.best == pytest.approx(val.final) and val.best_step == 24  # the fake run improves monotonically
    assert rows["val/countdown/pass@4"].best == pytest.approx(1.0)
    assert rows["actor/entropy"].best is None  # no better direction
    html = report_page.read_text()
    assert re.search(r"<td>val/arithmetic/pass@2</td><td>0\.42</td>", html)


def small_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "critic/score/mean": s / 10, "timing_s/gen": 1.0, "timing_s/step": 1.5} for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return run


def test_missing_metrics_are_skipped(tmp_path):
    page = write_report(small_run(tmp_path), tmp_path / "out")
    assert sorted(p.stem for p in page.parent.glob("*.png")) == ["reward", "timing"]
    assert page.read_text().count("<figure") == 2


def test_command(tmp_path, capsys):
    assert main([str(small_run(tmp_path))]) == 0
    assert "report.html" in capsys.readouterr().out and (tmp_path / "run" / "report" / "report.html").is_file()
    assert cli(["report", str(tmp_path / "nowhere")]) == 2
    assert "nowhere/metrics.jsonl': not found" in capsys.readouterr().err
