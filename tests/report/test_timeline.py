"""The timeline figure: reading timeline.jsonl, the overlap numbers, and the Gantt chart in the report."""

import json

import pytest

from hybridflow.report import write_report
from hybridflow.report.timeline import draw_timeline, overlap_summary
from hybridflow.run_files import Span
from hybridflow.run_files import read_spans as load_timeline


def span(lane, stage, start, end, rank=0, step=1):
    return Span(step=step, lane=lane, stage=stage, rank=rank, start=start, end=end)


def write_spans(path, spans):
    path.write_text("".join(json.dumps(vars(s)) + "\n" for s in spans))


def test_load_round_trip_and_a_clear_error(tmp_path):
    spans = [span("actor", "gen", 0.0, 2.0), span("driver", "adv", 2.0, 2.1, rank=-1)]
    path = tmp_path / "timeline.jsonl"
    write_spans(path, spans)
    path.write_text(path.read_text() + "\n")  # a blank line is skipped
    assert load_timeline(path) == spans
    path.write_text(path.read_text() + '{"step": 1, "lane": "x"}\n')
    with pytest.raises(ValueError, match=r"timeline.jsonl:4: not a timeline span"):
        load_timeline(path)


def test_an_unfinished_last_line_is_skipped(tmp_path):
    spans = [span("actor", "gen", 0.0, 2.0)]
    path = tmp_path / "timeline.jsonl"
    write_spans(path, spans)
    path.write_text(path.read_text() + '{"step": 1, "lane": "cri')  # the run was killed mid-write
    assert load_timeline(path) == spans


def test_overlap_by_hand():
    spans = [
        span("a", "gen", 0.0, 2.0),
        span("a", "ref", 3.0, 4.0),
        span("a", "ref", 3.2, 3.8, rank=1),  # another rank of the same pool: not an overlap between pools
        span("b", "values", 1.0, 3.5),
        span("driver", "reward", 0.0, 5.0, rank=-1),  # the driver never counts
    ]
    row = overlap_summary(spans)[1]
    assert row["overlap_s"] == pytest.approx(1.0 + 0.5)  # [1, 2] and [3, 3.5]
    assert row["busy_s/a"] == pytest.approx(3.0) and row["busy_s/b"] == pytest.approx(2.5)
    assert row["busy_s/driver"] == pytest.approx(5.0) and row["step_s"] == pytest.approx(5.0)


def test_one_pool_never_overlaps():
    spans = [span("global", "gen", 0.0, 2.0), span("global", "ref", 1.0, 3.0, rank=1)]
    assert overlap_summary(spans)[1]["overlap_s"] == 0.0


def test_draw_writes_a_png_and_nothing_without_spans(tmp_path):
    spans = [span("actor", "gen", 0.0, 2.0, step=s) for s in (1, 2, 3, 4)] + [span("critic", "values", 1.0, 2.5)]
    assert draw_timeline(spans, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert not draw_timeline([], tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def minimal_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    return run


def test_report_has_the_timeline_when_the_run_wrote_one(tmp_path):
    run = minimal_run(tmp_path)
    page = write_report(run, tmp_path / "plain")
    assert not (tmp_path / "plain" / "timeline.png").exists() and "Timeline per resource pool" not in page.read_text()
    write_spans(run / "timeline.jsonl", [span("actor", "gen", 0.0, 2.0), span("critic", "values", 1.0, 3.0)])
    page = write_report(run, tmp_path / "with")
    assert (tmp_path / "with" / "timeline.png").is_file()
    assert "Timeline per resource pool" in page.read_text()
