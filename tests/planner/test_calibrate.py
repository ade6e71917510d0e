"""Calibration: the fits recover known coefficients from times the cost model itself produced, the
stored coefficients round-trip, and a real calibration of this machine gives usable numbers."""

import dataclasses
import math

import pytest

from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.planner.calibrate import calibrate, fit_decode_overhead, fit_pass_costs
from hybridflow.planner.cluster import CALIBRATED_FIELDS, PRESETS, load_calibration, save_calibration
from hybridflow.planner.cost import generation_seconds, pass_seconds
from hybridflow.planner.workload import ModelShape, Workload

SHAPE = ModelShape(name="m", layers=4, hidden=512, heads=8, kv_heads=4, ffn=1536, vocab=8192, tied_embeddings=False)
ONE = LayoutShape(dp=1, t=1, tg=1)  # one device
TRUE = dataclasses.replace(PRESETS["cpu"], train_efficiency=0.37, layer_overhead=0.0021, decode_layer_overhead=4e-4)


def work(samples: int, prompt: int, response: int) -> Workload:
    return Workload(
        models={Role.ActorRollout: SHAPE}, prompts=samples, n=1, prompt_length=prompt, response_length=response,
        micro_batch=samples,
    )  # fmt: skip


def test_the_pass_fit_recovers_efficiency_and_overhead():
    measured = [(w, pass_seconds(SHAPE, ONE, w, TRUE, backward=True)) for w in (work(4, 256, 0), work(1, 8, 0))]
    start = dataclasses.replace(TRUE, train_efficiency=0.9, layer_overhead=0.0)  # what the fit must not depend on
    efficiency, overhead = fit_pass_costs(start, SHAPE, measured)
    assert efficiency == pytest.approx(0.37, rel=1e-9)
    assert overhead == pytest.approx(0.0021, rel=1e-9)


def test_the_decode_fit_recovers_the_overhead():
    generation = work(16, 32, 32)
    seconds = generation_seconds(SHAPE, ONE, generation, TRUE)
    assert fit_decode_overhead(TRUE, SHAPE, generation, seconds) == pytest.approx(4e-4, rel=1e-9)


def test_the_coefficients_round_trip(tmp_path):
    path = save_calibration(TRUE, tmp_path / "cpu.json")
    loaded = load_calibration(PRESETS["cpu"], path)
    assert {f: getattr(loaded, f) for f in CALIBRATED_FIELDS} == {f: getattr(TRUE, f) for f in CALIBRATED_FIELDS}
    assert load_calibration(PRESETS["cpu"], tmp_path / "missing.json") is None


def test_calibrating_this_machine():
    cluster = calibrate(PRESETS["cpu"], repeats=1)
    for field in CALIBRATED_FIELDS:
        value = getattr(cluster, field)
        assert math.isfinite(value) and value >= 0, field
    assert 1e9 < cluster.flops < 1e13  # one core's bf16 matmuls
    assert 0 < cluster.train_efficiency <= 1
    assert cluster.collective_latency < 0.1 and cluster.intra_node_bandwidth > 1e6
